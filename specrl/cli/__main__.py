"""`python -m specrl.cli ...`: the `specrl` command line run as a module (the Makefile and benchmarks use it)."""

from specrl.cli import main

main()

"""specrl.cli: the `specrl` command line, one module per command group: `training` (prepare, run, train),
`generation` (generate), `drafts` (the `draft` group), `backends` (check-backend); `common` holds the Typer app and
the options they share, and `specrl.sim.commands` registers `simulate`. Each verb is a thin shell over the library:
it parses and validates flags, calls the API, and prints a readable summary. Errors of user input (`SpecRLError`)
are printed as one line and exit with status 2.
"""

from __future__ import annotations

from specrl.cli import backends, drafts, generation, training  # noqa: F401  (each registers its commands on `app`)
from specrl.cli.common import app

__all__ = ["app", "main"]


def main() -> None:
    """The `specrl` console script (`pyproject.toml`) and `python -m specrl.cli`."""
    app()

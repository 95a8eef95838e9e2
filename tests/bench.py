"""The one way tests load a benchmark script: `load_benchmark("pipelines")` runs benchmarks/pipelines.py as a
module (the scripts are not a package), registered in sys.modules under its name (dataclasses look their module up
there), and returns it."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path
from types import ModuleType

BENCH = Path(__file__).resolve().parents[1] / "benchmarks"


def load_benchmark(name: str, module_name: str | None = None) -> ModuleType:
    """benchmarks/NAME.py as a fresh module named `module_name` (default: NAME)."""
    spec = importlib.util.spec_from_file_location(module_name or name, BENCH / f"{name}.py")
    mod = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = mod
    spec.loader.exec_module(mod)
    return mod

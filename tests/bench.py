"""The one way tests load a script: `load_benchmark("pipelines")` runs benchmarks/pipelines.py and
`load_tool("overlay_seeds")` runs tools/overlay_seeds.py as a module (the scripts are not a package), registered in
sys.modules under its name (dataclasses look their module up there), and returns it."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path
from types import ModuleType

ROOT = Path(__file__).resolve().parents[1]
BENCH = ROOT / "benchmarks"
TOOLS = ROOT / "tools"


def load_benchmark(name: str, module_name: str | None = None) -> ModuleType:
    """benchmarks/NAME.py as a fresh module named `module_name` (default: NAME)."""
    return _load(BENCH / f"{name}.py", module_name or name)


def load_tool(name: str) -> ModuleType:
    """tools/NAME.py as a fresh module named NAME."""
    return _load(TOOLS / f"{name}.py", name)


def _load(path: Path, module_name: str) -> ModuleType:
    spec = importlib.util.spec_from_file_location(module_name, path)
    mod = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = mod
    spec.loader.exec_module(mod)
    return mod

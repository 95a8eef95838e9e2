"""Users' extensions, imported in every process before a config is validated.

A registry (drafter kinds, backends, losses) is a per-process table, and the async pipeline's Ray actors and the
learner ranks rebuild the config in fresh processes: a loss registered in the user's script would be unknown
there. So extensions live in importable modules, named in the config's top-level `plugins` list (a dotted module
name, or a path to a `.py` file) and/or advertised by an installed package under the entry-point group
`specrl.plugins` (as vLLM's plugins are). `specrl.config.schema.validate_config` calls `load_plugins` first, in the
driver, every actor and every rank alike, so the registries hold the same names everywhere before the config is
checked against them. Importing is idempotent (a module is imported once per process); a file path is made
absolute on the driver, so a process with another working directory imports the same file, and an actor on
another node of a Ray cluster, where that path does not exist, imports the copy its runtime env carries
(`specrl.cluster.plugin_env`). An entry point that fails to load is tried again on the next call. Lower layer:
imports errors only.
"""

from __future__ import annotations

import hashlib
import importlib
import importlib.util
import sys
from importlib.metadata import entry_points
from pathlib import Path

from specrl.errors import SpecRLError

ENTRY_POINT_GROUP = "specrl.plugins"
_entry_points_loaded = False  # every entry point has loaded in this process
_entry_points_done: set[str] = set()  # the entry points (`module:attr`) loaded so far


def resolve(spec: str) -> str:
    """A plugin entry as every process should read it: a `.py` path made absolute, a module name as given."""
    if not isinstance(spec, str) or not spec.strip():
        raise SpecRLError(f"plugins: each entry is a module name (my_pkg.extensions) or a path to a .py file, got "
                          f"{spec!r}")
    return str(Path(spec).expanduser().resolve()) if spec.endswith(".py") else spec


def import_file(path: str | Path, what: str = "plugins"):
    """The module of a .py file, imported once per process (a plugin and a reward function in the same file share
    it, so its registrations run once). `what` names the config key in errors."""
    path = Path(path).expanduser().resolve()
    name = f"specrl_plugin_{path.stem}_{hashlib.sha256(str(path).encode()).hexdigest()[:10]}"
    if name in sys.modules:
        return sys.modules[name]
    source = path if path.is_file() else runtime_env_copy(path)
    if source is None:
        raise SpecRLError(f"{what}: {path} does not exist; give a path to a .py file or an importable module name")
    spec = importlib.util.spec_from_file_location(name, source)
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    try:
        spec.loader.exec_module(module)
    except Exception as e:
        del sys.modules[name]
        raise SpecRLError(f"{what}: importing {path} failed ({type(e).__name__}: {e})") from e
    return module


def runtime_env_copy(path: Path) -> Path | None:
    """The copy of the driver's plugin file `path` that a Ray runtime env put on this process's module path (an
    actor on another node, where the driver's path does not exist: `specrl.cluster.plugin_env`), or None."""
    try:
        found = importlib.util.find_spec(path.stem)
    except (ImportError, ValueError):
        return None
    if found is None or not found.origin or Path(found.origin).name != path.name:
        return None
    return Path(found.origin)


def load_plugins(specs: list[str] | tuple[str, ...] = ()) -> list[str]:
    """Import every plugin in `specs` and every installed `specrl.plugins` entry point (once per process);
    return the resolved specs. A plugin that cannot be imported is a SpecRLError naming it."""
    global _entry_points_loaded
    if not isinstance(specs, (list, tuple)):
        raise SpecRLError(f"plugins must be a list of module names or .py paths, got {type(specs).__name__}")
    if not _entry_points_loaded:
        for ep in entry_points(group=ENTRY_POINT_GROUP):
            if ep.value in _entry_points_done:
                continue
            try:
                ep.load()
            except Exception as e:  # not marked: the next call tries it again, and the ones after it
                raise SpecRLError(f"the installed specrl plugin {ep.name!r} ({ep.value}) failed to load "
                                  f"({type(e).__name__}: {e})") from e
            _entry_points_done.add(ep.value)
        _entry_points_loaded = True  # only once every entry point has loaded
    out = []
    for spec in specs:
        r = resolve(spec)
        if r.endswith(".py"):
            import_file(r)
        else:
            try:
                importlib.import_module(r)
            except ImportError as e:
                raise SpecRLError(f"plugins: cannot import module {r!r} ({e}); it must be importable in every "
                                  "process (installed, or on PYTHONPATH), or give a path to a .py file") from e
        out.append(r)
    return out

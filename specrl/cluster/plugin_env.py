"""The users' code every Ray actor needs, carried to it: the Ray `runtime_env` of the config's plugins.

Every actor imports the config's `plugins` (and the modules and files of `reward.functions`) before it validates
the config (`specrl.plugins`). On the driver's own machine they are on its disk; an actor placed on another node of
a Ray cluster has neither the driver's `.py` files nor its local packages. `plugin_runtime_env` is the `runtime_env`
each actor is created with (`py_modules`, uploaded to the cluster first, as `ray.init` does for a job): a plugin
file as itself, a plugin module as its top-level package (or single-file module) directory as found on the driver.
A module installed as a distribution (under a `site-packages` directory) is not carried: installing it on every
node is the cluster's part, as for specrl itself and the `specrl.plugins` entry points. On the other node
`specrl.plugins.import_file` imports the carried copy of a file whose driver path does not exist there.
`actor_options` adds it to an actor's `.options(...)`; every actor the async pipeline and the learner group create
with the config goes through it.
"""

from __future__ import annotations

import importlib
import os
import site
import sys
import sysconfig
from pathlib import Path

from specrl.errors import SpecRLError
from specrl.plugins import resolve


def _installed_roots() -> list[Path]:
    roots = {sysconfig.get_paths().get(k) for k in ("purelib", "platlib")}
    roots.update(site.getsitepackages() if hasattr(site, "getsitepackages") else [])
    roots.add(site.getusersitepackages() if hasattr(site, "getusersitepackages") else None)
    return [Path(r).resolve() for r in roots if r]


def _module_source(name: str, strict: bool = True) -> Path | None:
    """The directory (a package) or file (a single-file module) of `name`'s top-level module on the driver, or None
    when it is specrl's, installed as a distribution, or built in (or, not `strict`, not importable here)."""
    top = name.split(".", 1)[0]
    if top == "specrl":
        return None
    try:
        module = sys.modules.get(top) or importlib.import_module(top)
    except ImportError as e:
        if not strict:
            return None
        raise SpecRLError(f"plugins: cannot import module {top!r} ({e}) to carry it to the Ray actors; it must be "
                          "importable on the driver (installed, or on PYTHONPATH)") from None
    paths = list(getattr(module, "__path__", []) or [])
    if len(paths) > 1:
        raise SpecRLError(f"plugins: module {top!r} is a namespace package over {len(paths)} directories "
                          f"({', '.join(map(str, paths))}); Ray can carry one directory: make it a regular package")
    src = Path(paths[0]) if paths else Path(module.__file__) if getattr(module, "__file__", None) else None
    if src is None:
        return None
    src = src.resolve()
    if any(src.is_relative_to(r) for r in _installed_roots()):
        return None
    return src


def plugin_runtime_env(data: dict) -> dict | None:
    """The `runtime_env` ({"py_modules": [...]}) carrying the plugins and reward modules named in the config dict
    `data` (`TrainConfig.model_dump`), or None when there is nothing to carry."""
    specs = [(resolve(s), True) for s in data.get("plugins") or []]
    for fn in (data.get("reward") or {}).get("functions") or []:
        module, sep, _ = str(fn).rpartition(":")
        if sep and (module.endswith(".py") or "/" in module):
            specs.append((str(Path(module).expanduser().resolve()), False))
        elif sep and module:
            specs.append((module, False))  # the producer imports it later, from its working directory
    out: list[str] = []
    for spec, strict in specs:
        src = (Path(spec) if Path(spec).is_file() else None) if spec.endswith(".py") else _module_source(spec, strict)
        if src is not None and str(src) not in out:
            out.append(str(src))
    return {"py_modules": out} if out else None


def _uploaded(env: dict) -> dict:
    """`env` with its local `py_modules` uploaded to the connected Ray cluster (as `ray.init(runtime_env=...)` does
    for a job): an actor's own runtime env takes URIs only."""
    import tempfile

    from ray._private.runtime_env.py_modules import upload_py_modules_if_needed

    include_gitignore = os.environ.get("RAY_RUNTIME_ENV_IGNORE_GITIGNORE", "0") != "1"  # Ray's own default
    with tempfile.TemporaryDirectory(prefix="specrl-plugins-") as scratch:
        return upload_py_modules_if_needed(dict(env), include_gitignore=include_gitignore, scratch_dir=scratch)


def actor_options(data: dict, **options) -> dict:
    """`options` for an actor's `.options(...)`, with the config's `plugin_runtime_env` (uploaded to the connected
    Ray cluster) when it has one."""
    env = plugin_runtime_env(data)
    return {**options, "runtime_env": _uploaded(env)} if env else options

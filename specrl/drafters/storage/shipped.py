"""Drafters shipped inside the package: `specrl/drafters/shipped/NAME/` (config.json, model.safetensors, manifest.json).

A shipped drafter is an ordinary drafter directory (`io.py`) in its shipped dtype plus `manifest.json`: the kind,
the target model it was trained for and that model's shape (hidden size, layers, vocabulary) and vocabulary
sha256, the draft vocabulary size, the dtype, the recipe and the data hash of the rollouts it was trained on
(`shards.data_hash`), the commit that built it, the seed, the sha256 of each file, and the evaluator's output
(held-out AL per k and per position, top-1, cost). `SHIPPED` names what the package ships (name -> kind), so a
shipped name whose manifest is missing or edited is an error, never a drafter built anew. `load_shipped` loads
through `io.load_drafter`, which verifies any directory holding a manifest (`manifest.verify_manifest`: every
file's sha256, the manifest against the config, the weights and the actual target) and refuses any mismatch with
a SpecRLError naming the field. `package` writes such a directory from a trained head (the build's `package`
stage).
"""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path

import torch

from specrl.drafters.storage.manifest import (  # noqa: F401  (re-exported: the shipped drafters' names)
    FILES,
    MANIFEST,
    MANIFEST_FORMAT,
    SHIPPED_DIR,
    sha256_of,
    target_record,
    verify_manifest,
)
from specrl.errors import SpecRLError
from specrl.fileio import write_text_atomic

SHIPPED_DTYPE = "bfloat16"
# what the package ships: name -> kind (tests check the files)
SHIPPED = {"default": "eagle", "think": "eagle", "think-parallel-markov": "parallel"}


def shipped_dir(name: str, root: Path | None = None) -> Path:
    return (SHIPPED_DIR if root is None else Path(root)) / name


def is_shipped(kind: str, name: str, root: Path | None = None) -> bool:
    """Whether the package ships drafter `kind:name` (`SHIPPED`; under another `root`, a directory `name`). Its
    files are not consulted: a shipped name whose manifest is missing or edited is refused by `load_shipped`."""
    if root is None:
        return SHIPPED.get(name) == kind
    return shipped_dir(name, root).is_dir()


def _commit() -> str | None:
    try:
        out = subprocess.run(["git", "rev-parse", "HEAD"], cwd=Path(__file__).parent, capture_output=True, text=True,
                             timeout=10)
        dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], cwd=Path(__file__).parent,
                               capture_output=True, text=True, timeout=10).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        return None
    return (out.stdout.strip() + ("-dirty" if dirty else "")) if out.returncode == 0 else None


def package(drafter, target, dest: Path, name: str, recipe: dict, data_hash: str, evaluation: dict | None,
            extra: dict | None = None, dtype: str = SHIPPED_DTYPE) -> Path:
    """Write `drafter` in `dtype` into `dest` with its manifest; return `dest`."""
    from specrl.drafters.storage.io import save_drafter

    dest = Path(dest)
    dest.mkdir(parents=True, exist_ok=True)
    save_drafter(drafter.to(getattr(torch, dtype)), dest)
    manifest = {
        "format": MANIFEST_FORMAT, "name": name, "kind": drafter.kind, "target_model": recipe["model"],
        **target_record(target),
        "draft_vocab_size": int(drafter.d2t.numel()), "dtype": dtype, "recipe": recipe, "data_hash": data_hash,
        "commit": _commit(), "seed": recipe.get("seed"),
        "files": {f: sha256_of(dest / f) for f in FILES}, "eval": evaluation, **(extra or {}),
    }
    write_text_atomic(dest / MANIFEST, json.dumps(manifest, indent=1) + "\n")
    return dest


def check_shipped(d: Path, target=None, target_model: str | None = None) -> dict:
    """Verify a shipped drafter directory (`verify_manifest`, its manifest required) and, with `target_model`, that
    it serves that model; return its manifest."""
    d = Path(d)
    m = verify_manifest(d, target, required=True)
    if target_model is not None and m.get("target_model") != target_model:
        raise SpecRLError(f"shipped drafter {d}: manifest target_model is {m.get('target_model')!r}, but this "
                          f"drafter serves {target_model!r}; use a drafter trained for {m.get('target_model')!r}'s "
                          f"target, or reinstall specrl")
    return m


def load_shipped(kind: str, name: str, target, root: Path | None = None, dtype=None):
    """The shipped drafter `kind:name` for `target`, verified against its manifest and the target first, in `dtype`
    (default: the dtype it is stored in, `SHIPPED_DTYPE`)."""
    from specrl.drafters.storage.io import load_drafter

    d = shipped_dir(name, root)
    m = verify_manifest(d, target, required=True)
    if m.get("kind") != kind:
        raise SpecRLError(f"shipped drafter {d}: manifest kind is {m.get('kind')!r}, but {kind}:{name} asks for a "
                          f"{kind} drafter; use {m.get('kind')}:{name}")
    return load_drafter(d, target, expected_kind=kind, dtype=dtype)


def package_size(d: Path) -> int:
    return sum(os.path.getsize(p) for p in Path(d).iterdir() if p.is_file())

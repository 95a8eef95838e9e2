"""Drafters shipped inside the package: `specrl/drafters/shipped/NAME/` (config.json, model.safetensors, manifest.json).

A shipped drafter is an ordinary drafter directory (`io.py`) in its shipped dtype plus `manifest.json`: the kind,
the target model it was trained for and that model's shape (hidden size, layers, vocabulary), the draft
vocabulary size, the dtype, the recipe and the data hash of the rollouts it was trained on (`shards.data_hash`),
the commit that built it, the seed, the sha256 of each file, and the evaluator's output (held-out AL per k and
per position, top-1, cost). `load_shipped` checks every file's sha256 and the manifest against the config, the
weights and the target before loading, and refuses any mismatch with a SpecRLError naming the field, what it is
and what would be right: a shipped drafter is never loaded silently when something disagrees. `package` writes
such a directory from a trained head (the build's `package` stage).
"""

from __future__ import annotations

import hashlib
import json
import os
import subprocess
from pathlib import Path

import torch

from specrl.errors import SpecRLError
from specrl.fileio import write_text_atomic

SHIPPED_DIR = Path(__file__).parent / "shipped"
MANIFEST = "manifest.json"
MANIFEST_FORMAT = "specrl-shipped-drafter"
FILES = ("config.json", "model.safetensors")
SHIPPED_DTYPE = "bfloat16"


def sha256_of(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def shipped_dir(name: str, root: Path | None = None) -> Path:
    return (SHIPPED_DIR if root is None else Path(root)) / name


def is_shipped(kind: str, name: str, root: Path | None = None) -> bool:
    """Whether the package ships drafter `kind:name` (its manifest exists and names that kind)."""
    f = shipped_dir(name, root) / MANIFEST
    if not f.exists():
        return False
    try:
        return json.loads(f.read_text()).get("kind") == kind
    except (OSError, json.JSONDecodeError, AttributeError):
        return True  # present but unreadable: load_shipped names the problem


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
    from specrl.drafters.io import save_drafter

    dest = Path(dest)
    dest.mkdir(parents=True, exist_ok=True)
    save_drafter(drafter.to(getattr(torch, dtype)), dest)
    a = target.args
    manifest = {
        "format": MANIFEST_FORMAT, "name": name, "kind": drafter.kind, "target_model": recipe["model"],
        "target": {"hidden_size": a.hidden_size, "num_layers": a.num_layers, "vocab_size": a.vocab_size},
        "draft_vocab_size": int(drafter.d2t.numel()), "dtype": dtype, "recipe": recipe, "data_hash": data_hash,
        "commit": _commit(), "seed": recipe.get("seed"),
        "files": {f: sha256_of(dest / f) for f in FILES}, "eval": evaluation, **(extra or {}),
    }
    write_text_atomic(dest / MANIFEST, json.dumps(manifest, indent=1) + "\n")
    return dest


def _fail(d: Path, field: str, got, want, fix: str) -> SpecRLError:
    return SpecRLError(f"shipped drafter {d}: {field} is {got!r}, but {want}; {fix}")


def check_shipped(d: Path, target=None, target_model: str | None = None) -> dict:
    """Verify a shipped drafter directory (sha256 of each file, manifest against config, weights and target);
    return its manifest. Raises a SpecRLError naming the first field that disagrees and what would be right."""
    from safetensors import safe_open

    d = Path(d)
    fix = f"reinstall specrl, or rebuild it with `specrl draft build --recipe {d.name}`"
    try:
        m = json.loads((d / MANIFEST).read_text())
    except FileNotFoundError:
        raise SpecRLError(f"shipped drafter {d} has no {MANIFEST}; {fix}") from None
    except json.JSONDecodeError as e:
        raise SpecRLError(f"shipped drafter {d}: {MANIFEST} is not valid JSON ({e}); {fix}") from None
    if not isinstance(m, dict) or m.get("format") != MANIFEST_FORMAT:
        raise _fail(d, "manifest format", m.get("format") if isinstance(m, dict) else m,
                    f"a shipped drafter's manifest has format {MANIFEST_FORMAT!r}", fix)
    files = m.get("files") or {}
    for f in FILES:
        if f not in files:
            raise _fail(d, f"the manifest's sha256 of {f}", None, "every shipped file has one", fix)
        if not (d / f).exists():
            raise SpecRLError(f"shipped drafter {d}: {f} is missing; {fix}")
        got = sha256_of(d / f)
        if got != files[f]:
            raise _fail(d, f"the sha256 of {f}", got, f"the manifest records {files[f]}", fix)
    cfg = json.loads((d / "config.json").read_text())
    for field, want in (("kind", cfg.get("kind")), ("dtype", cfg.get("dtype")),
                        ("draft_vocab_size", cfg.get("draft_vocab_size"))):
        if m.get(field) != want:
            raise _fail(d, f"manifest {field}", m.get(field), f"its config.json says {want!r}", fix)
    with safe_open(str(d / "model.safetensors"), "pt") as f:
        dtypes = {str(f.get_slice(k).get_dtype()) for k in f.keys() if k != "d2t"}
    want_st = {"bfloat16": "BF16", "float16": "F16", "float32": "F32"}.get(m["dtype"])
    if dtypes != {want_st}:
        raise _fail(d, "the weights' dtype", sorted(dtypes), f"the manifest says {m['dtype']} ({want_st})", fix)
    if target_model is not None and m.get("target_model") != target_model:
        raise _fail(d, "manifest target_model", m.get("target_model"), f"this drafter serves {target_model!r}",
                    f"use a drafter trained for {m.get('target_model')!r}'s target, or {fix}")
    if target is not None:
        for field, value in (m.get("target") or {}).items():
            have = getattr(target.args, field, None)
            if have != value:
                raise SpecRLError(f"shipped drafter {d} was trained for a {m.get('target_model')} target with "
                                  f"{field} {value}, but this target has {field} {have}; use it with "
                                  f"{m.get('target_model')}, or train a drafter for this model with "
                                  "`specrl draft build --recipe FILE` (recipe model: this model)")
    return m


def load_shipped(kind: str, name: str, target, root: Path | None = None):
    """The shipped drafter `kind:name`, verified by `check_shipped`, loaded for `target`."""
    from specrl.drafters.io import load_drafter

    d = shipped_dir(name, root)
    m = check_shipped(d, target)
    if m.get("kind") != kind:
        raise _fail(d, "manifest kind", m.get("kind"), f"{kind}:{name} asks for a {kind} drafter",
                    f"use {m.get('kind')}:{name}")
    return load_drafter(d, target, expected_kind=kind)


def package_size(d: Path) -> int:
    return sum(os.path.getsize(p) for p in Path(d).iterdir() if p.is_file())

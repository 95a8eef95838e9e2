"""Atomic, verifiable training checkpoints (policy, optimizer, drafter, RNG states, data cursor, step).

A checkpoint is a directory `checkpoints/step_NNNNNN/` holding one `torch.save` file per part plus
`manifest.json` (step, metadata, and the size and SHA-256 of every part). It is written into a hidden
temporary directory, every file is fsynced, the manifest is written last, and only then is the directory
renamed into place with `os.replace` — so a kill at any moment leaves either the previous checkpoints or the
complete new one, never a half-written `step_*`. A part may instead be an object with `write_dir(path)` (the
sharded model and optimizer of a data-parallel learner, written by its ranks with torch.distributed.checkpoint):
it writes a subdirectory of the temporary directory, every file of which the manifest records, and loading
returns that subdirectory's path for the learner to read. `load_latest` walks checkpoints newest first, verifies each
against its manifest, reports every corrupt or partial one it skips, and returns the newest good one.
"""

from __future__ import annotations

import errno
import hashlib
import json
import os
import shutil
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from specrl.errors import SpecRLError

MANIFEST = "manifest.json"
FORMAT_VERSION = 1


class CheckpointError(SpecRLError):
    """A checkpoint directory is corrupt, partial or from an incompatible run."""


def _sha256(path: Path) -> str:
    h = hashlib.sha256()
    with path.open("rb") as f:
        for chunk in iter(lambda: f.read(1 << 22), b""):
            h.update(chunk)
    return h.hexdigest()


def _fsync_file(path: Path) -> None:
    with path.open("rb") as f:
        os.fsync(f.fileno())


def _fsync_dir(path: Path) -> None:
    try:
        fd = os.open(str(path), os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


def step_dirname(step: int) -> str:
    return f"step_{step:06d}"


def save_checkpoint(root: str | Path, step: int, parts: dict[str, Any], meta: dict[str, Any] | None = None,
                    keep: int | None = None) -> Path:
    """Atomically write `parts` (name -> torch-serialisable object) as checkpoint `step` under `root`.

    `meta` (JSON-serialisable) goes into the manifest. With `keep`, only the newest `keep` checkpoints remain.
    """
    root = Path(root)
    for name in parts:
        if not name.replace("_", "").isalnum():
            raise SpecRLError(f"checkpoint part name {name!r} must be alphanumeric (it names a file)")
    final = root / step_dirname(step)
    tmp = root / f".tmp-{step_dirname(step)}-{os.getpid()}"
    try:
        root.mkdir(parents=True, exist_ok=True)
        if tmp.exists():
            shutil.rmtree(tmp)
        tmp.mkdir()
        files: dict[str, dict[str, Any]] = {}
        for name, obj in parts.items():
            if hasattr(obj, "write_dir"):  # a directory part (sharded state written by its ranks)
                obj.write_dir(tmp / name)
                files[name] = {"dir": name, "files": _dir_files(tmp / name)}
                continue
            path = tmp / f"{name}.pt"
            torch.save(obj, path)
            _fsync_file(path)
            files[name] = {"file": path.name, "bytes": path.stat().st_size, "sha256": _sha256(path)}
        manifest = {"format": FORMAT_VERSION, "step": step, "files": files, "meta": meta or {}}
        mpath = tmp / MANIFEST
        mpath.write_text(json.dumps(manifest, indent=2))
        _fsync_file(mpath)
        _fsync_dir(tmp)
    except (OSError, RuntimeError) as e:  # torch.save reports a full disk as RuntimeError("... write failed")
        shutil.rmtree(tmp, ignore_errors=True)  # never leave a partial checkpoint behind
        why = getattr(e, "strerror", None) or str(e).splitlines()[0]
        full = isinstance(e, OSError) and e.errno == errno.ENOSPC or "write failed" in str(e)
        hint = "the disk is full" if full else "the directory is not writable" \
            if isinstance(e, PermissionError) else "the write failed"
        raise CheckpointError(f"cannot write checkpoint {final} ({hint}: {why}); the partial write was "
                              "removed") from None
    except SpecRLError:  # a directory part's writer failed (e.g. a learner rank died): nothing half-written stays
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    if final.exists():
        # Re-saving a step (e.g. after resume): move the old one aside first so the swap stays atomic.
        old = root / f".old-{step_dirname(step)}-{os.getpid()}"
        os.replace(final, old)
        os.replace(tmp, final)
        shutil.rmtree(old, ignore_errors=True)
    else:
        os.replace(tmp, final)
    _fsync_dir(root)
    if keep is not None:
        prune(root, keep)
    return final


def _dir_files(path: Path) -> dict[str, dict[str, Any]]:
    """Size and SHA-256 of every file under a directory part (fsynced), by path relative to it."""
    out = {}
    for f in sorted(p for p in path.rglob("*") if p.is_file()):
        _fsync_file(f)
        out[str(f.relative_to(path))] = {"bytes": f.stat().st_size, "sha256": _sha256(f)}
    _fsync_dir(path)
    return out


def list_checkpoints(root: str | Path) -> list[tuple[int, Path]]:
    """(step, path) of every `step_*` directory under root, newest first (validity not checked)."""
    root = Path(root)
    if not root.is_dir():
        return []
    out = []
    for p in root.iterdir():
        if p.is_dir() and p.name.startswith("step_"):
            try:
                out.append((int(p.name[5:]), p))
            except ValueError:
                continue
    return sorted(out, reverse=True)


def prune(root: str | Path, keep: int) -> None:
    """Delete all but the newest `keep` checkpoints and any leftover temporary directories."""
    root = Path(root)
    for _, p in list_checkpoints(root)[keep:]:
        shutil.rmtree(p, ignore_errors=True)
    for p in root.iterdir():
        if p.is_dir() and (p.name.startswith(".tmp-") or p.name.startswith(".old-")):
            shutil.rmtree(p, ignore_errors=True)


def verify_checkpoint(path: str | Path) -> dict[str, Any]:
    """Return the manifest if every part is present with the recorded size and SHA-256; else raise."""
    path = Path(path)
    mpath = path / MANIFEST
    if not mpath.exists():
        raise CheckpointError(f"{path}: no {MANIFEST} (partial checkpoint: the write did not finish)")
    try:
        manifest = json.loads(mpath.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise CheckpointError(f"{mpath}: unreadable manifest ({e})") from None
    if manifest.get("format") != FORMAT_VERSION or not isinstance(manifest.get("files"), dict):
        raise CheckpointError(f"{mpath}: unknown manifest format {manifest.get('format')!r}")
    for name, info in manifest["files"].items():
        if "dir" in info:
            for rel, finfo in info["files"].items():
                _verify_file(path, f"{name}/{rel}", path / info["dir"] / rel, finfo)
            continue
        _verify_file(path, name, path / info["file"], info)
    return manifest


def _verify_file(path: Path, name: str, f: Path, info: dict[str, Any]) -> None:
    """Raise CheckpointError unless file `f` of checkpoint `path` has the recorded size and SHA-256."""
    if not f.exists():
        raise CheckpointError(f"{path}: part {name!r} ({f.name}) is missing")
    if f.stat().st_size != info["bytes"]:
        raise CheckpointError(f"{path}: part {name!r} has {f.stat().st_size} bytes, the manifest says "
                              f"{info['bytes']} (truncated or overwritten)")
    if _sha256(f) != info["sha256"]:
        raise CheckpointError(f"{path}: part {name!r} fails its SHA-256 check (corrupt)")


@dataclass
class LoadedCheckpoint:
    step: int
    path: Path
    parts: dict[str, Any]
    meta: dict[str, Any]
    skipped: list[str] = field(default_factory=list)
    """One line per newer checkpoint that was corrupt or partial and therefore not used."""


def load_checkpoint(path: str | Path) -> LoadedCheckpoint:
    """Verify and load one checkpoint directory."""
    manifest = verify_checkpoint(path)
    path = Path(path)
    parts = {}
    for name, info in manifest["files"].items():
        if "dir" in info:  # a directory part: its reader (the learner) loads it
            parts[name] = path / info["dir"]
            continue
        try:
            parts[name] = torch.load(path / info["file"], map_location="cpu", weights_only=False)
        except Exception as e:  # any unpickling failure means a bad checkpoint
            raise CheckpointError(
                f"{path}: part {name!r} cannot be loaded ({type(e).__name__}: {e})"
            ) from None
    return LoadedCheckpoint(int(manifest["step"]), path, parts, manifest.get("meta", {}))


def load_latest(root: str | Path) -> LoadedCheckpoint | None:
    """The newest checkpoint under root that verifies; None if there are none at all.

    Corrupt or partial checkpoints are skipped (and listed in `.skipped`); if checkpoints exist but none
    verifies, raise CheckpointError naming each one and why.
    """
    candidates = list_checkpoints(root)
    if not candidates:
        return None
    skipped: list[str] = []
    for _, path in candidates:
        try:
            loaded = load_checkpoint(path)
        except CheckpointError as e:
            skipped.append(str(e))
            continue
        loaded.skipped = skipped
        return loaded
    raise CheckpointError("no usable checkpoint under " + str(root) + ":\n  " + "\n  ".join(skipped))

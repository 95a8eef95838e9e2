"""Atomic, verifiable training checkpoints (policy, optimizer, drafter, RNG states, data cursor, step).

A checkpoint is a directory `checkpoints/step_NNNNNN/` holding its parts plus `manifest.json` (the format version,
the specrl version that wrote it, step, metadata, and the size and SHA-256 of every file). It is written into a
hidden temporary directory, every file is fsynced, the manifest is written last, and only then is the directory
renamed into place with `os.replace` — so a kill at any moment leaves either the previous checkpoints or the
complete new one, never a half-written `step_*`. The format is the same for every world size: the model and
optimizer state is a directory part (an object with `write_dir(path)`: the learner's DCP directory,
`specrl.checkpoint.sharded_state`, written by one process or by every learner rank) whose every file the manifest
records, and loading returns that subdirectory's path for the learner to read with DCP (its metadata read with an
allow-listing unpickler). The bookkeeping (step, scheduler, RNG states, data cursor, drafter health) is a file
part: one `torch.save` file, written by `write_part` (or by an object with `write_file(path)`, its owner writing it
with `write_part`). File parts hold only tensors, numbers, strings, lists, tuples and dicts (numpy arrays, e.g.
numpy's RNG state, are stored as tagged plain lists) and are read with `torch.load(weights_only=True)`: a part whose
pickle would build any other object (and so could run code) is refused with `UnsafeCheckpointError` and the resume
stops. `load_latest` walks checkpoints newest first, verifies each against its manifest, reports every corrupt or
partial one it skips, and returns the newest good one; a checkpoint of another format version (`FORMAT_VERSION`)
stops the resume with `CheckpointFormatError`, which says what to do.
"""

from __future__ import annotations

import errno
import hashlib
import json
import os
import pickle
import re
import shutil
from dataclasses import dataclass, field
from importlib.metadata import PackageNotFoundError, version
from pathlib import Path
from typing import Any

import numpy as np
import torch

from specrl.errors import SpecRLError

MANIFEST = "manifest.json"
# 2: the model and optimizer state is one DCP directory part for every world size (1: `torch.save` files in one
# process, a DCP directory with N learner ranks)
FORMAT_VERSION = 2


# What torch.save says when the disk fills under it: a short write ("file write failed"), or, when it writes into a
# stream (DCP's files), the zip writer's position check at the end ("unexpected pos 704 vs 598").
_FULL_DISK = ("write failed", "unexpected pos")


def _free_space(path: Path) -> str:
    """'N MiB free on PATH's filesystem', or why that is unknown (the path may not exist after a failed mkdir)."""
    try:
        return f"{shutil.disk_usage(path).free / 2**20:,.0f} MiB free there now"
    except OSError as e:
        return f"free space unknown: {e.strerror}"


class CheckpointError(SpecRLError):
    """A checkpoint directory is corrupt, partial or from an incompatible run."""


class CheckpointFormatError(CheckpointError):
    """A checkpoint of another format version than this specrl's: never skipped past, the resume stops."""


def specrl_version() -> str:
    """The installed specrl's version (recorded in every manifest)."""
    try:
        return version("specrl")
    except PackageNotFoundError:
        return "unknown"


class UnsafeCheckpointError(CheckpointError):
    """A checkpoint part would build objects other than tensors and plain data when unpickled (it could run code)."""


_NDARRAY = "__numpy_ndarray__"


def _to_plain(obj: Any) -> Any:
    """`obj` with numpy arrays and scalars replaced by plain data `torch.load(weights_only=True)` reads."""
    if isinstance(obj, np.ndarray):
        return {_NDARRAY: obj.tolist(), "dtype": obj.dtype.str, "shape": list(obj.shape)}
    if isinstance(obj, np.generic):
        return obj.item()
    if isinstance(obj, dict):
        return {k: _to_plain(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        out = [_to_plain(v) for v in obj]
        return out if isinstance(obj, list) else tuple(out)
    return obj


def _from_plain(obj: Any) -> Any:
    """Inverse of `_to_plain`: tagged lists become numpy arrays again."""
    if isinstance(obj, dict):
        if _NDARRAY in obj and set(obj) == {_NDARRAY, "dtype", "shape"}:
            return np.asarray(obj[_NDARRAY], dtype=np.dtype(obj["dtype"])).reshape(obj["shape"])
        return {k: _from_plain(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        out = [_from_plain(v) for v in obj]
        return out if isinstance(obj, list) else tuple(out)
    return obj


def _load_part(path: Path, name: str) -> Any:
    try:
        obj = torch.load(path, map_location="cpu", weights_only=True)
    except pickle.UnpicklingError as e:
        found = re.search(r"GLOBAL ([\w.]+)", str(e))
        what = f"`{found.group(1)}`" if found else "an object that is not a tensor or plain data"
        raise UnsafeCheckpointError(
            f"{path.parent}: part {name!r} ({path.name}) asks to build {what} when loaded, which could run code; "
            "refused. A specrl checkpoint holds only tensors, numbers, strings, lists and dicts: resume only a "
            "run directory written by specrl, or delete this checkpoint directory if it is not yours"
        ) from None
    except Exception as e:  # any other unpickling failure means a bad checkpoint
        raise CheckpointError(f"{path.parent}: part {name!r} cannot be loaded ({type(e).__name__}: {e})") from None
    return _from_plain(obj)


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


def write_part(obj: Any, path: str | Path) -> None:
    """Write one checkpoint part (tensors and plain data) as the file `path`, fsynced, in the format
    `load_checkpoint` reads with `weights_only=True`."""
    torch.save(_to_plain(obj), path)
    _fsync_file(Path(path))


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
            if hasattr(obj, "write_file"):  # a part its owner writes, in the same format
                obj.write_file(path)
                if not path.is_file():
                    raise CheckpointError(f"checkpoint part {name!r}: its writer returned without writing {path}")
            else:
                write_part(obj, path)
            files[name] = {"file": path.name, "bytes": path.stat().st_size, "sha256": _sha256(path)}
        manifest = {"format": FORMAT_VERSION, "specrl": specrl_version(), "step": step, "files": files,
                    "meta": meta or {}}
        mpath = tmp / MANIFEST
        mpath.write_text(json.dumps(manifest, indent=2))
        _fsync_file(mpath)
        _fsync_dir(tmp)
    except (OSError, RuntimeError) as e:  # torch.save reports a full disk as RuntimeError("... write failed")
        shutil.rmtree(tmp, ignore_errors=True)  # never leave a partial checkpoint behind
        why = getattr(e, "strerror", None) or str(e).splitlines()[0]
        full = isinstance(e, OSError) and e.errno == errno.ENOSPC or any(s in str(e) for s in _FULL_DISK)
        hint = "the disk is full" if full else "the directory is not writable" \
            if isinstance(e, PermissionError) else "the write failed"
        raise CheckpointError(f"cannot write checkpoint {final} ({hint}: {why}; {_free_space(root)}); the "
                              "partial write was removed") from None
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
    if isinstance(manifest, dict) and isinstance(manifest.get("files"), dict) and \
            (manifest.get("format") is None or type(manifest["format"]) is int):
        _check_format(path, manifest)
    else:
        what = manifest.get("format") if isinstance(manifest, dict) else type(manifest).__name__
        raise CheckpointError(f"{mpath}: unknown manifest format {what!r} (expected an object with \"format\": "
                              f"{FORMAT_VERSION} and \"files\")")
    if type(manifest.get("step")) is not int or manifest["step"] < 0:
        raise CheckpointError(f"{mpath}: step is {manifest.get('step')!r}, expected an integer >= 0")
    for name, info in manifest["files"].items():
        if isinstance(info, dict) and "dir" in info:  # a directory part: every file of it is recorded
            d = info["dir"]
            if not (isinstance(d, str) and d == Path(d).name and isinstance(info.get("files"), dict)):
                raise CheckpointError(f"{mpath}: entry {name!r} is {info!r:.120}; expected {{\"dir\": a directory "
                                      "name in this checkpoint, \"files\": {relative path: {bytes, sha256}}}")
            for rel, finfo in info["files"].items():
                if not (isinstance(finfo, dict) and type(finfo.get("bytes")) is int and
                        isinstance(finfo.get("sha256"), str)) or ".." in Path(rel).parts or Path(rel).is_absolute():
                    raise CheckpointError(f"{mpath}: entry {name}/{rel!r} is {finfo!r:.120}; expected a relative "
                                          "path inside the part with {\"bytes\": an integer, \"sha256\": a hex "
                                          "string}")
                _verify_file(path, f"{name}/{rel}", path / d / rel, finfo)
            continue
        ok = isinstance(info, dict) and isinstance(info.get("file"), str) and info["file"] == Path(info["file"]).name \
            and type(info.get("bytes")) is int and isinstance(info.get("sha256"), str)
        if not ok:
            raise CheckpointError(f"{mpath}: entry {name!r} is {info!r:.120}; expected {{\"file\": a file name in "
                                  "this directory, \"bytes\": an integer, \"sha256\": a hex string}")
        _verify_file(path, name, path / info["file"], info)
    return manifest


def _check_format(path: Path, manifest: dict[str, Any]) -> None:
    """Raise CheckpointFormatError unless the manifest's format version is this specrl's `FORMAT_VERSION`."""
    found = manifest.get("format")
    if found == FORMAT_VERSION:
        return
    mine = f"this specrl ({specrl_version()}) reads checkpoint format {FORMAT_VERSION} only"
    by = f"specrl {manifest['specrl']}" if isinstance(manifest.get("specrl"), str) else None
    if found is None or found < FORMAT_VERSION:
        what = "with no format version (written before format 1)" if found is None else \
            f"format {found} (written by {by or 'an older specrl'})"
        raise CheckpointFormatError(
            f"{path}: checkpoint {what}; {mine}. Finish that run with the specrl version that wrote it, or start a "
            "new run (a new run directory; a finished run's final/ directory is an HF checkpoint that model.name "
            "can point at)")
    raise CheckpointFormatError(
        f"{path}: checkpoint format {found} (written by {by or 'a newer specrl'}); {mine}. Resume it with the "
        "specrl version that wrote it")


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
    # a directory part is loaded by its reader (the data-parallel learner's ranks, through DCP)
    parts = {name: path / info["dir"] if "dir" in info else _load_part(path / info["file"], name)
             for name, info in manifest["files"].items()}
    return LoadedCheckpoint(int(manifest["step"]), path, parts, manifest.get("meta", {}))


def load_latest(root: str | Path) -> LoadedCheckpoint | None:
    """The newest checkpoint under root that verifies; None if there are none at all.

    Corrupt or partial checkpoints are skipped (and listed in `.skipped`); if checkpoints exist but none
    verifies, raise CheckpointError naming each one and why. A part that could run code when loaded is never
    skipped past: its UnsafeCheckpointError stops the resume (the whole directory is then untrusted); nor is a
    checkpoint of another format version (CheckpointFormatError: the run continues only with the specrl that wrote
    it).
    """
    candidates = list_checkpoints(root)
    if not candidates:
        return None
    skipped: list[str] = []
    for _, path in candidates:
        try:
            loaded = load_checkpoint(path)
        except (UnsafeCheckpointError, CheckpointFormatError):
            raise
        except CheckpointError as e:
            skipped.append(str(e))
            continue
        loaded.skipped = skipped
        return loaded
    raise CheckpointError("no usable checkpoint under " + str(root) + ":\n  " + "\n  ".join(skipped))

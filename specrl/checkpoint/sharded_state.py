"""The learner's model and optimizer state as a torch.distributed.checkpoint (DCP) directory, for any world size.

Every checkpoint holds the policy, the online drafter and both optimizers as one DCP directory part (`DCP_PART`),
whether one process wrote it or N learner ranks did. `train_modules(policy, drafter)` is the one module tree whose
fully qualified names (`policy.*`, `drafter.*`) key both the model and the optimizers' state (the policy's optimizer
and the online drafter's own, flattened into one state keyed by those names, as `get_state_dict` does for several
optimizers). `save_dcp` writes them with `dcp.save` (each rank its own shards, plus one `.metadata` file; a single
process needs no process group), `load_dcp` reads them back into a learner of any world size (`get_state_dict` gives
the template, DCP reshards, `set_state_dict` applies it): a run saved with 2 ranks resumes with 1 and the other way
round. `DcpPart` is the single-process learner's checkpoint part (`save_checkpoint`'s directory-part protocol).
DCP reads tensor data with `torch.load(weights_only=True)` but unpickles `.metadata` with plain `pickle` and its
non-tensor entries (the optimizers' hyperparameters) with `torch.load(weights_only=False)`: `SafeReader` reads
`.metadata` with an unpickler that only admits the named DCP metadata classes it needs (`_DCP_CLASSES`), torch sizes,
dtypes and layouts and paths, and `_SafeLoadPlanner` admits a non-tensor entry only if `torch.load(weights_only=True)`
reads it, so no checkpoint file can run code on load.
"""

from __future__ import annotations

import io
import pickle
import re
import warnings
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed.checkpoint import DefaultLoadPlanner, FileSystemReader, FileSystemWriter
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

from specrl.errors import SpecRLError

DCP_PART = "dcp"  # the checkpoint part (a directory) holding the DCP model + optimizer state, for every world size
# the classes DCP's `.metadata` pickle names (traced from save_dcp of a model, an AdamW state and sharded runs),
# each by module and name: a class of those modules that is not listed here is refused
_DCP_CLASSES = {("torch.distributed.checkpoint.metadata", n) for n in (
    "Metadata", "MetadataIndex", "StorageMeta", "TensorProperties", "TensorStorageMetadata", "BytesStorageMetadata",
    "ChunkStorageMetadata", "_MEM_FORMAT_ENCODING")} | {("torch.distributed.checkpoint.filesystem", "_StorageInfo")}
_BUILTINS = {"set", "frozenset", "slice", "complex"}


class _MetadataUnpickler(pickle.Unpickler):
    """Admits the DCP metadata classes of `_DCP_CLASSES`, torch.Size / dtypes / layouts / memory formats, paths
    and a few builtins."""

    def find_class(self, module: str, name: str) -> Any:
        if (module, name) in _DCP_CLASSES:
            obj = getattr(__import__(module, fromlist=[name]), name, None)
            if isinstance(obj, type) and obj.__module__ == module:  # defined there, not a name it imported
                return obj
        if module == "torch":
            obj = getattr(torch, name, None)
            if obj is torch.Size or isinstance(obj, (torch.dtype, torch.layout, torch.memory_format)):
                return obj
        if module == "torch.serialization" and name == "_get_layout":  # a layout by its name (a dict lookup)
            from torch.serialization import _get_layout

            return _get_layout
        if module == "pathlib" and name in ("PosixPath", "PurePosixPath", "WindowsPath", "PureWindowsPath"):
            import pathlib

            return getattr(pathlib, name)  # the checkpoint id DCP records
        if module == "collections" and name == "OrderedDict":
            from collections import OrderedDict

            return OrderedDict
        if module == "builtins" and name in _BUILTINS:
            return getattr(__import__("builtins"), name)
        raise pickle.UnpicklingError(f"DCP metadata names {module}.{name}, which a checkpoint may not load")


class SafeReader(FileSystemReader):
    """`FileSystemReader` whose `.metadata` is read by `_MetadataUnpickler` instead of plain `pickle.load`."""

    def read_metadata(self, *args: Any, **kwargs: Any):
        from torch.distributed.checkpoint.metadata import StorageMeta

        path = self._get_metadata_path(kwargs.get("rank"))
        with self.fs.create_stream(path, "rb") as f:
            try:
                metadata = _MetadataUnpickler(io.BytesIO(f.read())).load()
            except pickle.UnpicklingError as e:
                raise SpecRLError(f"{self.path}: refused to load the DCP checkpoint ({e})") from None
        if getattr(metadata, "storage_meta", None) is None:
            metadata.storage_meta = StorageMeta()
        metadata.storage_meta.load_id = self.load_id
        return metadata


class _SafeLoadPlanner(DefaultLoadPlanner):
    """`DefaultLoadPlanner` that first reads each non-tensor entry with `torch.load(weights_only=True)`: an entry
    that would build anything but tensors and plain data is refused before DCP unpickles it."""

    def load_bytes(self, read_item: Any, value: io.BytesIO) -> None:
        try:
            torch.load(value, map_location="cpu", weights_only=True)
        except pickle.UnpicklingError as e:
            found = re.search(r"GLOBAL ([\w.]+)", str(e))
            what = f"`{found.group(1)}`" if found else "an object that is not a tensor or plain data"
            raise SpecRLError(f"refused to load the checkpoint's DCP entry {read_item.dest_index.fqn!r}: it asks to "
                              f"build {what}, which could run code (an entry holds only tensors and plain "
                              "data)") from None
        value.seek(0)
        super().load_bytes(read_item, value)


def _unwrapped(e: CheckpointException) -> BaseException:
    """The first rank's own exception inside DCP's `CheckpointException` (a BaseException that carries it)."""
    for exc, _trace in e.failures.values():
        if isinstance(exc, Exception):
            return exc
    return e


def _one_process() -> bool:
    return not (dist.is_available() and dist.is_initialized())


def train_modules(policy: nn.Module, drafter: nn.Module | None) -> nn.Module:
    """The policy (and trainable drafter) under one root: the names DCP keys model and optimizer state by."""
    mods = {"policy": policy}
    if drafter is not None:
        mods["drafter"] = drafter
    return nn.ModuleDict(mods)


def save_dcp(path: str | Path, policy: nn.Module, drafter: nn.Module | None,
             optimizers: list[torch.optim.Optimizer]) -> None:
    """Write model + optimizers' state to directory `path` (collective when torch.distributed is initialised, else
    written by this one process); `optimizers`: the policy's, then the drafter's when it trains. A rank's write
    error (a full disk: OSError / RuntimeError) is raised as itself."""
    model_sd, optim_sd = get_state_dict(train_modules(policy, drafter), optimizers)
    try:
        with warnings.catch_warnings():
            if _one_process():  # "torch.distributed is disabled ...": one process is what is meant
                warnings.filterwarnings("ignore", message="torch.distributed is disabled")
            dcp.save({"model": model_sd, "optim": optim_sd}, storage_writer=FileSystemWriter(str(path)))
    except CheckpointException as e:
        raise _unwrapped(e) from None


def load_dcp(path: str | Path, policy: nn.Module, drafter: nn.Module | None,
             optimizers: list[torch.optim.Optimizer]) -> None:
    """Read a `save_dcp` directory written by any number of ranks into this (sharded or plain) learner."""
    path = str(path)
    root = train_modules(policy, drafter)
    model_sd, optim_sd = get_state_dict(root, optimizers)
    if drafter is not None and not any(k.startswith("drafter.") for k in _saved_keys(path)):
        raise SpecRLError("the checkpoint has no drafter weights but drafter.online=true; resume with the "
                          "config the run was started with")
    state = {"model": model_sd, "optim": optim_sd}
    _load(state, path)
    set_state_dict(root, optimizers, model_state_dict=state["model"], optim_state_dict=state["optim"])


def _load(state: dict[str, Any], path: str) -> None:
    try:
        with warnings.catch_warnings():
            if _one_process():
                warnings.filterwarnings("ignore", message="torch.distributed is disabled")
            dcp.load(state, storage_reader=SafeReader(path), planner=_SafeLoadPlanner())
    except CheckpointException as e:
        raise _unwrapped(e) from None


def _saved_keys(path: str) -> list[str]:
    """The model entries' names (without the `model.` prefix) recorded in a DCP directory's metadata."""
    md = SafeReader(path).read_metadata()
    return [k.removeprefix("model.") for k in md.state_dict_metadata if k.startswith("model.")]


def read_model_tensors(path: str | Path) -> dict[str, torch.Tensor]:
    """The full model tensors of a `save_dcp` directory, by `train_modules` name (`policy.*`, `drafter.*`), read in
    this process with no model to load them into (to compare two checkpoints, or to inspect one)."""
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    md = SafeReader(str(path)).read_metadata()
    state = {k: torch.empty(m.size, dtype=m.properties.dtype) for k, m in md.state_dict_metadata.items()
             if k.startswith("model.") and isinstance(m, TensorStorageMetadata)}
    _load(state, str(path))
    return {k.removeprefix("model."): v for k, v in state.items()}


class DcpPart:
    """A single-process learner's model and optimizer state as a checkpoint directory part: `write_dir(path)` writes
    it there with `save_dcp` (the N-rank group's part has every rank write its shards the same way)."""

    def __init__(self, policy: nn.Module, drafter: nn.Module | None, optimizers: list[torch.optim.Optimizer]):
        self.policy, self.drafter, self.optimizers = policy, drafter, optimizers

    def write_dir(self, path: Path) -> None:
        Path(path).mkdir(parents=True, exist_ok=True)
        save_dcp(path, self.policy, self.drafter, self.optimizers)


def dcp_dir(parts: dict[str, Any]) -> str:
    """The DCP directory of loaded checkpoint parts (`load_checkpoint` returns a directory part as its path)."""
    if DCP_PART not in parts:
        raise SpecRLError(f"the checkpoint has no {DCP_PART!r} part (the model and optimizer state); parts: "
                          f"{sorted(parts)}")
    return str(parts[DCP_PART])

"""The learner's model and optimizer state as a torch.distributed.checkpoint (DCP) directory, for any world size.

`train_modules(policy, drafter)` is the one module tree whose fully qualified names (`policy.*`, `drafter.*`) key both
the model and the optimizers' state (the policy's optimizer and the online drafter's own, flattened into one state keyed
by those names, as `get_state_dict` does for several optimizers). `save_dcp` writes them with `dcp.save` (each rank its
own shards, plus one `.metadata` file), `load_dcp` reads them back into a learner of any world size (`get_state_dict`
gives the template, DCP reshards, `set_state_dict` applies it): a run saved with 2 ranks resumes with 1 and the other
way round. `load_full_parts` applies the single-process checkpoint format (full `policy` / `optimizer` / `drafter` /
`drafter_optimizer` parts, optimizer state keyed by parameter index) to a sharded learner, so a 1-rank run resumes with
N. DCP reads tensor data with `torch.load(weights_only=True)` but unpickles `.metadata` with plain `pickle`;
`SafeReader` reads it with an unpickler that only admits the named DCP metadata classes it needs (`_DCP_CLASSES`), torch
sizes, dtypes and layouts and paths, so no checkpoint file can run code on load.
"""

from __future__ import annotations

import io
import pickle
from typing import Any

import torch
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed.checkpoint import FileSystemReader, FileSystemWriter
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_state_dict, set_state_dict

from specrl.errors import SpecRLError

SHARDED_PART = "sharded"  # the checkpoint part (a directory) holding the DCP model + optimizer state
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
                raise SpecRLError(f"{self.path}: refused to load the sharded checkpoint ({e})") from None
        if getattr(metadata, "storage_meta", None) is None:
            metadata.storage_meta = StorageMeta()
        metadata.storage_meta.load_id = self.load_id
        return metadata


def train_modules(policy: nn.Module, drafter: nn.Module | None) -> nn.Module:
    """The policy (and trainable drafter) under one root: the names DCP keys model and optimizer state by."""
    mods = {"policy": policy}
    if drafter is not None:
        mods["drafter"] = drafter
    return nn.ModuleDict(mods)


def save_dcp(path: str, policy: nn.Module, drafter: nn.Module | None,
             optimizers: list[torch.optim.Optimizer]) -> None:
    """Write model + optimizers' state to directory `path` (collective when torch.distributed is initialised);
    `optimizers`: the policy's, then the drafter's when it trains."""
    model_sd, optim_sd = get_state_dict(train_modules(policy, drafter), optimizers)
    dcp.save({"model": model_sd, "optim": optim_sd}, storage_writer=FileSystemWriter(path))


def load_dcp(path: str, policy: nn.Module, drafter: nn.Module | None,
             optimizers: list[torch.optim.Optimizer]) -> None:
    """Read a `save_dcp` directory written by any number of ranks into this (sharded or plain) learner."""
    root = train_modules(policy, drafter)
    model_sd, optim_sd = get_state_dict(root, optimizers)
    if drafter is not None and not any(k.startswith("drafter.") for k in _saved_keys(path)):
        raise SpecRLError("the checkpoint has no drafter weights but drafter.online=true; resume with the "
                          "config the run was started with")
    state = {"model": model_sd, "optim": optim_sd}
    dcp.load(state, storage_reader=SafeReader(path))
    set_state_dict(root, optimizers, model_state_dict=state["model"], optim_state_dict=state["optim"])


def _saved_keys(path: str) -> list[str]:
    """The model entries' names (without the `model.` prefix) recorded in a DCP directory's metadata."""
    md = SafeReader(path).read_metadata()
    return [k.removeprefix("model.") for k in md.state_dict_metadata if k.startswith("model.")]


def optimizer_by_name(optim_sd: dict[str, Any], module: nn.Module, prefix: str) -> dict[str, Any]:
    """A single-process `optimizer.state_dict()` of one module's optimizer (one parameter group: the module's
    trainable parameters, state keyed by parameter index) keyed by `train_modules` names (`prefix.NAME`) instead."""
    names = [f"{prefix}.{n}" for n, p in module.named_parameters() if p.requires_grad]
    groups = optim_sd["param_groups"]
    if len(groups) != 1 or len(groups[0]["params"]) != len(names):
        raise SpecRLError(f"the checkpoint's {prefix} optimizer has groups of {[len(g['params']) for g in groups]} "
                          f"parameters, this learner [{len(names)}]; resume with the config the run was started "
                          "with")
    index = dict(zip(groups[0]["params"], names, strict=True))
    return {"state": {index[i]: s for i, s in optim_sd["state"].items()},
            "param_groups": [{**groups[0], "params": names}]}


def load_full_parts(parts: dict[str, Any], policy: nn.Module, drafter: nn.Module | None,
                    optimizers: list[torch.optim.Optimizer]) -> None:
    """Apply single-process checkpoint parts (full tensors) to a sharded learner: each rank keeps its shards."""
    if drafter is not None and ("drafter" not in parts or "drafter_optimizer" not in parts):
        raise SpecRLError("the checkpoint has no drafter weights or drafter optimizer state but drafter.online=true; "
                          "resume with the config the run was started with")
    model = {f"policy.{k}": v for k, v in parts["policy"].items()}
    optim = optimizer_by_name(parts["optimizer"], policy, "policy")
    if drafter is not None:
        model.update({f"drafter.{k}": v for k, v in parts["drafter"].items()})
        d = optimizer_by_name(parts["drafter_optimizer"], drafter, "drafter")
        optim = {"state": {**optim["state"], **d["state"]}, "param_groups": optim["param_groups"] + d["param_groups"]}
    set_state_dict(train_modules(policy, drafter), optimizers, model_state_dict=model, optim_state_dict=optim,
                   options=StateDictOptions(full_state_dict=True))


def load_sharded_learner(learner: Any, parts: dict[str, Any]) -> None:
    """A data-parallel run's checkpoint into a single-process `Learner`: DCP reads the directory part into the
    learner's modules and optimizers, and `parts` gains the full `policy` / `optimizer` / `drafter` /
    `drafter_optimizer` entries its `load_parts` expects (so the bookkeeping follows the one code path)."""
    load_dcp(str(parts[SHARDED_PART]), learner.policy, learner.drafter, learner.optimizers)
    parts["policy"] = learner.policy.state_dict()
    parts["optimizer"] = learner.optimizer.state_dict()
    if learner.drafter is not None:
        parts["drafter"] = learner.drafter.state_dict()
        parts["drafter_optimizer"] = learner.drafter_trainer.optimizer.state_dict()

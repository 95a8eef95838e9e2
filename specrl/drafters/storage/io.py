"""Drafter directories: `config.json` (kind, the target it was made for, its shape) + `model.safetensors`.

Only the drafter's own weights are saved; the pieces it shares with the target (embedding, and for MTP the
LM head) come from the target passed to `load_drafter`. Loading checks that the directory is a specrl
drafter of the requested kind, that it was made for a target of this shape (hidden size, vocabulary, layer
indices) and that the tensors match the config, and says which value disagreed with which. A directory holding a
`manifest.json` (shipped and packaged drafters) is first verified against it and the target (`manifest.py`).

The kinds saved this way are the rows of the kinds table (`specrl.rollout.drafter_spec.DRAFTER_KINDS`) with a
`min_format_version`; each row's drafter class says which config fields a directory needs and makes the drafter
from one (`specrl.drafters.trainable.TrainableDrafter.from_directory`).
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

from specrl.drafters.storage.manifest import verify_manifest
from specrl.errors import SpecRLError
from specrl.model.hf_checkpoint import check_finite, copy_state
from specrl.rollout.drafter_spec import DRAFTER_KINDS, DrafterKind

FORMAT = "specrl-drafter"
FORMAT_VERSION = 2  # 2: EAGLE heads use EAGLE-3's midlayer (vLLM's layout); MTP directories are unchanged since 1


def directory_kinds() -> dict[str, DrafterKind]:
    """The kinds saved as drafter directories: the table's rows with a `min_format_version` and a drafter class."""
    return {k.name: k for k in DRAFTER_KINDS.values()
            if k.min_format_version is not None and k.drafter_class is not None}


def save_drafter(drafter, path: str | os.PathLike) -> Path:
    """Write drafter weights + config into directory `path` (created if needed); return the path."""
    kinds = directory_kinds()
    kind = getattr(drafter, "kind", None)
    if kind not in kinds or not isinstance(drafter, kinds[kind].drafter_class):
        raise SpecRLError(f"save_drafter saves {sorted(kinds)} drafters, got {type(drafter).__name__}")
    out = Path(path)
    out.mkdir(parents=True, exist_ok=True)
    cfg = {"format": FORMAT, "format_version": FORMAT_VERSION, **drafter.config(),
           "dtype": str(drafter.dtype).removeprefix("torch.")}
    state = {k: v.detach().contiguous() for k, v in drafter.state_dict().items()}
    save_file(state, str(out / "model.safetensors"), metadata={"format": "pt"})
    (out / "config.json").write_text(json.dumps(cfg, indent=2) + "\n")
    return out


def min_format_version(kind: str | None) -> int:
    """The oldest drafter format this specrl reads for `kind` (its row's `min_format_version`; 1 otherwise)."""
    info = DRAFTER_KINDS.get(kind) if isinstance(kind, str) else None
    return info.min_format_version if info is not None and info.min_format_version is not None else 1


_INT_FIELDS = ("hidden_size", "vocab_size", "num_target_layers", "num_heads", "num_kv_heads", "head_dim",
               "draft_vocab_size", "intermediate_size", "num_modules")
_DTYPES = ("float32", "float16", "bfloat16")


def _check_fields(cfg: dict, cfg_path: Path) -> None:
    """A SpecRLError naming the file and the key for a missing or malformed value of a drafter config."""
    required = DRAFTER_KINDS[cfg["kind"]].drafter_class.CONFIG_FIELDS
    for key in required:
        if key not in cfg:
            raise SpecRLError(f"{cfg_path} lacks the field {key!r} (a {cfg['kind']} drafter config needs "
                              f"{', '.join(required)}); rebuild the drafter with `specrl draft init`")
    for key in _INT_FIELDS:
        v = cfg.get(key)
        if key in cfg and (type(v) is not int or v < 1):
            raise SpecRLError(f"{cfg_path}: {key} is {v!r}; it must be a positive integer (e.g. {key}: 576)")
    layers = cfg.get("layers")
    if "layers" in cfg and (not isinstance(layers, list) or not layers
                            or any(type(i) is not int or i < 0 for i in layers)):
        raise SpecRLError(f"{cfg_path}: layers is {layers!r}; it must be a non-empty list of target layer indices "
                          "(integers >= 0, e.g. [2, 15, 27])")
    if cfg.get("dtype") is not None and cfg["dtype"] not in _DTYPES:
        raise SpecRLError(f"{cfg_path}: dtype is {cfg['dtype']!r}; it must be one of {', '.join(_DTYPES)}")


def read_config(path: str | os.PathLike) -> dict:
    """The config of a drafter directory, or a SpecRLError saying what the path is instead."""
    p = Path(path)
    if not p.exists():
        raise SpecRLError(f"drafter directory {p} does not exist; create one with `specrl draft init`")
    if not p.is_dir():
        raise SpecRLError(f"{p} is a file; a drafter is a directory with config.json + model.safetensors")
    cfg_path = p / "config.json"
    if not cfg_path.exists():
        raise SpecRLError(f"{p} has no config.json; it is not a drafter directory (expected config.json + "
                          "model.safetensors written by save_drafter / `specrl draft init`)")
    try:
        cfg = json.loads(cfg_path.read_text(encoding="utf-8"))
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise SpecRLError(f"{cfg_path}: not valid JSON ({e}); a drafter's config.json is the UTF-8 JSON object "
                          "save_drafter / `specrl draft init` writes") from None
    if not isinstance(cfg, dict) or cfg.get("format") != FORMAT:
        what = "an HF model checkpoint" if isinstance(cfg, dict) and ("architectures" in cfg or
                                                                      "model_type" in cfg) else "not a drafter"
        raise SpecRLError(f"{p} is {what}, not a specrl drafter directory (its config.json lacks "
                          f"\"format\": \"{FORMAT}\"); pass a directory written by save_drafter / `specrl draft "
                          "init`")
    kinds = directory_kinds()
    if not isinstance(cfg.get("kind"), str) or cfg["kind"] not in kinds:
        raise SpecRLError(f"{cfg_path}: unknown drafter kind {cfg.get('kind')!r}; known kinds are {sorted(kinds)}")
    version = cfg.get("format_version")
    if not isinstance(version, int) or version > FORMAT_VERSION:
        raise SpecRLError(f"{cfg_path}: format_version {version!r} is not one this specrl reads (1..{FORMAT_VERSION});"
                          " it was written by a newer specrl: upgrade specrl or rebuild the drafter")
    oldest = min_format_version(cfg["kind"])
    if version < oldest:
        raise SpecRLError(kinds[cfg["kind"]].drafter_class.old_format_error(p, version, oldest))
    _check_fields(cfg, cfg_path)
    return cfg


def load_drafter(path: str | os.PathLike, target, expected_kind: str | None = None,
                 dtype: torch.dtype | None = None):
    """Load a drafter directory for `target` (a specrl Transformer); `expected_kind` (a kind saved as a drafter
    directory: eagle, mtp) is checked. The drafter is cast to `dtype` when given, else kept in the dtype it was
    saved in (`config.json`'s `dtype`). A directory holding a manifest (a shipped or packaged drafter) is verified
    against it and against `target` first (`manifest.verify_manifest`), whatever spec named it."""
    kind = expected_kind
    if kind is not None and kind not in directory_kinds():
        raise SpecRLError(f"unknown drafter kind {kind!r}; known kinds are {sorted(directory_kinds())}")
    p = Path(path)
    cfg = read_config(p)
    verify_manifest(p, target)
    if kind is not None and cfg["kind"] != kind:
        raise SpecRLError(f"{p} holds a {cfg['kind']!r} drafter, but a {kind!r} drafter was requested; use "
                          f"`{cfg['kind']}:{p}` or a {kind} drafter directory")
    ta = target.args
    for key, name in (("hidden_size", "hidden size"), ("vocab_size", "vocabulary size")):
        if int(cfg.get(key, -1)) != int(getattr(ta, key)):
            raise SpecRLError(f"{p}: this drafter was made for a target with {name} {cfg.get(key)}, but the "
                              f"target has {name} {getattr(ta, key)}; use a drafter trained for this target")
    for key in ("num_heads", "num_kv_heads", "head_dim"):
        if key in cfg and int(cfg[key]) != int(getattr(ta, key)):
            raise SpecRLError(f"{p}: this drafter was made for a target with {key} {cfg[key]}, but the target "
                              f"has {key} {getattr(ta, key)}")
    state_path = p / "model.safetensors"
    if not state_path.exists():
        raise SpecRLError(f"{p} has config.json but no model.safetensors")
    try:
        state = load_file(str(state_path))
    except Exception as e:  # safetensors raises its own error types for a truncated or corrupt header/body
        raise SpecRLError(f"{state_path}: cannot read the drafter's weights (truncated or corrupt: "
                          f"{type(e).__name__}: {e}); rebuild the drafter with `specrl draft init` (or `specrl "
                          "prepare --drafter eagle` for eagle:default, after deleting this directory)") from None
    for name, t in state.items():
        want_int = name == "d2t"
        if want_int == t.is_floating_point() or t.dtype == torch.bool:
            raise SpecRLError(f"{state_path}: tensor {name!r} has dtype {t.dtype}, expected "
                              f"{'an integer dtype (token ids)' if want_int else 'a floating-point dtype (weights)'}"
                              "; the file was not written by save_drafter, rebuild it with `specrl draft init`")
    try:
        drafter = DRAFTER_KINDS[cfg["kind"]].drafter_class.from_directory(target, cfg, state, p)
    except KeyError as e:
        raise SpecRLError(f"{p}/config.json lacks the field {e.args[0]!r}") from None
    copy_state(drafter, state, str(state_path), expected_by="config.json")
    check_finite(drafter, str(state_path), f"this {cfg['kind']} drafter is corrupt or its training diverged; "
                                           "rebuild it with `specrl draft init`")
    stored = cfg.get("dtype")
    if dtype is None and stored:
        dtype = getattr(torch, stored)
    if dtype is not None:
        drafter.to(dtype)
    return drafter.to(target.embed_tokens.weight.device).eval()  # the target's device (run.device)

"""Drafter directories: `config.json` (kind, the target it was made for, its shape) + `model.safetensors`.

Only the drafter's own weights are saved; the pieces it shares with the target (embedding, and for MTP the
LM head) come from the target passed to `load_drafter`. Loading checks that the directory is a specrl
drafter of the requested kind, that it was made for a target of this shape (hidden size, vocabulary, layer
indices) and that the tensors match the config, and says which value disagreed with which.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

from specrl.drafters.base import is_full_vocab
from specrl.drafters.eagle import EagleDrafter
from specrl.drafters.mtp import MTPDrafter
from specrl.errors import SpecRLError
from specrl.model.hf_checkpoint import check_finite, copy_state

FORMAT = "specrl-drafter"
FORMAT_VERSION = 2  # 2: EAGLE heads use EAGLE-3's midlayer (vLLM's layout); MTP directories are unchanged since 1
EAGLE_MIN_VERSION = 2  # an EAGLE head of format 1 had another layer (a 2H -> H projection before a plain block)
KINDS = {"eagle": EagleDrafter, "mtp": MTPDrafter}


def save_drafter(drafter, path: str | os.PathLike) -> Path:
    """Write drafter weights + config into directory `path` (created if needed); return the path."""
    kind = getattr(drafter, "kind", None)
    if kind not in KINDS or not isinstance(drafter, KINDS[kind]):
        raise SpecRLError(f"save_drafter saves {sorted(KINDS)} drafters, got {type(drafter).__name__}")
    out = Path(path)
    out.mkdir(parents=True, exist_ok=True)
    cfg = {"format": FORMAT, "format_version": FORMAT_VERSION, **drafter.config(),
           "dtype": str(drafter.dtype).removeprefix("torch.")}
    state = {k: v.detach().contiguous() for k, v in drafter.state_dict().items()}
    save_file(state, str(out / "model.safetensors"), metadata={"format": "pt"})
    (out / "config.json").write_text(json.dumps(cfg, indent=2) + "\n")
    return out


def min_format_version(kind: str | None) -> int:
    """The oldest drafter format this specrl reads for `kind` (format 1 EAGLE heads had another layer)."""
    return EAGLE_MIN_VERSION if kind == "eagle" else 1


_INT_FIELDS = ("hidden_size", "vocab_size", "num_target_layers", "num_heads", "num_kv_heads", "head_dim",
               "draft_vocab_size", "intermediate_size", "num_modules")
_REQUIRED = {"eagle": ("hidden_size", "vocab_size", "layers", "draft_vocab_size", "intermediate_size"),
             "mtp": ("hidden_size", "vocab_size", "num_modules", "intermediate_size")}
_DTYPES = ("float32", "float16", "bfloat16")


def _check_fields(cfg: dict, cfg_path: Path) -> None:
    """A SpecRLError naming the file and the key for a missing or malformed value of a drafter config."""
    for key in _REQUIRED[cfg["kind"]]:
        if key not in cfg:
            raise SpecRLError(f"{cfg_path} lacks the field {key!r} (a {cfg['kind']} drafter config needs "
                              f"{', '.join(_REQUIRED[cfg['kind']])}); rebuild the drafter with `specrl draft init`")
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
    if cfg.get("kind") not in KINDS:
        raise SpecRLError(f"{cfg_path}: unknown drafter kind {cfg.get('kind')!r}; known kinds are {sorted(KINDS)}")
    version = cfg.get("format_version")
    if not isinstance(version, int) or version > FORMAT_VERSION:
        raise SpecRLError(f"{cfg_path}: format_version {version!r} is not one this specrl reads (1..{FORMAT_VERSION});"
                          " it was written by a newer specrl: upgrade specrl or rebuild the drafter")
    if version < min_format_version(cfg["kind"]):
        raise SpecRLError(f"{p} is an EAGLE head of format {version}, made by an older specrl whose layer differs "
                          f"from EAGLE-3's (format {EAGLE_MIN_VERSION}: vLLM's layout); its weights cannot be "
                          "converted. Rebuild it with `specrl draft init` (or, for eagle:default / eagle:think, "
                          "`specrl prepare --drafter eagle`, which rebuilds it)")
    _check_fields(cfg, cfg_path)
    return cfg


def load_drafter(path: str | os.PathLike, target, expected_kind: str | None = None):
    """Load a drafter directory for `target` (a specrl Transformer); `expected_kind` ("eagle"/"mtp") is checked."""
    kind = expected_kind
    if kind is not None and kind not in KINDS:
        raise SpecRLError(f"unknown drafter kind {kind!r}; known kinds are {sorted(KINDS)}")
    p = Path(path)
    cfg = read_config(p)
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
        if cfg["kind"] == "eagle":
            layers = [int(i) for i in cfg["layers"]]
            bad = [i for i in layers if not 0 <= i < ta.num_layers]
            if bad:
                raise SpecRLError(f"{p}: EAGLE layer indices {layers} (made for a {cfg.get('num_target_layers')}-"
                                  f"layer target) are out of range for this target with {ta.num_layers} layers")
            if "d2t" not in state:
                raise SpecRLError(f"{p}/model.safetensors lacks the tensor 'd2t' (the draft vocabulary)")
            d2t = state["d2t"]
            if d2t.numel() != int(cfg["draft_vocab_size"]):
                raise SpecRLError(f"{p}: config says draft_vocab_size {cfg['draft_vocab_size']} but tensor d2t has "
                                  f"{d2t.numel()} entries")
            if d2t.numel() and (int(d2t.min()) < 0 or int(d2t.max()) >= ta.vocab_size):
                raise SpecRLError(f"{p}: d2t has token ids outside this target's vocabulary [0, {ta.vocab_size})")
            vocab = None if is_full_vocab(d2t, ta.vocab_size) else d2t
            drafter = EagleDrafter(target, layers=layers, draft_vocab=vocab,
                                   intermediate_size=int(cfg["intermediate_size"]))
        else:
            drafter = MTPDrafter(target, num_modules=int(cfg["num_modules"]),
                                 intermediate_size=int(cfg["intermediate_size"]))
    except KeyError as e:
        raise SpecRLError(f"{p}/config.json lacks the field {e.args[0]!r}") from None
    copy_state(drafter, state, str(state_path), expected_by="config.json")
    check_finite(drafter, str(state_path), f"this {cfg['kind']} drafter is corrupt or its training diverged; "
                                           "rebuild it with `specrl draft init`")
    dtype = cfg.get("dtype")
    if dtype:
        drafter.to(getattr(torch, dtype))
    return drafter.to(target.embed_tokens.weight.device).eval()  # the target's device (run.device)

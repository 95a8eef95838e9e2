"""`load_model(name_or_path)`: a preset name or an HF checkpoint directory -> (Transformer, tokenizer).

It sits above both `checkpoint.py` (checkpoint I/O) and `presets.py` (the embedded presets, whose one-time
import writes a checkpoint), so neither of those imports the other's caller.
"""

from __future__ import annotations

import os
from pathlib import Path

import torch

from specrl.device import resolve_device, resolve_dtype
from specrl.errors import SpecRLError
from specrl.model import presets
from specrl.model.hf_checkpoint import load_hf_checkpoint, load_tokenizer

TOKENIZER_FILES = ("tokenizer_config.json", "tokenizer.json")  # either marks a directory that carries a tokenizer


def load_model(name_or_path: str | os.PathLike, dtype: str | torch.dtype = "auto",
               device: str | torch.device = "cpu"):
    """Load a preset (e.g. "smollm2-135m") or an HF checkpoint directory -> (Transformer, tokenizer or None).

    dtype "auto" (the default) is bfloat16 where `device` has bf16 matrix units (AVX512-BF16 / AMX CPUs, CUDA)
    and float32 elsewhere (`specrl.device.resolve_dtype`); pass dtype=torch.float32 for training or exactness
    tests. `device` (cpu, cuda, cuda:N or auto) is where the weights are placed.
    """
    dev = resolve_device(device)
    if isinstance(dtype, str):
        dtype = resolve_dtype(dtype, dev, "dtype")
    p, preset = _checkpoint_dir(name_or_path)
    try:
        model = load_hf_checkpoint(p, dtype)
    except SpecRLError as e:
        if preset is None:
            raise
        raise SpecRLError(f"{e}. This is specrl's cache of the preset {preset!r}: delete {p} and run `specrl "
                          f"prepare --model {preset}` to import it again") from None
    if dev.type != "cpu":
        model = model.to(dev)
    model.checkpoint_dir = p  # lets a drafter check it shares this model's tokenizer (see same_tokenizer)
    tokenizer = load_tokenizer(p) if any((p / f).exists() for f in TOKENIZER_FILES) else None
    return model, tokenizer


def load_model_info(name_or_path: str | os.PathLike):
    """(ModelArgs, tokenizer or None) of a preset or checkpoint directory, without reading its weights: for a
    process that only renders prompts (the async learner's coordinator, whose ranks own the policy)."""
    import json

    from specrl.model.hf_checkpoint import args_from_hf_config

    p, _ = _checkpoint_dir(name_or_path)
    cfg_path = p / "config.json"
    try:
        args = args_from_hf_config(json.loads(cfg_path.read_text()), str(cfg_path))
    except (OSError, json.JSONDecodeError) as e:
        raise SpecRLError(f"{cfg_path}: cannot read the model's config ({e})") from None
    tokenizer = load_tokenizer(p) if any((p / f).exists() for f in TOKENIZER_FILES) else None
    return args, tokenizer


def _checkpoint_dir(name_or_path: str | os.PathLike) -> tuple[Path, str | None]:
    """The checkpoint directory of a preset name or a path, and the preset's name (None for a path)."""
    p = Path(name_or_path)
    preset = None
    if not p.exists():
        if str(name_or_path) in presets.PRESETS:
            preset = str(name_or_path)
            p = presets.prepare(preset)
        elif os.sep in str(name_or_path) or str(name_or_path).startswith("."):
            raise SpecRLError(f"checkpoint directory {name_or_path} does not exist")
        else:
            raise SpecRLError(f"unknown model {name_or_path!r}: not a directory and not a preset; presets are "
                              f"{sorted(presets.PRESETS)}")
    return p, preset


def _vocab(ckpt_dir: Path) -> dict[int, str] | None:
    """id -> token string of a checkpoint's tokenizer files (tokenizer.json, else vocab.json); None if neither."""
    import json

    f = ckpt_dir / "tokenizer.json"
    try:
        if f.exists():
            data = json.loads(f.read_text(encoding="utf-8"))
            vocab = (data.get("model") or {}).get("vocab")
            out: dict[int, str] = {}
            if isinstance(vocab, dict):
                out = {int(i): str(t) for t, i in vocab.items()}
            elif isinstance(vocab, list):  # Unigram: [[piece, score], ...]
                out = {i: str(v[0] if isinstance(v, list) else v) for i, v in enumerate(vocab)}
            for a in data.get("added_tokens") or []:
                out[int(a["id"])] = str(a["content"])
            return out
        f = ckpt_dir / "vocab.json"
        if f.exists():
            return {int(i): str(t) for t, i in json.loads(f.read_text(encoding="utf-8")).items()}
    except (OSError, ValueError, KeyError, TypeError, AttributeError):
        return None
    return None


def same_tokenizer(target_dir: str | os.PathLike | None, draft_dir: str | os.PathLike, what: str) -> None:
    """Raise a SpecRLError when two checkpoints' tokenizers map token ids to different strings.

    A draft model with another tokenizer of the same vocabulary size loads fine and then drafts tokens the target
    reads as something else: acceptance collapses to ~1 with no error. Skipped when either side has no tokenizer
    files to compare.
    """
    if target_dir is None:
        return
    a, b = _vocab(Path(target_dir)), _vocab(Path(draft_dir))
    if a is None or b is None or a == b:
        return
    ids = sorted(set(a) | set(b))
    diff = [i for i in ids if a.get(i) != b.get(i)]
    i = diff[0]
    raise SpecRLError(f"{what} {draft_dir} has a different tokenizer than the target {target_dir}: {len(diff)} of "
                      f"{len(ids)} token ids differ (e.g. id {i} is {a.get(i)!r} in the target, {b.get(i)!r} in the "
                      "draft model), so its drafts would be rejected; use a draft model with the target's tokenizer "
                      "(`specrl draft init --drafter draft-model` builds one)")

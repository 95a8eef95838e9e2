"""`load_model(name_or_path)`: a preset name or an HF checkpoint directory -> (Transformer, tokenizer).

It sits above both `checkpoint.py` (checkpoint I/O) and `presets.py` (the embedded presets, whose one-time
import writes a checkpoint), so neither of those imports the other's caller.
"""

from __future__ import annotations

import os
from pathlib import Path

import torch

from specrl.errors import SpecRLError
from specrl.model import presets
from specrl.model.checkpoint import load_checkpoint, load_tokenizer

TOKENIZER_FILES = ("tokenizer_config.json", "tokenizer.json")  # either marks a directory that carries a tokenizer


def load_model(name_or_path: str | os.PathLike, dtype: str | torch.dtype = torch.bfloat16):
    """Load a preset (e.g. "smollm2-135m") or an HF checkpoint directory -> (Transformer, tokenizer or None).

    The default dtype is bfloat16, the engine's natural dtype on CPUs with AVX512-BF16 and on GPUs;
    pass dtype=torch.float32 for training or exactness tests.
    """
    p = Path(name_or_path)
    if not p.exists():
        if str(name_or_path) in presets.PRESETS:
            p = presets.prepare(str(name_or_path))
        elif os.sep in str(name_or_path) or str(name_or_path).startswith("."):
            raise SpecRLError(f"checkpoint directory {name_or_path} does not exist")
        else:
            raise SpecRLError(f"unknown model {name_or_path!r}: not a directory and not a preset; presets are "
                              f"{sorted(presets.PRESETS)}")
    model = load_checkpoint(p, dtype)
    tokenizer = load_tokenizer(p) if any((p / f).exists() for f in TOKENIZER_FILES) else None
    return model, tokenizer

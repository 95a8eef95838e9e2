"""The trainer's policy as the rollout engine holds it: HF-named tensors out of a transformers (or PEFT) model,
and a specrl `Transformer` built from them in memory.

`policy_tensors(model)` is a context manager yielding the model's current weights under HF checkpoint names,
detached and not copied; a PEFT model's LoRA adapters are merged for the duration (as TRL does before it sends
weights to vLLM) and unmerged after, so the names are the base model's and the values are what the merged policy
computes. `engine_model(model, dtype, device)` builds specrl's model of the same architecture from the
transformers config and those tensors (no file is read), or says which architectures the native engine loads.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch
from torch import Tensor

from specrl.errors import SpecRLError
from specrl.model.hf_checkpoint import args_from_hf_config, model_from_state
from specrl.model.transformer import SUPPORTED_ARCHITECTURES

LORA_MARKERS = ("lora_", "modules_to_save")


def is_peft(model) -> bool:
    return hasattr(model, "peft_config") and hasattr(model, "merge_adapter") and hasattr(model, "unmerge_adapter")


def base_model(model):
    """The transformers model under a PEFT wrapper (the model itself otherwise)."""
    return model.get_base_model() if is_peft(model) else model


def _hf_names(state: dict[str, Tensor], peft: bool) -> dict[str, Tensor]:
    if not peft:
        return {k: v.detach() for k, v in state.items()}
    out = {}
    for k, v in state.items():
        if any(m in k for m in LORA_MARKERS):
            continue
        out[k.replace(".base_layer.", ".")] = v.detach()
    return out


@contextlib.contextmanager
def policy_tensors(model) -> Iterator[dict[str, Tensor]]:
    """The policy's weights under HF names (a PEFT model's with its adapters merged while the block runs)."""
    if is_peft(model):
        model.merge_adapter()
        try:
            yield _hf_names(base_model(model).state_dict(), peft=True)
        finally:
            model.unmerge_adapter()
    else:
        yield _hf_names(model.state_dict(), peft=False)


def hf_config(model) -> dict:
    """The transformers config as a dict with `architectures` set (a model built from a config may lack it)."""
    base = base_model(model)
    cfg = base.config.to_dict()
    if not cfg.get("architectures"):
        cfg["architectures"] = [type(base).__name__]
    return cfg


def check_architecture(model) -> dict:
    cfg = hf_config(model)
    arch = cfg["architectures"][0]
    if arch not in SUPPORTED_ARCHITECTURES:
        raise SpecRLError(f"the trainer's model is a {arch}; specrl's native engine loads "
                          f"{sorted(SUPPORTED_ARCHITECTURES)}. Use one of those, or rollout_func(backend='vllm'), "
                          "whose engine loads what vLLM loads")
    return cfg


def engine_model(model, dtype: torch.dtype, device: torch.device):
    """specrl's `Transformer` holding the trainer's current (merged) weights in `dtype` on `device`."""
    cfg = check_architecture(model)
    args = args_from_hf_config(cfg, f"the trainer's model config ({cfg['architectures'][0]})")
    with policy_tensors(model) as state:
        out = model_from_state(args, state, dtype, "the trainer's model")
    return out.to(device).eval().requires_grad_(False)

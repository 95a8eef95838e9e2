"""The trainer's policy as the rollout engine holds it: HF-named tensors out of a transformers (or PEFT) model,
and a specrl `Transformer` built from them in memory.

`policy_tensors(model)` yields the model's current weights under HF checkpoint names, detached and not copied; a
PEFT model's LoRA layers are given as base weight + adapter delta, computed out of place (TRL merges and unmerges
in place before it sends weights to vLLM, which leaves rounding error in the base weights), so the names are the
base model's and the values are what the merged policy computes. `engine_model(model, dtype, device)` builds
specrl's model of the same architecture from the transformers config and those tensors (no file is read), or says
which architectures the native engine loads.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch
from torch import Tensor

from specrl.errors import SpecRLError
from specrl.model.hf_checkpoint import args_from_hf_config, model_from_state
from specrl.model.transformer import SUPPORTED_ARCHITECTURES


def is_peft(model) -> bool:
    return hasattr(model, "peft_config") and hasattr(model, "get_base_model")


def base_model(model):
    """The transformers model under a PEFT wrapper (the model itself otherwise)."""
    return model.get_base_model() if is_peft(model) else model


def _merged(model) -> dict[str, Tensor]:
    """A PEFT model's weights under the base model's HF names, each LoRA layer's as base + its active adapters'
    delta, computed out of place: the trainer's tensors are read, never written (a merge / unmerge round trip
    would leave rounding error in the base weights every step)."""
    base = base_model(model)
    out: dict[str, Tensor] = {}
    for k, v in base.state_dict().items():
        if "lora_" in k or ".original_module." in k:
            continue
        if ".modules_to_save." in k:  # a fully trained copy of a module: its active copy is the weight
            head, tail = k.split(".modules_to_save.", 1)
            k = f"{head}.{tail.split('.', 1)[1]}"
        out[k.replace(".base_layer.", ".")] = v.detach()
    for name, m in base.named_modules():
        if not (hasattr(m, "get_delta_weight") and hasattr(m, "base_layer") and hasattr(m, "lora_A")):
            continue
        if getattr(m, "merged", False):
            raise SpecRLError(f"{name}: the PEFT adapters are merged into the base weights already; unmerge them "
                              "(model.unmerge_adapter()) before training with specrl's rollouts")
        w = m.base_layer.weight.detach()
        for adapter in m.active_adapters:
            if adapter in m.lora_A:
                w = w + m.get_delta_weight(adapter).detach().to(w.dtype)
        out[f"{name}.weight"] = w
    return out


@contextlib.contextmanager
def policy_tensors(model) -> Iterator[dict[str, Tensor]]:
    """The policy's weights under HF names (a PEFT model's with its active adapters merged, out of place)."""
    with torch.no_grad():
        yield _merged(model) if is_peft(model) else {k: v.detach() for k, v in model.state_dict().items()}


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

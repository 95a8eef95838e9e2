"""Export a specrl EAGLE head to vLLM's EAGLE-3 checkpoint layout (`specrl draft export --format vllm-eagle3`).

specrl's EAGLE layer is EAGLE-3's midlayer (`specrl.drafters.kinds.eagle.Eagle3Block`), so the export is a renaming
plus a config: `block.*` -> `midlayer.*`, the per-layer input norms -> `fc_norm.{i}` (vLLM's `fc_norm: true`),
`fc`, `norm`, `lm_head` unchanged; the draft vocabulary `d2t` (specrl: absolute target ids) becomes vLLM's
offsets (`target = draft + d2t[draft]`) plus EAGLE-3's boolean `t2d` mask; the fused target layers i (outputs
of layer i) become `eagle_aux_hidden_state_layer_ids` i + 1 (vLLM counts the residual stream after i + 1
layers). The embedding is not written: the drafter shares the target's, and so does vLLM when the checkpoint
has none. `vllm_eagle3_state` is the same renaming for in-memory refits (the vLLM backend's drafter refit).
"""

from __future__ import annotations

import json
import os
from collections.abc import Mapping
from pathlib import Path

import torch
from safetensors.torch import save_file
from torch import Tensor

from specrl.errors import SpecRLError
from specrl.rollout.drafter_spec import DRAFTER_KINDS

FORMATS = ("vllm-eagle3",)
VLLM_METHOD = "eagle3"  # the vLLM speculative method that serves this layout
ARCHITECTURE = "LlamaForCausalLMEagle3"
# specrl name prefix -> vLLM EAGLE-3 name prefix (checked in this order; every drafter tensor must match one)
_RENAMES = (("block.", "midlayer."), ("layer_norms.", "fc_norm."), ("fc.", "fc."), ("norm.", "norm."),
            ("lm_head.", "lm_head."))


def vllm_eagle3_name(name: str) -> str | None:
    """The vLLM EAGLE-3 name of a specrl EAGLE tensor; None for `d2t` (the vocabulary map is not a weight)."""
    if name == "d2t":
        return None
    for old, new in _RENAMES:
        if name.startswith(old):
            return new + name[len(old):]
    raise SpecRLError(f"EAGLE tensor {name!r} has no place in vLLM's EAGLE-3 layout (expected names under "
                      f"{[o for o, _ in _RENAMES]} or d2t)")


def vllm_eagle3_state(state: Mapping[str, Tensor]) -> dict[str, Tensor]:
    """specrl EAGLE state dict -> vLLM EAGLE-3 weights (no d2t/t2d: those are written once, at export)."""
    out = {}
    for name, t in state.items():
        new = vllm_eagle3_name(name)
        if new is not None:
            out[new] = t
    return out


def vocab_tensors(d2t: Tensor, vocab_size: int) -> dict[str, Tensor]:
    """EAGLE-3's vocabulary map from specrl's d2t (draft index -> target id); empty for the full vocabulary."""
    d2t = d2t.long().cpu()
    if d2t.numel() == vocab_size and bool((d2t == torch.arange(vocab_size)).all()):
        return {}
    t2d = torch.zeros(vocab_size, dtype=torch.bool)
    t2d[d2t] = True
    return {"d2t": d2t - torch.arange(d2t.numel()), "t2d": t2d}


def vllm_eagle3_config(cfg: Mapping, target_config: Mapping, dtype: str) -> dict:
    """vLLM's config.json for a specrl EAGLE config (`EagleDrafter.config()`) and its target's HF config."""
    h, v = int(cfg["hidden_size"]), int(cfg["vocab_size"])
    tc = dict(target_config)
    if int(tc.get("hidden_size", -1)) != h or int(tc.get("vocab_size", -1)) != v:
        raise SpecRLError(f"the EAGLE head was made for hidden size {h} / vocabulary {v}, but the target's "
                          f"config.json says {tc.get('hidden_size')} / {tc.get('vocab_size')}; export it with "
                          "the target it was trained for (--model)")
    out = {
        "architectures": [ARCHITECTURE], "model_type": "llama", "num_hidden_layers": 1,
        "hidden_size": h, "intermediate_size": int(cfg["intermediate_size"]),
        "num_attention_heads": int(cfg["num_heads"]), "num_key_value_heads": int(cfg["num_kv_heads"]),
        "head_dim": int(cfg["head_dim"]), "hidden_act": "silu", "attention_bias": False, "mlp_bias": False,
        "vocab_size": v, "draft_vocab_size": int(cfg["draft_vocab_size"]), "target_hidden_size": h,
        "tie_word_embeddings": False, "fc_norm": True, "norm_before_residual": False, "torch_dtype": dtype,
        "eagle_config": {"eagle_aux_hidden_state_layer_ids": [int(i) + 1 for i in cfg["layers"]],
                         "use_aux_hidden_state": True},
    }
    for key in ("rms_norm_eps", "rope_theta", "rope_scaling", "rope_parameters", "max_position_embeddings",
                "bos_token_id", "eos_token_id", "pad_token_id"):
        if key in tc:
            out[key] = tc[key]
    return out


def exports(kind: str) -> bool:
    """Whether drafters of `kind` export to vllm-eagle3: the kinds whose row maps onto vLLM's eagle3 method."""
    info = DRAFTER_KINDS.get(kind)
    return info is not None and info.vllm == VLLM_METHOD


def export_vllm_eagle3(drafter_dir: str | os.PathLike, target_dir: str | os.PathLike, out: str | os.PathLike,
                       dtype: str | None = None) -> Path:
    """Write `out` (config.json + model.safetensors) in vLLM's EAGLE-3 layout from a specrl EAGLE directory."""
    from safetensors.torch import load_file

    from specrl.drafters.storage.io import read_config
    from specrl.drafters.storage.manifest import verify_manifest

    src, tgt, dst = Path(drafter_dir), Path(target_dir), Path(out)
    cfg = read_config(src)
    if not exports(cfg["kind"]):
        raise SpecRLError(f"{src} holds a {cfg['kind']!r} drafter; only EAGLE heads export to vllm-eagle3 (vLLM's "
                          "MTP loads the target's own MTP layers, which specrl's MTP heads are not)")
    if not (tgt / "config.json").is_file():
        raise SpecRLError(f"{tgt} is not an HF checkpoint directory (no config.json); give the target model")
    verify_manifest(src, target_dir=tgt)  # a shipped or packaged head: its files and the actual target
    if dst.resolve() == src.resolve():
        raise SpecRLError(f"--out {dst} is the drafter directory itself; give a new directory")
    if dst.exists() and any(dst.iterdir()):
        raise SpecRLError(f"--out {dst} exists and is not empty; give a new or empty directory")
    state = load_file(str(src / "model.safetensors"))
    dtype = dtype or cfg.get("dtype") or "float32"
    if dtype not in ("float32", "bfloat16", "float16"):
        raise SpecRLError(f"export dtype must be float32, bfloat16 or float16, got {dtype!r}")
    target_config = json.loads((tgt / "config.json").read_text())
    vcfg = vllm_eagle3_config(cfg, target_config, dtype)
    weights = {k: t.to(getattr(torch, dtype)).contiguous() for k, t in vllm_eagle3_state(state).items()}
    weights.update(vocab_tensors(state["d2t"], int(cfg["vocab_size"])))
    dst.mkdir(parents=True, exist_ok=True)
    save_file(weights, str(dst / "model.safetensors"), metadata={"format": "pt"})
    (dst / "config.json").write_text(json.dumps(vcfg, indent=2) + "\n")
    (dst / "specrl_source.json").write_text(json.dumps({"exported_from": str(src.resolve()),
                                                        "format": "vllm-eagle3"}, indent=1) + "\n")
    return dst

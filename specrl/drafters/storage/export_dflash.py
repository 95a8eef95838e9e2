"""vLLM's DFlash checkpoint layout, and why a specrl parallel head cannot be written in it (a refusal by name).

vLLM (0.32, `vllm/model_executor/models/qwen3_dflash.py`, `DFlashQwen3ForCausalLM`; DSpark's `Qwen3DSparkModel`
is the same backbone plus a Markov and a confidence head) serves a parallel drafter whose target features reach
its decoder layers only as *context keys and values*: for every verified token, fc(concat of the target layers'
raw outputs) -> hidden_norm -> each layer's k_proj / v_proj (+ k_norm, RoPE) is written into the draft's KV cache,
and the query block [last sampled token, mask_token_id x K] starts from plain token embeddings of width H, runs
through Qwen3 decoder layers (q_norm / k_norm over head_dim, attention over the context and the block), and the K
drafts are read at the K mask positions through a draft-vocabulary LM head and `d2t`. `dflash_layout` is that
layout for a one-layer draft of a given head config (checkpoint names -> shapes, as the class declares them).
specrl's parallel head is EAGLE-3's layer (`Eagle3Block`): every entry, context or placeholder, is a 2H input
[embedding; feature], its projections take 2H, it has per-target-layer norms before fc and no q/k norms, and it
has one learned 2H placeholder per draft depth instead of one shared mask token. `dflash_mismatches` names every
such difference from a state dict and config dict (the drafter's checkpoint, `config()`), and
`check_dflash_export` refuses with all of them; it returns nothing for a head already in DFlash's layout.
"""

from __future__ import annotations

from collections.abc import Mapping

from torch import Tensor

from specrl.errors import SpecRLError

VLLM_METHOD = "dflash"
ARCHITECTURE = "DFlashDraftModel"  # config.json architectures; vLLM's registry maps it to DFlashQwen3ForCausalLM
_NEEDED = ("hidden_size", "vocab_size", "num_heads", "num_kv_heads", "head_dim", "layers", "draft_vocab_size",
           "intermediate_size")
# specrl parallel / EAGLE-3 tensor -> the DFlash tensor in the same role
_COUNTERPART = {
    "fc.weight": "fc.weight",
    "block.hidden_norm.weight": "hidden_norm.weight",
    "block.input_layernorm.weight": "layers.0.input_layernorm.weight",
    "block.self_attn.q_proj.weight": "layers.0.self_attn.q_proj.weight",
    "block.self_attn.k_proj.weight": "layers.0.self_attn.k_proj.weight",
    "block.self_attn.v_proj.weight": "layers.0.self_attn.v_proj.weight",
    "block.self_attn.o_proj.weight": "layers.0.self_attn.o_proj.weight",
    "block.post_attention_layernorm.weight": "layers.0.post_attention_layernorm.weight",
    "block.mlp.gate_proj.weight": "layers.0.mlp.gate_proj.weight",
    "block.mlp.up_proj.weight": "layers.0.mlp.up_proj.weight",
    "block.mlp.down_proj.weight": "layers.0.mlp.down_proj.weight",
    "norm.weight": "norm.weight",
    "lm_head.weight": "lm_head.weight",
    "d2t": "d2t",
}
_WHY = {
    "layer_norms.": "a norm per target layer before fc (DFlash applies fc to the raw concatenated target outputs, "
                    "then one hidden_norm)",
    "placeholders": "one learned [embedding; feature] entry per draft depth (DFlash has one mask token whose "
                    "embedding row, or mask_embedding.pt, stands at every mask position, told apart only by RoPE)",
}


def _config(cfg: Mapping) -> dict:
    missing = [k for k in _NEEDED if k not in cfg]
    if missing:
        raise SpecRLError(f"DFlash export: the head config lacks {missing}; give the drafter's config() (fields "
                          f"{list(_NEEDED)})")
    return dict(cfg)


def dflash_layout(cfg: Mapping) -> dict[str, tuple[int, ...]]:
    """Checkpoint tensor names -> shapes that vLLM's DFlash model declares for a one-layer draft with this head
    config (q/k/v and gate/up are stacked by vLLM's loader from these names; `d2t` only under a draft vocabulary;
    no embed_tokens: the draft shares the target's, and the mask row is `dflash_config.mask_token_id`'s)."""
    c = _config(cfg)
    h, d, i = int(c["hidden_size"]), int(c["head_dim"]), int(c["intermediate_size"])
    q, kv, vd = int(c["num_heads"]) * d, int(c["num_kv_heads"]) * d, int(c["draft_vocab_size"])
    attn = "layers.0.self_attn."
    out = {"fc.weight": (h, len(c["layers"]) * h), "hidden_norm.weight": (h,),
           "layers.0.input_layernorm.weight": (h,), attn + "q_proj.weight": (q, h), attn + "k_proj.weight": (kv, h),
           attn + "v_proj.weight": (kv, h), attn + "o_proj.weight": (h, q), attn + "q_norm.weight": (d,),
           attn + "k_norm.weight": (d,), "layers.0.post_attention_layernorm.weight": (h,),
           "layers.0.mlp.gate_proj.weight": (i, h), "layers.0.mlp.up_proj.weight": (i, h),
           "layers.0.mlp.down_proj.weight": (h, i), "norm.weight": (h,), "lm_head.weight": (vd, h)}
    if vd < int(c["vocab_size"]):
        out["d2t"] = (vd,)
    return out


def dflash_config(cfg: Mapping, mask_token_id: int, causal: bool = True) -> dict:
    """The config.json fields vLLM reads for a DFlash draft of this head config: Qwen3 fields, the target layers
    (0-based outputs of layer i, which vLLM turns into aux ids i + 1), the mask token and the attention causality."""
    c = _config(cfg)
    return {"architectures": [ARCHITECTURE], "model_type": "qwen3", "num_hidden_layers": 1,
            "hidden_size": int(c["hidden_size"]), "target_hidden_size": int(c["hidden_size"]),
            "intermediate_size": int(c["intermediate_size"]), "num_attention_heads": int(c["num_heads"]),
            "num_key_value_heads": int(c["num_kv_heads"]), "head_dim": int(c["head_dim"]), "hidden_act": "silu",
            "attention_bias": False, "vocab_size": int(c["vocab_size"]),
            "draft_vocab_size": int(c["draft_vocab_size"]),
            "dflash_config": {"target_layer_ids": [int(x) for x in c["layers"]], "mask_token_id": int(mask_token_id),
                              "use_aux_hidden_state": True, "causal": bool(causal)}}


def dflash_mismatches(state: Mapping[str, Tensor], cfg: Mapping) -> list[str]:
    """Every difference between a head's tensors and vLLM's DFlash layout for its config, in words ([]: none)."""
    want = dflash_layout(cfg)
    have: dict[str, tuple[int, ...]] = {}
    out = []
    full_vocab = int(cfg["draft_vocab_size"]) == int(cfg["vocab_size"])
    for name, t in state.items():
        if name == "d2t" and full_vocab:  # the identity map: DFlash writes none
            continue
        why = next((w for prefix, w in _WHY.items() if name.startswith(prefix)), None)
        if why is not None:
            if why not in out:
                out.append(f"{name.split('.')[0]}: {why}")
            continue
        target = _COUNTERPART.get(name, name)
        if target not in want:
            out.append(f"{name} {tuple(t.shape)}: DFlash has no tensor in its role")
            continue
        have[target] = tuple(t.shape)
        if tuple(t.shape) != want[target]:
            wide = "q_proj" in name or "k_proj" in name or "v_proj" in name
            out.append(f"{name} {tuple(t.shape)}: DFlash's {target} is {want[target]}" + (
                " (its layer reads H-wide token embeddings; the target features enter only as context keys and "
                "values, never as a query's input)" if wide else ""))
    for target, shape in want.items():
        if target not in have:
            out.append(f"no tensor for DFlash's {target} {shape}" + (
                " (Qwen3's per-head RMSNorm, which an RMSNorm of weight 1 does not undo)" if "_norm." in target
                and "self_attn" in target else ""))
    return list(dict.fromkeys(out))


def check_dflash_export(state: Mapping[str, Tensor], cfg: Mapping) -> None:
    """Refuse, naming every mismatch, a head that vLLM's dflash (or dspark, the same backbone) method cannot load
    as it computes; return for one already in DFlash's layout."""
    found = dflash_mismatches(state, cfg)
    if found:
        kind = cfg.get("kind", "?")
        raise SpecRLError(f"a {kind!r} head cannot be written in vLLM's DFlash layout (speculative method "
                          f"{VLLM_METHOD!r}; dspark is the same backbone) without changing what it computes: "
                          + "; ".join(found) + ". Serve it with the native engine (rollout.backend=native), or "
                          "train a head in DFlash's shape")

"""Model catalog and HF `config.json` parsing: parameter counts, bytes and FLOPs per forward.

A `ModelSpec` is the architecture only (dense or MoE with routed/shared experts, GQA or DeepSeek MLA, MTP
layers). From it come the quantities the roofline needs: the weight bytes a forward over T tokens streams
(for MoE only the experts those T tokens actually touch, E·(1-(1-k/E)^T) per layer under uniform routing), the
active parameters per token (FLOPs), the KV bytes per token, and the attention FLOPs per (query, context)
pair. The catalog entries are written as HF config dicts and go through the same parser as user files.
Drafter architectures (EAGLE-3 head, MTP layer, a separate draft model) are built here from the target.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, replace
from pathlib import Path

from specrl.errors import SpecRLError

DTYPE_BYTES = {"bf16": 2.0, "fp16": 2.0, "fp32": 4.0, "fp8": 1.0}


@dataclass(frozen=True)
class ModelSpec:
    name: str
    hidden: int
    layers: int
    heads: int
    kv_heads: int
    head_dim: int
    intermediate: int  # dense FFN width (0 when every layer is MoE)
    vocab: int
    tied_embeddings: bool = False
    num_experts: int = 0
    experts_per_token: int = 0
    moe_intermediate: int = 0
    shared_experts: int = 0
    shared_intermediate: int = 0
    dense_layers: int = 0  # layers with a dense FFN in an MoE model (DeepSeek first_k_dense_replace)
    mtp_layers: int = 0
    kv_lora_rank: int = 0  # > 0 means DeepSeek multi-head latent attention
    q_lora_rank: int = 0
    qk_rope_dim: int = 0
    qk_nope_dim: int = 0
    v_head_dim: int = 0
    extra_params: float = 0.0  # drafter glue (EAGLE fc, MTP eh_proj): streamed and multiplied every token
    attn_input_mult: int = 1  # EAGLE-3 attention reads concat(embedding, hidden)

    # ---- structure -------------------------------------------------------------------------------------
    @property
    def is_moe(self) -> bool:
        return self.num_experts > 0

    @property
    def is_mla(self) -> bool:
        return self.kv_lora_rank > 0

    @property
    def moe_layers(self) -> int:
        return self.layers - self.dense_layers if self.is_moe else 0

    @property
    def dense_ffn_layers(self) -> int:
        return self.dense_layers if self.is_moe else self.layers

    def attn_params(self) -> float:
        h, hin = self.hidden, self.hidden * self.attn_input_mult
        if self.is_mla:
            qk = self.qk_nope_dim + self.qk_rope_dim
            if self.q_lora_rank:
                q = hin * self.q_lora_rank + self.q_lora_rank * self.heads * qk
            else:
                q = hin * self.heads * qk
            kv = hin * (self.kv_lora_rank + self.qk_rope_dim)
            kv += self.kv_lora_rank * self.heads * (self.qk_nope_dim + self.v_head_dim)
            return float(q + kv + self.heads * self.v_head_dim * h)
        qd, kvd = self.heads * self.head_dim, self.kv_heads * self.head_dim
        return float(hin * qd + 2 * hin * kvd + qd * h)

    def expert_params(self) -> float:
        return 3.0 * self.hidden * self.moe_intermediate

    def _moe_fixed_params(self) -> float:
        """Per MoE layer, params every token reads: shared experts and the router."""
        return self.shared_experts * 3.0 * self.hidden * self.shared_intermediate + self.hidden * self.num_experts

    def _per_layer_common(self) -> float:
        return self.layers * self.attn_params() + self.dense_ffn_layers * 3.0 * self.hidden * self.intermediate

    def lm_head_params(self) -> float:
        return float(self.vocab * self.hidden)

    def total_params(self) -> float:
        """All weights (excluding MTP layers), as in the model card."""
        p = self._per_layer_common() + self.extra_params + self.vocab * self.hidden
        p += self.moe_layers * (self.num_experts * self.expert_params() + self._moe_fixed_params())
        return p + (0.0 if self.tied_embeddings else self.lm_head_params())

    def active_params(self) -> float:
        """Parameters multiplied per token (lm_head included, embedding lookup excluded)."""
        p = self._per_layer_common() + self.extra_params + self.lm_head_params()
        return p + self.moe_layers * (self.experts_per_token * self.expert_params() + self._moe_fixed_params())

    def experts_touched(self, tokens: float, ep: int = 1) -> float:
        """Expected distinct experts one EP rank reads per MoE layer for a forward over `tokens` tokens."""
        if not self.is_moe:
            return 0.0
        e, k = self.num_experts, self.experts_per_token
        return (e / ep) * (1.0 - (1.0 - k / e) ** max(tokens, 0.0))

    def streamed_params(self, tokens: float, shard: int = 1) -> float:
        """Weights one GPU of a `shard`-wide instance reads in a forward over `tokens` tokens.

        Dense parts are tensor-parallel over `shard`; experts are expert-parallel over `shard`.
        """
        dense = self._per_layer_common() + self.extra_params + self.lm_head_params()
        dense += self.moe_layers * self._moe_fixed_params()
        experts = self.moe_layers * self.experts_touched(tokens, shard) * self.expert_params()
        return dense / shard + experts

    # ---- KV cache and attention --------------------------------------------------------------------------
    def kv_bytes_per_token(self, kv_bytes: float = 2.0) -> float:
        if self.is_mla:
            return self.layers * (self.kv_lora_rank + self.qk_rope_dim) * kv_bytes
        return 2.0 * self.layers * self.kv_heads * self.head_dim * kv_bytes

    def kv_shard(self, shard: int) -> int:
        """How many ways the KV cache splits over a TP group (MLA latent KV and KV heads < TP replicate)."""
        return 1 if self.is_mla else max(1, min(shard, self.kv_heads))

    def attn_flops_per_pair(self) -> float:
        """FLOPs for one query token attending to one context token, all layers (QK^T and AV)."""
        if self.is_mla:  # absorbed MLA: scores over kv_lora+rope, values over kv_lora
            return 2.0 * self.layers * self.heads * (2 * self.kv_lora_rank + self.qk_rope_dim)
        return 4.0 * self.layers * self.heads * self.head_dim


# ---- HF config parsing -------------------------------------------------------------------------------------
def _req(cfg: dict, key: str, source: str):
    if key not in cfg:
        raise SpecRLError(f"{source}: config has no {key!r}; a HF decoder config needs hidden_size, "
                          "num_hidden_layers, num_attention_heads, intermediate_size and vocab_size")
    return cfg[key]


def from_hf_config(cfg: dict, name: str = "custom", source: str = "config.json") -> ModelSpec:
    if not isinstance(cfg, dict):
        raise SpecRLError(f"{source}: expected a JSON object, got {type(cfg).__name__}")
    if "text_config" in cfg and "hidden_size" not in cfg:
        cfg = cfg["text_config"]
    try:
        hidden = int(_req(cfg, "hidden_size", source))
        layers = int(_req(cfg, "num_hidden_layers", source))
        heads = int(_req(cfg, "num_attention_heads", source))
        vocab = int(_req(cfg, "vocab_size", source))
        kv_heads = int(cfg.get("num_key_value_heads") or heads)
        head_dim = int(cfg.get("head_dim") or hidden // heads)
        experts = int(cfg.get("num_experts") or cfg.get("n_routed_experts") or cfg.get("num_local_experts") or 0)
        inter = int(cfg.get("intermediate_size") or 0)
        moe_inter = int(cfg.get("moe_intermediate_size") or 0)
        if experts and not moe_inter:  # Mixtral: intermediate_size is the expert width, no dense FFN
            moe_inter, inter = inter, 0
        shared, shared_inter = int(cfg.get("n_shared_experts") or 0), moe_inter
        if cfg.get("shared_expert_intermediate_size"):  # Qwen2-MoE: one shared expert of its own width
            shared, shared_inter = 1, int(cfg["shared_expert_intermediate_size"])
        dense_layers = int(cfg.get("first_k_dense_replace") or 0) if experts else 0
        if experts and cfg.get("mlp_only_layers"):
            dense_layers += len(cfg["mlp_only_layers"])
        spec = ModelSpec(
            name=name, hidden=hidden, layers=layers, heads=heads, kv_heads=kv_heads, head_dim=head_dim,
            intermediate=inter, vocab=vocab, tied_embeddings=bool(cfg.get("tie_word_embeddings", False)),
            num_experts=experts, experts_per_token=int(cfg.get("num_experts_per_tok") or 0) if experts else 0,
            moe_intermediate=moe_inter, shared_experts=shared, shared_intermediate=shared_inter,
            dense_layers=dense_layers, mtp_layers=int(cfg.get("num_nextn_predict_layers") or 0),
            kv_lora_rank=int(cfg.get("kv_lora_rank") or 0), q_lora_rank=int(cfg.get("q_lora_rank") or 0),
            qk_rope_dim=int(cfg.get("qk_rope_head_dim") or 0), qk_nope_dim=int(cfg.get("qk_nope_head_dim") or 0),
            v_head_dim=int(cfg.get("v_head_dim") or 0),
        )
    except (TypeError, ValueError) as exc:
        if isinstance(exc, SpecRLError):
            raise
        raise SpecRLError(f"{source}: a size field is not an integer ({exc})") from exc
    _validate(spec, source)
    return spec


def _validate(m: ModelSpec, source: str) -> None:
    for field in ("hidden", "layers", "heads", "kv_heads", "head_dim", "vocab"):
        if getattr(m, field) <= 0:
            raise SpecRLError(f"{source}: {field} must be positive, got {getattr(m, field)}")
    if m.heads % m.kv_heads:
        raise SpecRLError(f"{source}: num_attention_heads={m.heads} is not a multiple of "
                          f"num_key_value_heads={m.kv_heads}")
    if m.is_moe and not (0 < m.experts_per_token <= m.num_experts and m.moe_intermediate > 0):
        raise SpecRLError(f"{source}: MoE needs 0 < num_experts_per_tok <= num_experts and a "
                          f"moe_intermediate_size; got k={m.experts_per_token}, E={m.num_experts}")
    if not m.is_moe and m.intermediate <= 0:
        raise SpecRLError(f"{source}: a dense model needs intermediate_size > 0")


def load_config(path: str | Path) -> ModelSpec:
    p = Path(path)
    if p.is_dir():
        p = p / "config.json"
    if not p.exists():
        raise SpecRLError(f"model config {p} does not exist; pass a catalog name ({', '.join(model_names())}) "
                          "or the path of a HF config.json")
    try:
        cfg = json.loads(p.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise SpecRLError(f"{p}: malformed config.json, not valid JSON ({exc})") from exc
    return from_hf_config(cfg, name=p.parent.name or p.stem, source=str(p))


_QWEN3 = dict(vocab_size=151936, head_dim=128, tie_word_embeddings=False)
CATALOG_CONFIGS: dict[str, dict] = {
    "qwen3-8b": dict(_QWEN3, hidden_size=4096, num_hidden_layers=36, num_attention_heads=32,
                     num_key_value_heads=8, intermediate_size=12288),
    "qwen3-32b": dict(_QWEN3, hidden_size=5120, num_hidden_layers=64, num_attention_heads=64,
                      num_key_value_heads=8, intermediate_size=25600),
    "qwen3-235b-a22b": dict(_QWEN3, hidden_size=4096, num_hidden_layers=94, num_attention_heads=64,
                            num_key_value_heads=4, intermediate_size=12288, num_experts=128,
                            num_experts_per_tok=8, moe_intermediate_size=1536),
    "llama-3.1-70b": dict(hidden_size=8192, num_hidden_layers=80, num_attention_heads=64, num_key_value_heads=8,
                          intermediate_size=28672, vocab_size=128256, tie_word_embeddings=False),
    "deepseek-v3": dict(hidden_size=7168, num_hidden_layers=61, num_attention_heads=128, num_key_value_heads=128,
                        intermediate_size=18432, moe_intermediate_size=2048, n_routed_experts=256,
                        num_experts_per_tok=8, n_shared_experts=1, first_k_dense_replace=3, vocab_size=129280,
                        kv_lora_rank=512, q_lora_rank=1536, qk_rope_head_dim=64, qk_nope_head_dim=128,
                        v_head_dim=128, num_nextn_predict_layers=1, tie_word_embeddings=False),
    # small models: draft models and the CPU fidelity target
    "qwen3-0.6b": dict(_QWEN3, hidden_size=1024, num_hidden_layers=28, num_attention_heads=16,
                       num_key_value_heads=8, intermediate_size=3072, tie_word_embeddings=True),
    "qwen3-1.7b": dict(_QWEN3, hidden_size=2048, num_hidden_layers=28, num_attention_heads=16,
                       num_key_value_heads=8, intermediate_size=6144, tie_word_embeddings=True),
    "smollm2-135m": dict(hidden_size=576, num_hidden_layers=30, num_attention_heads=9, num_key_value_heads=3,
                         head_dim=64, intermediate_size=1536, vocab_size=49152, tie_word_embeddings=True),
}


def model_names() -> list[str]:
    return sorted(CATALOG_CONFIGS)


def get_model(name_or_path: str) -> ModelSpec:
    if name_or_path in CATALOG_CONFIGS:
        return from_hf_config(CATALOG_CONFIGS[name_or_path], name=name_or_path, source=name_or_path)
    if name_or_path.endswith(".json") or "/" in name_or_path or Path(name_or_path).is_dir():
        return load_config(name_or_path)
    raise SpecRLError(f"unknown model {name_or_path!r}; valid: {', '.join(model_names())} "
                      "(or a path to a HF config.json)")


# ---- drafters -----------------------------------------------------------------------------------------------
EAGLE_DRAFT_VOCAB = 32000


def eagle3_head(target: ModelSpec, draft_vocab: int | None = None) -> ModelSpec:
    """EAGLE-3 head: one dense decoder layer reading concat(embedding, hidden), an fc fusing three target
    hidden states (3h -> h) and an lm_head over a reduced draft vocabulary (`draft_vocab`, default 32k)."""
    inter = target.intermediate or 3 * target.hidden
    vocab = EAGLE_DRAFT_VOCAB if draft_vocab is None else int(draft_vocab)
    if not 1 <= vocab <= target.vocab:
        raise SpecRLError(f"EAGLE draft vocabulary {vocab} must be in [1, {target.vocab}] (the target's vocabulary)")
    return ModelSpec(
        name=f"eagle3({target.name})", hidden=target.hidden, layers=1, heads=target.heads,
        kv_heads=target.kv_heads, head_dim=target.head_dim, intermediate=inter, vocab=vocab,
        tied_embeddings=True, extra_params=3.0 * target.hidden * target.hidden, attn_input_mult=2,
    )


def mtp_head(target: ModelSpec) -> ModelSpec:
    """One MTP module: a decoder layer of the target's kind, an eh_proj (2h -> h), the shared full lm_head."""
    if target.mtp_layers <= 0:
        raise SpecRLError(f"model {target.name!r} has no MTP layers (num_nextn_predict_layers=0); use "
                          "--drafter eagle3, draft-model or ngram, or a model with MTP such as deepseek-v3")
    return replace(target, name=f"mtp({target.name})", layers=1, dense_layers=0, mtp_layers=0,
                   tied_embeddings=True, extra_params=2.0 * target.hidden * target.hidden)

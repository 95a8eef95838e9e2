"""The decoder-only transformer: Llama, Qwen2 (qkv bias) and Qwen3 (q/k RMSNorm) in one module.

`ModelArgs` is the single dataclass describing an architecture; `Transformer.forward` takes tokens of many
sequences with explicit positions and an optional `KVCache` (preallocated, slot-indexed), and can return the
hidden states of chosen layers (EAGLE-3 / MTP drafters read them). Without a cache the forward is a plain
causal pass over the given tokens (what the RL trainer uses to recompute log-probabilities). Stale cache
entries beyond a sequence's current length are never read: a query at position p only attends to keys at
positions <= p, so rolling back rejected speculative tokens costs nothing.

The attention math (`Attention.project` for q/k/v, `Attention.store` for cache writes) and RoPE (`rope_cos_sin`)
are written once here; the EAGLE and MTP drafters run their decoder layers through the same functions.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from specrl.model.packed import fused_linear

SUPPORTED_ARCHITECTURES = {
    "LlamaForCausalLM": "llama",
    "Qwen2ForCausalLM": "qwen2",
    "Qwen3ForCausalLM": "qwen3",
}


@dataclass
class ModelArgs:
    arch: str = "llama"  # llama | qwen2 | qwen3
    vocab_size: int = 32000
    hidden_size: int = 576
    intermediate_size: int = 1536
    num_layers: int = 30
    num_heads: int = 9
    num_kv_heads: int = 3
    head_dim: int = 64
    rms_norm_eps: float = 1e-5
    rope_theta: float = 10000.0
    rope_scaling: dict | None = None
    tie_word_embeddings: bool = True
    attention_bias: bool = False
    qk_norm: bool = False
    max_position_embeddings: int = 8192
    bos_token_id: int | None = None
    eos_token_id: list[int] = field(default_factory=list)

    def to_dict(self) -> dict:
        return asdict(self)


def _rope_inv_freq(args: ModelArgs) -> Tensor:
    dim = args.head_dim
    inv_freq = 1.0 / (args.rope_theta ** (torch.arange(0, dim, 2, dtype=torch.float64) / dim))
    rs = args.rope_scaling
    if rs and rs.get("rope_type", rs.get("type")) == "llama3":
        factor = float(rs["factor"])
        low = float(rs.get("low_freq_factor", 1.0))
        high = float(rs.get("high_freq_factor", 4.0))
        old_len = float(rs["original_max_position_embeddings"])
        low_wavelen, high_wavelen = old_len / low, old_len / high
        wavelen = 2 * math.pi / inv_freq
        scaled = torch.where(wavelen > low_wavelen, inv_freq / factor, inv_freq)
        smooth = (old_len / wavelen - low) / (high - low)
        smoothed = (1 - smooth) * scaled / factor + smooth * scaled
        medium = (wavelen >= high_wavelen) & (wavelen <= low_wavelen)
        inv_freq = torch.where(medium, smoothed, scaled)
    return inv_freq.float()


def rope_cos_sin(inv_freq: Tensor, pos: Tensor, dtype: torch.dtype) -> tuple[Tensor, Tensor]:
    """Rotary cos/sin [b, 1, t, d] for positions pos [b, t] (computed in float32, returned in `dtype`)."""
    freqs = pos[..., None].float() * inv_freq.to(pos.device)  # [b, t, d/2]
    emb = torch.cat((freqs, freqs), dim=-1)[:, None]  # [b, 1, t, d]
    return emb.cos().to(dtype), emb.sin().to(dtype)


def _rotate(x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
    # HF "rotate_half" convention: x = [x1, x2] halves.
    x1, x2 = x.chunk(2, dim=-1)
    return x * cos + torch.cat((-x2, x1), dim=-1) * sin


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: Tensor) -> Tensor:
        xf = x.float()
        xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * xf.to(x.dtype)


class KVCache:
    """Preallocated keys/values: [layers][slots, kv_heads, max_seq_len, head_dim] per tensor."""

    def __init__(self, args: ModelArgs, num_slots: int, max_seq_len: int, dtype: torch.dtype,
                 device: torch.device | str = "cpu"):
        shape = (num_slots, args.num_kv_heads, max_seq_len, args.head_dim)
        self.k = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(args.num_layers)]
        self.v = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(args.num_layers)]
        self.num_slots = num_slots
        self.max_seq_len = max_seq_len

    def slots(self, start: int, stop: int) -> KVCache:
        """A view of slots start..stop-1 (writes go to this cache); forwards see them as slots 0..n-1."""
        view = object.__new__(KVCache)
        view.k = [t[start:stop] for t in self.k]
        view.v = [t[start:stop] for t in self.v]
        view.num_slots = stop - start
        view.max_seq_len = self.max_seq_len
        return view

    def compact(self, order: list[int], length: int) -> None:
        """Slots order[0], order[1], ... move to slots 0, 1, ... (first `length` positions), in one gather."""
        src = torch.tensor(order, device=self.k[0].device)
        m = len(order)
        for layer in range(len(self.k)):
            self.k[layer][:m, :, :length] = self.k[layer][src, :, :length]
            self.v[layer][:m, :, :length] = self.v[layer][src, :, :length]


def _cached_attention(q: Tensor, k: Tensor, v: Tensor, mask: Tensor) -> Tensor:
    """GQA attention of few queries against a cache view, as two batched matmuls (no KV head repeat).

    q [b, H, t, d]; k, v [b, KV, S, d]; mask [b, 1, t, S] (True = attend). Softmax in float32. For decode
    shapes this is several times faster on CPU than the fused SDPA kernel with a mask.
    """
    b, h, t, d = q.shape
    kvh, s = k.shape[1], k.shape[2]
    g = h // kvh
    scores = (q.reshape(b, kvh, g * t, d) @ k.transpose(-1, -2)).float() * (d ** -0.5)
    m = mask[:, :, None].expand(b, 1, g, t, s).reshape(b, 1, g * t, s)
    probs = torch.softmax(scores.masked_fill(~m, float("-inf")), dim=-1).to(v.dtype)
    return (probs @ v).reshape(b, h, t, d)


def cache_mask(pos: Tensor, kv_len: int | None = None) -> tuple[Tensor, int]:
    """(mask [b, 1, t, kv_len], kv_len) of queries at positions pos [b, t] over a cache: key p' <= query p.
    `kv_len` (max position + 1) when the caller knows it on the host: no device-to-host read of pos.max()."""
    if kv_len is None or pos.device.type == "cpu":  # on CPU the read is free: check the caller's figure
        real = int(pos.max()) + 1
        if kv_len is not None and kv_len != real:
            raise ValueError(f"cache_mask: kv_len={kv_len} but the largest position is {real - 1}")
        kv_len = real
    keys = torch.arange(kv_len, device=pos.device)
    return keys[None, None, None, :] <= pos[:, None, :, None], kv_len


class Attention(nn.Module):
    PACKED_GROUPS = {"qkv": ("q_proj", "k_proj", "v_proj"), "kv": ("k_proj", "v_proj")}

    def __init__(self, args: ModelArgs):
        super().__init__()
        self.args = args
        h, d = args.hidden_size, args.head_dim
        self.q_proj = nn.Linear(h, args.num_heads * d, bias=args.attention_bias)
        self.k_proj = nn.Linear(h, args.num_kv_heads * d, bias=args.attention_bias)
        self.v_proj = nn.Linear(h, args.num_kv_heads * d, bias=args.attention_bias)
        self.o_proj = nn.Linear(args.num_heads * d, h, bias=False)
        if args.qk_norm:
            self.q_norm = RMSNorm(d, args.rms_norm_eps)
            self.k_norm = RMSNorm(d, args.rms_norm_eps)

    def project(self, x: Tensor, cos: Tensor, sin: Tensor, queries: bool = True
                ) -> tuple[Tensor | None, Tensor, Tensor]:
        """q [b, heads, t, d] (None with queries=False), k and v [b, kv_heads, t, d]: projected, q/k-normed
        (Qwen3) and rotated."""
        # the op order (q, k, v; norms; rotations) fixes autograd's gradient summation order: keep it
        a = self.args
        b, t, _ = x.shape
        qd, kd = a.num_heads * a.head_dim, a.num_kv_heads * a.head_dim
        layers = [self.q_proj, self.k_proj, self.v_proj] if queries else [self.k_proj, self.v_proj]
        fused = fused_linear(self, "qkv" if queries else "kv", layers, x)  # packed inference: one product
        if fused is not None:
            parts = fused.split([qd, kd, kd] if queries else [kd, kd], dim=-1)
            q = parts[0].reshape(b, t, a.num_heads, a.head_dim) if queries else None
            k = parts[-2].reshape(b, t, a.num_kv_heads, a.head_dim)
            v = parts[-1].reshape(b, t, a.num_kv_heads, a.head_dim)
        else:
            q = self.q_proj(x).view(b, t, a.num_heads, a.head_dim) if queries else None
            k = self.k_proj(x).view(b, t, a.num_kv_heads, a.head_dim)
            v = self.v_proj(x).view(b, t, a.num_kv_heads, a.head_dim)
        if a.qk_norm:
            q = self.q_norm(q) if queries else None
            k = self.k_norm(k)
        q = _rotate(q.transpose(1, 2), cos, sin) if queries else None
        return q, _rotate(k.transpose(1, 2), cos, sin), v.transpose(1, 2)

    @staticmethod
    def store(cache: KVCache, layer: int, k: Tensor, v: Tensor, input_pos: Tensor) -> None:
        """Write k, v [b, kv_heads, t, d] into cache slots 0..b-1 at positions input_pos [b, t]."""
        kc, vc = cache.k[layer], cache.v[layer]
        rows = torch.arange(k.shape[0], device=k.device)[:, None]
        kc[rows, :, input_pos] = k.transpose(1, 2).to(kc.dtype)
        vc[rows, :, input_pos] = v.transpose(1, 2).to(vc.dtype)

    def forward(self, x: Tensor, cos: Tensor, sin: Tensor, mask: Tensor | None, layer: int,
                cache: KVCache | None, input_pos: Tensor | None, kv_len: int,
                prefix: tuple[list[Tensor], list[Tensor]] | None = None) -> Tensor:
        """Attention over the cache (with `cache`), causal or `mask`ed over x itself, or, with `prefix`
        (lists of earlier keys and values, no cache), over those plus x's own; x's k/v are then appended to
        the prefix lists (how EAGLE's training-time test feeds one step's keys to the next)."""
        a = self.args
        b, t, _ = x.shape
        q, k, v = self.project(x, cos, sin)
        if cache is not None:
            self.store(cache, layer, k, v, input_pos)
            out = _cached_attention(q, cache.k[layer][:b, :, :kv_len], cache.v[layer][:b, :, :kv_len], mask)
        elif prefix is not None:
            ks, vs = prefix
            out = F.scaled_dot_product_attention(q, torch.cat([*ks, k], dim=2), torch.cat([*vs, v], dim=2),
                                                 attn_mask=mask, enable_gqa=True)
            ks.append(k)
            vs.append(v)
        else:
            out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=mask is None,
                                                 enable_gqa=True)
        return self.o_proj(out.transpose(1, 2).reshape(b, t, a.num_heads * a.head_dim))


class MLP(nn.Module):
    PACKED_GROUPS = {"gate_up": ("gate_proj", "up_proj")}

    def __init__(self, args: ModelArgs):
        super().__init__()
        self.gate_proj = nn.Linear(args.hidden_size, args.intermediate_size, bias=False)
        self.up_proj = nn.Linear(args.hidden_size, args.intermediate_size, bias=False)
        self.down_proj = nn.Linear(args.intermediate_size, args.hidden_size, bias=False)

    def forward(self, x: Tensor) -> Tensor:
        fused = fused_linear(self, "gate_up", [self.gate_proj, self.up_proj], x)  # packed inference
        if fused is not None:
            gate, up = fused.chunk(2, dim=-1)
            return self.down_proj(F.silu(gate) * up)
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class Block(nn.Module):
    def __init__(self, args: ModelArgs):
        super().__init__()
        self.self_attn = Attention(args)
        self.mlp = MLP(args)
        self.input_layernorm = RMSNorm(args.hidden_size, args.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(args.hidden_size, args.rms_norm_eps)

    def forward(self, x, cos, sin, mask, layer, cache, input_pos, kv_len, prefix=None):
        x = x + self.self_attn(self.input_layernorm(x), cos, sin, mask, layer, cache, input_pos, kv_len, prefix)
        return x + self.mlp(self.post_attention_layernorm(x))

    def store_kv(self, x: Tensor, cos: Tensor, sin: Tensor, cache: KVCache, layer: int, input_pos: Tensor) -> None:
        """Write only the keys/values `forward` would write into the cache for x: no attention, no MLP."""
        _, k, v = self.self_attn.project(self.input_layernorm(x), cos, sin, queries=False)
        Attention.store(cache, layer, k, v, input_pos)


class Transformer(nn.Module):
    """Decoder-only LM. Parameter names follow HF (`model.layers.N...`) minus the `model.` prefix."""

    def __init__(self, args: ModelArgs):
        super().__init__()
        self.args = args
        self.embed_tokens = nn.Embedding(args.vocab_size, args.hidden_size)
        self.layers = nn.ModuleList(Block(args) for _ in range(args.num_layers))
        self.norm = RMSNorm(args.hidden_size, args.rms_norm_eps)
        self.lm_head = nn.Linear(args.hidden_size, args.vocab_size, bias=False)
        if args.tie_word_embeddings:
            self.lm_head.weight = self.embed_tokens.weight
        self.register_buffer("inv_freq", _rope_inv_freq(args), persistent=False)

    @property
    def dtype(self) -> torch.dtype:
        return self.embed_tokens.weight.dtype

    def new_cache(self, num_slots: int, max_seq_len: int) -> KVCache:
        return KVCache(self.args, num_slots, max_seq_len, self.dtype, self.embed_tokens.weight.device)

    def forward_hidden(self, tokens: Tensor, input_pos: Tensor | None = None, kv_cache: KVCache | None = None,
                       capture: tuple[int, ...] | list[int] = (), kv_len: int | None = None
                       ) -> tuple[Tensor, dict[int, Tensor]]:
        """Run the layers; return the final-normed hidden states [B,T,H] and captured layer outputs.

        With `kv_cache`, sequence b lives in cache slot b and `input_pos` [B,T] gives each token's position.
        `capture` lists layer indices whose outputs (residual stream after that layer) are returned. `kv_len`
        (with a cache: the largest position in input_pos + 1) spares reading it back from the device.
        """
        b, t = tokens.shape
        if input_pos is None:
            input_pos = torch.arange(t, device=tokens.device).expand(b, t)
        x = self.embed_tokens(tokens)
        cos, sin = rope_cos_sin(self.inv_freq, input_pos, x.dtype)
        mask = None
        if kv_cache is not None:
            mask, kv_len = cache_mask(input_pos, kv_len)
        else:
            kv_len = t
        captured: dict[int, Tensor] = {}
        want = set(capture)
        for i, layer in enumerate(self.layers):
            x = layer(x, cos, sin, mask, i, kv_cache, input_pos, kv_len)
            if i in want:
                captured[i] = x
        return self.norm(x), captured

    def forward_hidden_shared(self, prefix: Tensor, prefix_lens: Tensor, tokens: Tensor, group: Tensor,
                              capture: tuple[int, ...] | list[int] = ()
                              ) -> tuple[Tensor, Tensor, dict[int, tuple[Tensor, Tensor]]]:
        """Causal forward of sequences that share prefixes, each prefix run once (no cache; trainable).

        `prefix` [G, P]: G right-padded prefixes, `prefix_lens` [G] their lengths (>= 1); `tokens` [B, S]: each
        row's own tokens (right-padded), which continue prefix `group[b]` at position `prefix_lens[group[b]]`.
        Row b attends to its prefix's first prefix_lens keys and causally to its own tokens: the numbers of a plain
        `forward_hidden` over prefix + tokens, up to summation order. Returns the final-normed hidden states of
        the prefixes [G, P, H] and of the rows [B, S, H], and {layer: (prefix output, rows output)} for `capture`.
        """
        (g, p), (b, s) = prefix.shape, tokens.shape
        dev = tokens.device
        xp = self.embed_tokens(prefix)
        cos_p, sin_p = rope_cos_sin(self.inv_freq, torch.arange(p, device=dev).expand(g, p), xp.dtype)
        causal_p = torch.ones(p, p, dtype=torch.bool, device=dev).tril()[None, None]
        x = self.embed_tokens(tokens)
        own = torch.arange(s, device=dev)
        row_start = prefix_lens.to(dev)[group]  # [B]
        cos, sin = rope_cos_sin(self.inv_freq, row_start[:, None] + own[None, :], x.dtype)
        mask = torch.cat([(torch.arange(p, device=dev)[None, :] < row_start[:, None])[:, None, :].expand(b, s, p),
                          (own[None, :] <= own[:, None])[None].expand(b, s, s)], dim=-1)[:, None]  # [B,1,S,P+S]
        captured: dict[int, tuple[Tensor, Tensor]] = {}
        want = set(capture)
        for i, layer in enumerate(self.layers):
            ks: list[Tensor] = []
            vs: list[Tensor] = []
            xp = layer(xp, cos_p, sin_p, causal_p, i, None, None, p, prefix=(ks, vs))
            x = layer(x, cos, sin, mask, i, None, None, p + s, prefix=([ks[0][group]], [vs[0][group]]))
            if i in want:
                captured[i] = (xp, x)
        return self.norm(xp), self.norm(x), captured

    def logits(self, hidden: Tensor) -> Tensor:
        return self.lm_head(hidden).float()

    def forward(self, tokens: Tensor, input_pos: Tensor | None = None, kv_cache: KVCache | None = None,
                capture: tuple[int, ...] | list[int] = ()) -> tuple[Tensor, dict]:
        """Logits [B,T,V] (float32) and captured hidden states ({layer: [B,T,H]} plus "final")."""
        h, captured = self.forward_hidden(tokens, input_pos, kv_cache, capture)
        captured["final"] = h
        return self.logits(h), captured


def tiny_args(arch: str = "llama", vocab_size: int = 64, **overrides) -> ModelArgs:
    """A small random-model architecture for tests (Llama, Qwen2 or Qwen3 flavour)."""
    args = ModelArgs(arch=arch, vocab_size=vocab_size, hidden_size=32, intermediate_size=64, num_layers=4,
                     num_heads=4, num_kv_heads=2, head_dim=8, rope_theta=10000.0, tie_word_embeddings=True,
                     attention_bias=arch == "qwen2", qk_norm=arch == "qwen3", max_position_embeddings=512)
    for k, v in overrides.items():
        setattr(args, k, v)
    return args


def tiny_model(arch: str = "llama", vocab_size: int = 64, seed: int = 0, **overrides) -> Transformer:
    """A random-weight tiny Transformer (fp32) for tests and examples."""
    torch.manual_seed(seed)
    model = Transformer(tiny_args(arch, vocab_size, **overrides))
    with torch.no_grad():
        for p in model.parameters():
            p.normal_(0.0, 0.5 if p.dim() == 1 else 0.2)
        for name, p in model.named_parameters():
            if "norm" in name:
                p.add_(1.0)
    return model.eval()

"""Execution-time predictor: the time of one forward pass from a roofline, plus the fitted efficiencies.

`Efficiency` holds the only fitted numbers in the simulator (achieved fractions of peak FLOP/s and bandwidth,
per-forward overheads, stage fixed costs); everything else comes from `ModelSpec` and `Hardware`.
`ForwardCost` binds a model, a device, a precision and an engine width (GPUs per engine, tensor-parallel for
dense weights and attention, expert-parallel for experts) and answers "how long does a forward over T tokens
that reads K cached tokens take": the weight GEMMs (max(GEMM FLOPs / achieved FLOP/s, streamed weights + fp32
logits / achieved bandwidth)) plus the attention over the KV cache (max(attention FLOPs / FLOP/s, KV bytes /
bandwidth)) — two kernel families that run one after the other, so each has its own roofline and they add —
+ TP/EP communication + a fixed per-forward overhead. Streamed weights are MoE-aware (only touched experts).

CUDA-graph coverage (GPU devices, `Hardware.cuda_graphs`): a forward over at most `graph_max_tokens` tokens replays
a captured graph — one launch, whose host cost is inside the fitted `overhead_s`. A larger forward runs outside
any graph (vLLM: CUDAGraphMode.NONE above the largest capture size), so the host launches every kernel:
`eager_launch_seconds` = layers x `KERNELS_PER_LAYER` x the device's per-launch cost. The host launches
asynchronously, so the device time of such a forward is max(roofline time, launch time): launches cost only when
the kernels are shorter than their launches. On a CPU the mechanism is off by construction (no graphs, launch 0).
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, fields

from specrl.errors import SpecRLError
from specrl.sim.costs.accelerators import Hardware
from specrl.sim.costs.models import DTYPE_BYTES, ModelSpec


@dataclass(frozen=True)
class Efficiency:
    """Fitted factors. Fractions are of the hardware peaks; seconds are fixed costs."""

    bw_eff: float = 0.7  # achieved fraction of HBM bandwidth in decode/verify forwards
    flops_eff: float = 0.5  # achieved fraction of peak FLOP/s in decode/verify/prefill forwards
    step_overhead_s: float = 2e-3  # per target forward: scheduling, launch, sampling bookkeeping
    draft_overhead_s: float = 0.5e-3  # per drafter forward
    ngram_overhead_s: float = 0.5e-3  # per step: CPU n-gram lookup (assumed, not fitted)
    decode_seq_overhead_s: float = 0.0  # per sequence per decode step (AR or verify): host-side sampling/bookkeeping
    spec_seq_overhead_s: float = 0.0  # per sequence per speculative step: host-side drafting + acceptance work
    mfu_logprob: float = 0.3  # achieved fraction of peak in the trainer's logprob forward
    mfu_train: float = 0.35  # achieved fraction of peak in forward+backward
    # achieved fraction of peak of the trainer's attention kernels (logprob and train); 0: the stage's MFU.
    # Separate where attention runs far below the GEMMs (specrl's CPU trainer: SDPA over padded micro-batches).
    mfu_attention: float = 0.0
    prepare_fixed_s: float = 1.5  # weight-sync fixed cost (engine wake-up, cache reset)
    data_s: float = 0.2  # data stage

    def __post_init__(self) -> None:
        for f in ("bw_eff", "flops_eff", "mfu_logprob", "mfu_train"):
            v = getattr(self, f)
            if not 0.0 < v <= 1.0:
                raise SpecRLError(f"efficiency {f}={v} must be a fraction in (0, 1]")
        if not 0.0 <= self.mfu_attention <= 1.0:
            raise SpecRLError(f"efficiency mfu_attention={self.mfu_attention} must be in [0, 1] (0: attention at the "
                              "stage's MFU)")
        for f in ("step_overhead_s", "draft_overhead_s", "ngram_overhead_s", "spec_seq_overhead_s", "prepare_fixed_s",
                  "data_s", "decode_seq_overhead_s"):
            if getattr(self, f) < 0:
                raise SpecRLError(f"efficiency {f}={getattr(self, f)} must be >= 0 seconds")

    def to_dict(self) -> dict:
        return asdict(self)

    @classmethod
    def from_dict(cls, d: dict) -> Efficiency:
        names = {f.name for f in fields(cls)}
        unknown = set(d) - names
        if unknown:
            raise SpecRLError(f"unknown efficiency fields {sorted(unknown)}; valid: {sorted(names)}")
        return cls(**{k: float(v) for k, v in d.items()})


# Kernels one decoder layer launches outside a CUDA graph: ~8 for the attention block and ~7 for the MLP
# (Venkat2811/gpu-kernel-batcher, counted for Llama-70B). With `Hardware.kernel_launch_s` (17.5 us) a Qwen3-8B
# forward takes 36 x 15 x 17.5 us = 9.5 ms to launch; a 1-layer EAGLE-3 head 0.26 ms.
KERNELS_PER_LAYER = 15


def eager_launch_seconds(model: ModelSpec, hw: Hardware) -> float:
    """Host seconds to launch one forward of `model` kernel by kernel (0 on a device without CUDA graphs)."""
    if not hw.cuda_graphs:
        return 0.0
    return model.layers * KERNELS_PER_LAYER * hw.kernel_launch_s


class ForwardCost:
    """Time of one forward of `model` on one engine of `shard` devices (all numbers per device)."""

    def __init__(self, model: ModelSpec, hw: Hardware, eff: Efficiency, precision: str, shard: int,
                 overhead_s: float, kv_dtype_bytes: float = 2.0, graph_max_tokens: float = math.inf) -> None:
        self.model, self.hw, self.eff, self.shard = model, hw, eff, shard
        self.overhead_s = overhead_s
        if graph_max_tokens < 0:
            raise SpecRLError(f"graph_max_tokens={graph_max_tokens} must be >= 0 (0: no CUDA graphs)")
        self.graph_max_tokens = graph_max_tokens  # forwards over more tokens run outside a CUDA graph
        self.eager_launch_s = eager_launch_seconds(model, hw)
        self.wbytes = DTYPE_BYTES[precision]
        self.flops_rate = hw.flops(precision) * eff.flops_eff
        self.bw_rate = hw.hbm_bandwidth * eff.bw_eff
        self.kv_per_token = model.kv_bytes_per_token(kv_dtype_bytes) / model.kv_shard(shard)
        self.active = model.active_params()
        self.attn_pair = model.attn_flops_per_pair()
        self.logit_bytes = model.vocab * 4.0 * 2.0 / shard
        self._moe = model.is_moe
        self._dense_bytes = model.streamed_params(0.0, shard) * self.wbytes
        if self._moe:
            e, k = model.num_experts, model.experts_per_token
            self._expert_bytes = model.moe_layers * (e / shard) * model.expert_params() * self.wbytes
            self._log_miss = math.log(1.0 - k / e) if k < e else -math.inf
        # communication: per-layer all-reduces (dense) or all-to-all (MoE), ring algorithm
        self.comm_per_token, self.comm_fixed = 0.0, 0.0
        if shard > 1:
            bw = hw.link_bandwidth(shard)
            ring = 2.0 * (shard - 1) / shard
            act = model.hidden * 2.0
            n_allreduce = model.layers + model.dense_ffn_layers  # attention out + dense FFN out
            self.comm_per_token = n_allreduce * ring * act / bw
            a2a = 2.0 * model.moe_layers * model.experts_per_token * act * (shard - 1) / shard / bw
            self.comm_per_token += a2a
            # one collective after attention and one after a dense FFN; an MoE layer has two (dispatch + combine)
            n_coll = model.layers + model.dense_ffn_layers + 2 * model.moe_layers
            self.comm_fixed = n_coll * hw.collective_latency_s

    def weight_bytes(self, tokens: float) -> float:
        """Same as model.streamed_params(tokens, shard) * bytes, with the structure precomputed."""
        if not self._moe:
            return self._dense_bytes
        return self._dense_bytes + self._expert_bytes * (1.0 - math.exp(self._log_miss * max(tokens, 0.0)))

    # the two kernel families of a forward, each bound by its own resource
    def gemm_flop_seconds(self, tokens: float) -> float:
        return 2.0 * self.active * tokens / self.shard / self.flops_rate

    def gemm_byte_seconds(self, tokens: float) -> float:
        return (self.weight_bytes(tokens) + tokens * self.logit_bytes) / self.bw_rate

    def attn_flop_seconds(self, attn_pairs: float) -> float:
        return self.attn_pair * attn_pairs / self.shard / self.flops_rate

    def attn_byte_seconds(self, kv_read_tokens: float) -> float:
        return kv_read_tokens * self.kv_per_token / self.bw_rate

    def graphed(self, tokens: float) -> bool:
        """Whether a forward over `tokens` replays a CUDA graph (always True on a device without graphs)."""
        return self.eager_launch_s == 0.0 or tokens <= self.graph_max_tokens

    def __call__(self, tokens: float, kv_read_tokens: float, attn_pairs: float | None = None) -> float:
        """Seconds for a forward over `tokens` new tokens that read `kv_read_tokens` cached tokens.

        `attn_pairs` (query x context pairs) defaults to tokens-per-sequence x cached tokens for decode.
        The weight GEMMs (+ LM head and logits) and the attention over the KV cache are separate kernels that
        run one after the other in every layer, so each is priced by its own roofline and the two add: the
        KV read of a long-context batch does not hide the GEMM FLOPs of a verify over B*(k+1) tokens.
        """
        if tokens <= 0:
            return 0.0
        pairs = kv_read_tokens if attn_pairs is None else attn_pairs
        t = max(self.gemm_flop_seconds(tokens), self.gemm_byte_seconds(tokens))
        t += max(self.attn_flop_seconds(pairs), self.attn_byte_seconds(kv_read_tokens))
        if self.shard > 1:
            t += tokens * self.comm_per_token + self.comm_fixed
        if not self.graphed(tokens):  # kernel-by-kernel launches, overlapped with the kernels they launch
            t = max(t, self.eager_launch_s)
        return t + self.overhead_s

    def ridge_tokens(self, kv_read_tokens: float = 0.0) -> float:
        """Smallest tokens per forward at which the weight GEMMs turn compute-bound (bisection)."""
        lo, hi = 1.0, 1.0
        while self.gemm_flop_seconds(hi) < self.gemm_byte_seconds(hi):
            hi *= 2.0
            if hi > 1e9:
                return float("inf")
        while hi - lo > 0.5:
            mid = (lo + hi) / 2
            if self.gemm_flop_seconds(mid) < self.gemm_byte_seconds(mid):
                lo = mid
            else:
                hi = mid
        return hi

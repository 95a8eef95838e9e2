"""Sampling parameters, logits -> probabilities, and position-keyed random numbers.

Every random number used in generation is a pure function of (seed, request id, position, stream): a
counter-based hash (splitmix64) turned into a uniform in (0, 1). So a sequence's output never depends on
batch composition, and the autoregressive sampler, the drafters and the verifier can share noise exactly
(the `seed_exact` verification mode relies on this). Tokens are drawn by inverse-CDF with one uniform per
position. `probs_from_logits` applies temperature, top-k and top-p; temperature 0 means greedy (one-hot).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
from torch import Tensor

from specrl.errors import SpecRLError

# Noise streams: which independent random number a (seed, request, position) triple feeds.
STREAM_SAMPLE = 0  # the policy's own sample at a position (AR sampling, bonus tokens, seed_exact)
STREAM_ACCEPT = 1  # rejection sampling: the accept/reject test
STREAM_RESIDUAL = 2  # rejection sampling: the replacement drawn from norm(max(0, p - q))
STREAM_DRAFT = 3  # drafters sampling their proposal from q in rejection mode
MAX_SEED = 2**63 - 1  # seeds travel as int64 tensors


@dataclass(frozen=True)
class SamplingParams:
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0  # 0 = no top-k
    max_new_tokens: int = 128
    stop_token_ids: tuple[int, ...] = field(default_factory=tuple)
    seed: int = 0

    def __post_init__(self):
        if not isinstance(self.temperature, (int, float)) or self.temperature < 0:
            raise SpecRLError(f"temperature must be >= 0 (0 = greedy), got {self.temperature!r}")
        if not isinstance(self.top_p, (int, float)) or not (0.0 < self.top_p <= 1.0):
            raise SpecRLError(f"top_p must be in (0, 1], got {self.top_p!r}")
        if not isinstance(self.top_k, int) or self.top_k < 0:
            raise SpecRLError(f"top_k must be an integer >= 0 (0 disables top-k), got {self.top_k!r}")
        if not isinstance(self.max_new_tokens, int) or self.max_new_tokens < 1:
            raise SpecRLError(f"max_new_tokens must be an integer >= 1, got {self.max_new_tokens!r}")
        if not isinstance(self.seed, int) or not 0 <= self.seed <= MAX_SEED:
            raise SpecRLError(f"seed must be an integer in 0..{MAX_SEED} (2**63 - 1), got {self.seed!r}")
        object.__setattr__(self, "stop_token_ids", tuple(int(t) for t in self.stop_token_ids))

    @property
    def greedy(self) -> bool:
        return self.temperature == 0


_M1 = -4658895280553007687  # 0xbf58476d1ce4e5b9 as int64
_M2 = -7723592293110705685  # 0x94d049bb133111eb as int64
_GOLDEN = -7046029254386353131  # 0x9e3779b97f4a7c15 as int64


def _srl(x: Tensor, s: int) -> Tensor:
    """Logical right shift on int64."""
    return (x >> s) & ((1 << (64 - s)) - 1)


def _mix(x: Tensor) -> Tensor:
    x = (x ^ _srl(x, 30)) * _M1
    x = (x ^ _srl(x, 27)) * _M2
    return x ^ _srl(x, 31)


def uniform(seed: Tensor, request: Tensor, position: Tensor, stream: int) -> Tensor:
    """U(0,1) float64, a pure function of (seed, request, position, stream); inputs broadcast (int64)."""
    x = _mix(seed.long() * _GOLDEN + stream)
    x = _mix(x ^ (request.long() * _GOLDEN))
    x = _mix(x ^ (position.long() * _GOLDEN + 0x632BE5AB))
    return _unit_interval(x)


_BELOW_ONE = 1.0 - 2.0 ** -53  # the largest float64 below 1


def _unit_interval(bits: Tensor) -> Tensor:
    """The top 53 bits of int64 `bits` as a float64 strictly inside (0, 1): (m + 0.5) / 2^53 for m = bits >> 11.

    For m >= 2^52, m + 0.5 is not a float64 and rounds to an even neighbour; m = 2^53 - 1 rounds up to 2^53,
    giving exactly 1.0 (once in 2^53 draws). That one value is mapped to the largest float64 below 1, which no
    other m produces (ties round to even, never to the odd 2^53 - 1), so every other draw is unchanged."""
    return ((_srl(bits, 11).double() + 0.5) / float(1 << 53)).clamp_max(_BELOW_ONE)


def scaled_logits(logits: Tensor, temperature: Tensor, top_p: Tensor, top_k: Tensor) -> Tensor:
    """float32 logits / T with -inf outside each row's top-k / top-p set; per-row parameters broadcast over
    leading dims (temperature/top_p/top_k have the leading shape of logits without V). Greedy rows (T = 0) are
    scaled by 1.

    Top-k keeps the k largest logits; top-p keeps the smallest prefix of the sorted distribution whose mass
    reaches top_p (the token crossing the threshold is kept).
    """
    logits = logits.float()
    t = torch.where(temperature <= 0, torch.ones_like(temperature), temperature).float()
    scaled = logits / t[..., None]
    if bool(((top_k > 0) | (top_p < 1.0)).any()):
        sorted_logits, order = scaled.sort(dim=-1, descending=True)
        v = logits.shape[-1]
        rank = torch.arange(v, device=logits.device)
        keep = torch.ones_like(sorted_logits, dtype=torch.bool)
        k = torch.where(top_k > 0, top_k, torch.full_like(top_k, v))
        keep &= rank < k[..., None]
        sp = torch.softmax(sorted_logits.masked_fill(~keep, float("-inf")), dim=-1)
        before = sp.cumsum(-1) - sp  # mass strictly before each token
        keep &= before < top_p[..., None].float()
        masked_sorted = sorted_logits.masked_fill(~keep, float("-inf"))
        scaled = torch.full_like(scaled, float("-inf")).scatter(-1, order, masked_sorted)
    return scaled


def probs_from_scaled(logits: Tensor, scaled: Tensor, temperature: Tensor) -> Tensor:
    """The sampling distribution (float32) from `scaled_logits`; greedy rows (T = 0) are one-hot argmax."""
    probs = torch.softmax(scaled, dim=-1)
    greedy = temperature <= 0
    if bool(greedy.any()):
        onehot = torch.zeros_like(probs).scatter(-1, logits.argmax(-1, keepdim=True), 1.0)
        probs = torch.where(greedy[..., None], onehot, probs)
    return probs


def probs_from_logits(logits: Tensor, temperature: Tensor, top_p: Tensor, top_k: Tensor) -> Tensor:
    """Processed probabilities (float32) [..., V]: temperature, top-k and top-p applied; T = 0 is one-hot."""
    return probs_from_scaled(logits, scaled_logits(logits, temperature, top_p, top_k), temperature)


def sample_inverse_cdf(probs: Tensor, u: Tensor) -> Tensor:
    """Token index with P = probs, via inverse CDF with the given uniforms u (shape = probs.shape[:-1])."""
    cdf = probs.double().cumsum(-1)
    total = cdf[..., -1:]
    idx = torch.searchsorted(cdf, (u[..., None] * total).contiguous(), right=True).squeeze(-1)
    idx = idx.clamp_max(probs.shape[-1] - 1)
    # never land on a zero-probability token (possible only through float rounding at the tail)
    bad = probs.gather(-1, idx[..., None]).squeeze(-1) <= 0
    if bool(bad.any()):
        idx = torch.where(bad, probs.argmax(-1), idx)
    return idx


def behaviour_logprobs(logits: Tensor, scaled: Tensor, tokens: Tensor, temperature: Tensor) -> Tensor:
    """The behaviour log-probability of each emitted token: log of its probability under the distribution it
    was sampled from (`scaled` = `scaled_logits(...)`: after temperature, top-k and top-p). For a greedy row
    (T = 0, nothing was sampled) it is the log-probability under the unprocessed distribution (T = 1, no
    filtering), since the one-hot it was "sampled" from carries no information. With top_p = 1 and top_k = 0
    this equals log_softmax(logits / T)[token], the trainer's recomputation."""
    greedy = temperature <= 0
    raw = torch.log_softmax(logits.float(), dim=-1).gather(-1, tokens[..., None]).squeeze(-1) \
        if bool(greedy.any()) else None
    if raw is not None and bool(greedy.all()):  # only the raw log-probs are needed
        return raw
    lp = torch.log_softmax(scaled, dim=-1).gather(-1, tokens[..., None]).squeeze(-1)
    return lp if raw is None else torch.where(greedy, raw, lp)

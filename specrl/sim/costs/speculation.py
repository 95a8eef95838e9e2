"""Speculative decoding in the simulator: acceptance models, drafter costs and the per-step time.

`Acceptance` turns either an acceptance length AL at a given k (solved into a geometric per-position rate α,
so AL(k) = (1-α^(k+1))/(1-α)) or explicit per-position conditional rates a1..am into AL(k) for any k the
data covers. `StepModel` prices one decode step of an engine holding B sequences that together cache K tokens:
autoregressive (one target forward over B tokens) or speculative with draft length k (k drafter forwards over
B tokens, then one verify forward over B·(k+1) tokens), and the `auto` policy that picks, per step, the k (or
plain decoding) with the most emitted tokens per second — what the engine's adaptive mode does.
"""

from __future__ import annotations

from dataclasses import dataclass

from specrl.errors import SpecRLError
from specrl.sim.costs.roofline import ForwardCost

DRAFTERS = ("none", "eagle3", "mtp", "draft-model", "ngram")
AUTO_K_MAX = 8


@dataclass(frozen=True)
class Acceptance:
    """Per-position conditional acceptance rates; `rates[i]` = P(draft i+1 accepted | drafts 1..i accepted)."""

    rates: tuple[float, ...]
    geometric: bool = False  # True when built from an AL: rates extend to any k with the same α

    @classmethod
    def from_length(cls, al: float, k: int) -> Acceptance:
        if k < 1:
            raise SpecRLError(f"draft length k={k} must be >= 1 with a drafter")
        if not 1.0 <= al <= k + 1:
            raise SpecRLError(f"acceptance length {al} is outside [1, k+1] = [1, {k + 1}] for k={k}")
        lo, hi = 0.0, 1.0
        for _ in range(60):  # AL(α) is increasing in α
            mid = (lo + hi) / 2
            if sum(mid**i for i in range(k + 1)) < al:
                lo = mid
            else:
                hi = mid
        return cls(rates=((lo + hi) / 2,), geometric=True)

    @classmethod
    def from_rates(cls, rates: list[float] | tuple[float, ...]) -> Acceptance:
        if not rates:
            raise SpecRLError("--acceptance-rates needs at least one rate, e.g. 0.8,0.7,0.6")
        bad = [r for r in rates if not 0.0 <= r <= 1.0]
        if bad:
            raise SpecRLError(f"acceptance rates must lie in [0, 1]; got {bad} in {list(rates)}")
        return cls(rates=tuple(float(r) for r in rates))

    @property
    def max_k(self) -> int:
        return AUTO_K_MAX if self.geometric else len(self.rates)

    def rate(self, i: int) -> float:
        return self.rates[0] if self.geometric else self.rates[i]

    def length(self, k: int) -> float:
        """Expected tokens emitted per verify step (1 bonus/correction token + accepted drafts)."""
        if not self.geometric and k > self.max_k:
            raise SpecRLError(f"k={k} exceeds the {len(self.rates)} per-position acceptance rates given; "
                              f"pass k <= {len(self.rates)} or more rates")
        al, p = 1.0, 1.0
        for i in range(k):
            p *= self.rate(i)
            al += p
        return al


class StepModel:
    """Decode-step time for B sequences caching K tokens, AR or speculative with k drafts."""

    def __init__(self, target: ForwardCost, drafter: str, draft: ForwardCost | None,
                 acceptance: Acceptance | None, k: int | str, ngram_overhead_s: float,
                 seq_overhead_s: float = 0.0, decode_seq_overhead_s: float = 0.0) -> None:
        if drafter not in DRAFTERS:
            raise SpecRLError(f"unknown drafter {drafter!r}; valid: {', '.join(DRAFTERS)}")
        self.target, self.drafter, self.draft = target, drafter, draft
        self.acceptance, self.k = acceptance, k
        self.ngram_overhead_s = ngram_overhead_s
        self.seq_overhead_s = seq_overhead_s  # host work per sequence per speculative step (any drafter)
        self.decode_seq_overhead_s = decode_seq_overhead_s  # host work per sequence per decode step (AR or verify)
        self.speculative = drafter != "none"
        if self.speculative:
            if acceptance is None:
                raise SpecRLError(f"drafter {drafter!r} needs --acceptance-length or --acceptance-rates")
            if k != "auto":
                if not isinstance(k, int) or k < 1:
                    raise SpecRLError(f"draft length k={k!r} must be an integer >= 1 (or 'auto') with "
                                      f"drafter {drafter!r}")
                acceptance.length(k)  # validates k against the rates given
        self._al = {kk: acceptance.length(kk) for kk in range(1, acceptance.max_k + 1)} if acceptance else {}
        if acceptance and k != "auto":
            self._al[int(k)] = acceptance.length(int(k))

    @property
    def max_growth(self) -> int:
        """Most tokens one sequence can add to the KV cache in one step."""
        if not self.speculative:
            return 1
        return 1 + (max(self._al) if self.k == "auto" else int(self.k))

    def ar_seconds(self, b: float, kv: float) -> float:
        return self.target(b, kv) + b * self.decode_seq_overhead_s

    def draft_seconds(self, b: float, kv: float, k: int) -> float:
        host = b * self.seq_overhead_s
        if self.drafter == "ngram":
            return self.ngram_overhead_s + host
        assert self.draft is not None
        return k * self.draft(b, kv) + host

    def spec_seconds(self, b: float, kv: float, k: int) -> float:
        verify = self.target(b * (k + 1), kv, attn_pairs=(k + 1) * kv) + b * self.decode_seq_overhead_s
        return self.draft_seconds(b, kv, k) + verify

    def draft_cost_ratio(self, b: float, kv: float) -> float:
        """c: drafter time per proposed token relative to one target forward at this batch."""
        return self.draft_seconds(b, kv, 1) / self.ar_seconds(b, kv)

    def choose(self, b: float, kv: float) -> tuple[int, float, float]:
        """(k, tokens emitted per sequence per step, step seconds) for the configured policy."""
        if not self.speculative:
            return 0, 1.0, self.ar_seconds(b, kv)
        if self.k != "auto":
            k = int(self.k)
            return k, self._al[k], self.spec_seconds(b, kv, k)
        best = (0, 1.0, self.ar_seconds(b, kv))
        for k, al in self._al.items():
            dt = self.spec_seconds(b, kv, k)
            if al / dt > best[1] / best[2]:
                best = (k, al, dt)
        return best

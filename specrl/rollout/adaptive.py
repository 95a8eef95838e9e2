"""Adaptive draft length: choose k in 0..k_max per engine step to maximise expected tokens per second.

The controller keeps three online measurements on the hardware it runs on:
* target forward seconds as a function of tokens in the forward (n sequences x (k+1) tokens), an EMA per
  token count, interpolated between measured counts (cost is flat below the roofline ridge and grows above);
* drafter seconds per drafted token for a batch of n (an EMA per batch-size bucket);
* per-position acceptance (conditional: accepted at i given accepted before i), with a mild prior.
Expected emitted tokens at k are 1 + sum_{i<=k} prod_{j<=i} a_j; throughput = n * E[k] / (t_target + t_draft).
With a fixed k the controller only returns that k. A k that has not been measured for this batch size is
tried once (exploration), so the choice rests on measurements, not assumptions.
"""

from __future__ import annotations

import bisect

from torch import Tensor


class DraftLengthController:
    def __init__(self, k_max: int, num_draft_tokens: int | str, ema: float = 0.3):
        self.k_max = k_max
        self.fixed = None if num_draft_tokens == "auto" else int(num_draft_tokens)
        self.ema = ema
        self.target: dict[int, float] = {}  # tokens in forward -> seconds
        self.draft: dict[int, float] = {}  # batch bucket -> seconds per drafted token per step
        self.att = [0.0] * k_max
        self.acc = [0.0] * k_max
        self.tried: set[tuple[int, int]] = set()  # (batch bucket, k)
        self.last_choice: int | None = None

    @staticmethod
    def _bucket(n: int) -> int:
        return 1 << max(0, (n - 1).bit_length())  # 1, 2, 4, 8, ...

    # ---------------------------------------------------------------- observations
    def _update(self, table: dict, key: int, value: float) -> None:
        old = table.get(key)
        table[key] = value if old is None else (1 - self.ema) * old + self.ema * value

    def observe_target(self, n: int, tokens_per_seq: int, ctx_len: int, seconds: float) -> None:
        self._update(self.target, n * tokens_per_seq, seconds)

    def observe_draft(self, n: int, k: int, seconds: float) -> None:
        if k > 0:
            self._update(self.draft, self._bucket(n), seconds / k)

    def observe_acceptance(self, num_accepted: Tensor, k: int) -> None:
        for i in range(k):
            reached = int((num_accepted >= i).sum())  # sequences that got to draft position i
            self.att[i] += reached
            self.acc[i] += int((num_accepted > i).sum())

    # ---------------------------------------------------------------- prediction
    def rates(self) -> list[float]:
        out, prev = [], 0.8
        for i in range(self.k_max):
            r = (self.acc[i] + 2 * prev) / (self.att[i] + 2)  # prior: the previous position's rate
            out.append(r)
            prev = r
        return out

    def expected_tokens(self, k: int, rates: list[float] | None = None) -> float:
        rates = rates or self.rates()
        e, run = 1.0, 1.0
        for i in range(k):
            run *= rates[i]
            e += run
        return e

    def target_seconds(self, tokens: int) -> float | None:
        if not self.target:
            return None
        keys = sorted(self.target)
        i = bisect.bisect_left(keys, tokens)
        if i < len(keys) and keys[i] == tokens:
            return self.target[tokens]
        if i == 0:
            return self.target[keys[0]]  # cost never decreases with more tokens: use the smallest known
        if i == len(keys):
            hi = keys[-1]
            return self.target[hi] * tokens / hi  # beyond the largest measured: assume compute-bound growth
        lo, hi = keys[i - 1], keys[i]
        w = (tokens - lo) / (hi - lo)
        return (1 - w) * self.target[lo] + w * self.target[hi]

    def predicted_throughput(self, n: int, k: int) -> float | None:
        t = self.target_seconds(n * (k + 1))
        if t is None:
            return None
        if k > 0:
            per_tok = self.draft.get(self._bucket(n))
            if per_tok is None:
                return None
            t += per_tok * k
        return n * self.expected_tokens(k) / t

    # ---------------------------------------------------------------- choice
    def choose(self, n: int, ctx_len: int) -> int:
        if self.fixed is not None:
            return self.fixed
        b = self._bucket(n)
        for k in (1, 0, self.k_max, 3, 2, 5, 4, 7, 6):  # explore each k once per batch-size bucket
            if k <= self.k_max and (b, k) not in self.tried:
                self.tried.add((b, k))
                self.last_choice = k
                return k
        best_k, best = 0, -1.0
        for k in range(self.k_max + 1):
            thr = self.predicted_throughput(n, k)
            if thr is not None and thr > best:
                best_k, best = k, thr
        self.last_choice = best_k
        return best_k

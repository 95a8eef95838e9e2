"""Adaptive draft length: choose k in 0..k_max per engine step to maximise measured tokens per second.

The quantity that matters is realised throughput, folding in the hardware's real cost of a B·(k+1)-token forward,
the drafter's cost and the acceptance at once. Raw tokens/s cannot be compared across steps, because it depends on
how many sequences are still running (a plain step over 32 sequences emits far more per second than one over 17,
both in the same batch-size bucket). So every speculative step is scored against plain decoding at the same batch
size, in two low-noise parts: its *cost* c(b, k) = (draft + verify seconds) / t_ar(n), where t_ar(n) = a + b·n is
a least-squares line through recent plain steps of that batch-size bucket (exponentially forgotten, so it follows the
machine; see `ar_seconds`), kept as an
EMA per (batch-size bucket, k); and its *yield* E[tokens | k] = 1 + Σ_j Π_{i<j} r_i from the per-position
acceptance rates r_i measured over all speculative steps (also forgotten slowly). The gain of k is yield / cost;
plain decoding has gain 1. (Scoring each step by its own emitted tokens, as before, made the choice at small batch
a coin flip: one sequence emits 1 or k+1 tokens per step.) The controller hill-climbs over k on these gains: a new
bucket takes one plain step (a baseline for t_ar at that size) and then starts from the best k of the nearest
measured bucket (k=1 at first); it measures both neighbours of its best, and every `recheck` steps re-measures a
neighbour so a drifting cost or acceptance moves the choice (where k=0 is best, probes of k=1 back off to every
8·`recheck` steps: a probe costs more than one step, since a stateful drafter first catches up on the tokens of the
plain steps before it, and that catch-up is not charged to k, because in steady speculation it does not recur). With
a fixed k the controller only returns that k.
"""

from __future__ import annotations

from torch import Tensor


class DraftLengthController:
    def __init__(self, k_max: int, num_draft_tokens: int | str, ema: float = 0.3, recheck: int = 8,
                 forget: float = 0.97, margin: float = 0.10):
        self.k_max = k_max
        self.fixed = None if num_draft_tokens == "auto" else int(num_draft_tokens)
        self.ema = ema
        self.recheck = recheck
        self.forget = forget
        self.margin = margin  # speculate only where the estimated gain beats plain decoding by this much. Gains
        # are estimated within ~7 % (EAGLE at B=16, per bucket: estimated 0.84 / 1.02 / 0.99 vs measured 0.85 /
        # 0.95 / 1.08 at 16 / 8 / 4), and a choice that flips around the threshold pays switching costs (drafter
        # catch-up) both ways. At B=16 (EAGLE, decode-only) auto measured 0.87-0.92x with a 5 % margin in four
        # runs and 0.99x / 0.87x in two runs with 10 %: run-to-run noise is as large as the effect
        self.cost: dict[tuple[int, int], float] = {}  # (bucket, k) -> EMA of step seconds / t_ar(n); k=0: 1
        self.steps: dict[int, int] = {}  # bucket -> steps taken
        self._fit = [0.0] * 5  # decayed sums for t_ar(n) = a + b n: w, w n, w n^2, w t, w n t
        self._fits: dict[int, list[float]] = {}  # the same sums per batch-size bucket (key: it has a baseline)
        self.acc = [0.0] * k_max
        self.att = [0.0] * k_max
        self._draft_s = 0.0
        self._due: dict[int, int] = {}  # bucket -> step of its next recheck
        self._quiet: dict[int, int] = {}  # bucket -> rechecks in a row that confirmed k=0
        self._up: dict[int, bool] = {}  # bucket -> direction of its last recheck
        self.last_choice: int | None = None

    @staticmethod
    def _bucket(n: int) -> int:
        return 1 << max(0, (n - 1).bit_length())  # 1, 2, 4, 8, ...

    @staticmethod
    def _line(sums: list[float], n: float) -> float | None:
        """Least-squares line through decayed sums at n; None if there are no points or only one batch size."""
        w, sn, snn, st, snt = sums
        det = w * snn - sn * sn
        if w <= 0 or det <= 1e-9 * max(1.0, w * snn):
            return None
        b = (w * snt - sn * st) / det
        return (st - b * sn) / w + b * n

    def ar_seconds(self, n: int) -> float | None:
        """Predicted plain-step seconds at n sequences (None before any plain step).

        A line through all recent plain steps has the right shape but misses the level where the cost curve bends
        (on a CPU, t(n) is flat while memory-bound and then steepens: the chord over-estimates the middle by 5-8 %,
        which made marginal speculation look like a win). So within a batch-size bucket the prediction comes from
        that bucket's own plain steps: a line through them, or the global line moved through their mean."""
        w, sn, _, st, _ = self._fit
        if w <= 0:
            return None
        glob = self._line(self._fit, n)
        if glob is None or glob <= 0:
            glob = st / w
        local = self._fits.get(self._bucket(n))
        if local is None or local[0] <= 0:
            return glob
        t = self._line(local, n)
        if t is not None and t > 0:
            return t
        mean_n, mean_t = local[1] / local[0], local[3] / local[0]
        at_mean = self._line(self._fit, mean_n)
        return glob * mean_t / at_mean if at_mean and at_mean > 0 else mean_t

    # ---------------------------------------------------------------- observations
    def observe_draft(self, n: int, k: int, seconds: float) -> None:
        self._draft_s += seconds

    def observe_target(self, n: int, tokens_per_seq: int, ctx_len: int, seconds: float,
                       emitted: int | None = None) -> None:
        """One engine step finished: n sequences, `emitted` tokens (n for a plain step) in verify seconds."""
        k = tokens_per_seq - 1
        total = seconds + self._draft_s
        self._draft_s = 0.0
        if self.fixed is not None or total <= 0 or n <= 0:
            return
        bucket = self._bucket(n)
        if k == 0:
            f = self.forget
            point = (1.0, n, n * n, total, n * total)
            self._fit = [f * x + y for x, y in zip(self._fit, point, strict=True)]
            for bb, sums in self._fits.items():
                self._fits[bb] = [f * x for x in sums]
            self._fits[bucket] = [x + y for x, y in zip(self._fits.get(bucket, [0.0] * 5), point, strict=True)]
            self.cost[(bucket, 0)] = 1.0
            return
        t_ar = self.ar_seconds(n)
        if t_ar is None:
            return
        value = total / t_ar
        old = self.cost.get((bucket, k))
        self.cost[(bucket, k)] = value if old is None else (1 - self.ema) * old + self.ema * value

    def observe_acceptance(self, num_accepted: Tensor, k: int) -> None:
        f = self.forget
        for i in range(self.k_max):  # forget old evidence a little at every speculative step
            self.att[i] *= f
            self.acc[i] *= f
        for i in range(k):
            self.att[i] += int((num_accepted >= i).sum())
            self.acc[i] += int((num_accepted > i).sum())

    def rates(self) -> list[float]:
        """Conditional per-position acceptance measured so far (for reporting)."""
        return [a / t if t else 0.0 for a, t in zip(self.acc, self.att, strict=True)]

    def expected_tokens(self, k: int) -> float:
        """Tokens one sequence emits in a step with k drafts: 1 + sum_j prod_{i<j} r_i (unmeasured positions
        take the rate of the last measured one; 0.5 before any measurement)."""
        total, p, r = 1.0, 1.0, 0.5
        for i in range(k):
            if self.att[i] > 0:
                r = self.acc[i] / self.att[i]
            p *= r
            total += p
        return total

    def gain(self, bucket: int, k: int) -> float | None:
        """Estimated speedup of k drafts over plain decoding at this batch-size bucket (None: cost not measured)."""
        c = self.cost.get((bucket, k))
        return None if c is None else self.expected_tokens(k) / c

    # ---------------------------------------------------------------- choice
    def _gains(self, bucket: int) -> dict[int, float]:
        g = {k: self.gain(b, k) for (b, k) in self.cost if b == bucket}
        if 0 in g:
            g[0] = 1.0 + self.margin
        return g

    def _best(self, bucket: int) -> int | None:
        tried = self._gains(bucket)
        return max(tried, key=tried.get) if tried else None

    def choose(self, n: int, ctx_len: int) -> int:
        if self.fixed is not None:
            return self.fixed
        b = self._bucket(n)
        step = self.steps[b] = self.steps.get(b, 0) + 1
        k = self._choose(b, step)
        self.last_choice = k
        return k

    def _choose(self, b: int, step: int) -> int:
        if b not in self._fits:  # one plain step: the baseline every gain in this bucket is measured against
            return 0
        tried = {k for (bb, k) in self.cost if bb == b and k > 0}
        if not tried:  # start from the best k of the nearest bucket with speculative measurements (or k=1)
            others = {bb for bb, k in self.cost if k > 0}
            if not others:
                return min(1, self.k_max)
            near = min(others, key=lambda bb: abs(bb.bit_length() - b.bit_length()))
            return min(max(1, self._best(near)), self.k_max)  # where the nearest switched off, retry k=1 once
        best = self._best(b)
        for nb in (best - 1, best + 1):  # measure both neighbours of the best before settling
            if 1 <= nb <= self.k_max and (b, nb) not in self.cost:
                return nb
        if step >= self._due.get(b, self.recheck):  # re-measure a neighbour so the choice can move
            if best == 0:  # switched off: each probe that confirms it waits twice as long (up to 8 x recheck), as
                # a probe also makes stateful drafters catch up on every token since the last one
                quiet = self._quiet[b] = self._quiet.get(b, 0) + 1
                self._due[b] = step + self.recheck * 2 ** min(quiet, 3)
                return min(1, self.k_max)
            self._quiet[b] = 0
            self._due[b] = step + self.recheck
            up = self._up[b] = not self._up.get(b, False)
            return min(best + 1, self.k_max) if up else best - 1
        return best

"""Adaptive draft length: choose k in 0..k_max per engine step to maximise measured tokens per second.

The quantity that matters is realised throughput, folding in the hardware's real cost of a B·(k+1)-token forward,
the drafter's cost and the acceptance at once. Raw tokens/s cannot be compared across steps, because it depends on
how many sequences are still running (a plain step over 32 sequences emits far more per second than one over 17,
both in the same batch-size bucket). So every speculative step is scored against plain decoding at the same batch
size, in two low-noise parts: its *cost* c(b, k) = (draft + verify seconds) / t_ar(n), where t_ar(n) = a + b·n is
a least-squares line through recent plain steps of that batch-size bucket (exponentially forgotten, so it follows
the machine; see `ar_seconds`); and its *yield* E[tokens | k] = 1 + Σ_j Π_{i<j} r_i from the per-position
acceptance rates r_i measured over all speculative steps (also forgotten slowly). The gain of k is yield / cost;
plain decoding has gain 1. (A step's own emitted tokens are no score at small batch: one sequence emits 1 or k+1.)

The cost is a model, not a table: per batch-size bucket, c(b, k) = α + β·k (the verify forward's rows grow with k,
and so does the drafter's work), a least-squares line through every speculative step of that bucket at whatever k
it ran, plus the point (k = 0, c = 1) at a small fixed weight (a step with no draft costs a plain step), so one
measured k already predicts them all. Each step the controller takes the k of the highest predicted gain (looking
at most two past the largest k measured in the bucket, so a far extrapolation is measured before it is trusted),
and every `recheck` steps a neighbour of it, so the slope stays measured on both sides. A new bucket's first step is
a warm-up (on a GPU it compiles and allocates) and is not timed; it then takes one plain step (a baseline for t_ar at
that size) and then the best k its nearest measured bucket predicts (k = 1 at first). Plain steps are timed per
batch-size bucket *and* context-length bucket (powers of two of the longest sequence's length, the `ctx_len` every
step reports): a step at a context length with no plain timing at that batch size first takes one, so a cost ratio
is never taken against a plain step at another context length. While speculation wins, plain decoding is re-timed
every `retime` steps of the bucket (`RETIME_STEPS`), so the baseline follows a machine whose plain step gets
cheaper or dearer over a run (a warm-up ending, another job starting or stopping).
Where k = 0 is best, probes of k = 1 back off to every 8·`recheck` steps (`MAX_PROBE_DOUBLINGS`): a probe costs
more than one step, since a stateful drafter first catches up on the tokens of the plain steps before it, and that
catch-up is not charged to k, because in steady speculation it does not recur. With a fixed k the controller only
returns that k.
"""

from __future__ import annotations

from torch import Tensor

RECHECK_STEPS = 8  # steps between re-measurements of a neighbour of the best k
RETIME_STEPS = 32  # while speculating, a bucket times a plain step again after this many of its steps without one
WARMUP_STEPS = 1  # a bucket's first steps (compilation, allocation on a GPU) are not timed
FORGET = 0.97  # per-step decay of old plain-step timings and acceptance counts, so the estimates follow the machine
# Speculate only where the estimated gain beats plain decoding by this much: gain estimates are good to several
# percent, and a choice that flips around the threshold pays drafter catch-up both ways.
MARGIN = 0.10
PRIOR_ACCEPTANCE = 0.5  # per-position acceptance rate assumed before any measurement
MAX_PROBE_DOUBLINGS = 3  # while k=0 wins, the k=1 probe interval doubles up to 2**3 = 8 x `recheck`
ANCHOR_WEIGHT = 1.0  # weight of the point (k = 0, cost 1) in each bucket's cost line (real steps reach ~1/(1-FORGET))
LOOKAHEAD = 2  # the choice looks at most this far past the largest k measured in a bucket
_FIT_SUMS = 5  # decayed sums of the t_ar(n) = a + b n fit: w, w n, w n^2, w t, w n t
_SINGULAR = 1e-9  # relative determinant below which the fit points span only one batch size


class DraftLengthController:
    def __init__(self, k_max: int, num_draft_tokens: int | str, recheck: int = RECHECK_STEPS,
                 forget: float = FORGET, margin: float = MARGIN, retime: int = RETIME_STEPS,
                 warmup: int = WARMUP_STEPS):
        self.k_max = k_max
        self.fixed = None if num_draft_tokens == "auto" else int(num_draft_tokens)
        self.recheck = recheck
        self.retime = retime  # see RETIME_STEPS
        self.warmup = warmup  # see WARMUP_STEPS
        self._seen: dict[int, int] = {}  # bucket -> steps observed there (the first `warmup` are not timed)
        self._plain_at: dict[int, int] = {}  # bucket -> its step count at its newest timed plain step
        self.forget = forget
        self.margin = margin  # see MARGIN
        self._ratio: dict[int, list[float]] = {}  # bucket -> decayed sums over (k, step seconds / t_ar(n))
        self._k_seen: dict[int, int] = {}  # bucket -> largest k measured there
        self.steps: dict[int, int] = {}  # bucket -> steps taken
        self._fit = [0.0] * _FIT_SUMS  # decayed sums for t_ar(n) = a + b n: w, w n, w n^2, w t, w n t
        self._fits: dict[tuple[int, int], list[float]] = {}  # the same sums per (batch-size, context) bucket
        self.acc = [0.0] * k_max
        self.att = [0.0] * k_max
        self._draft_s = 0.0
        self._due: dict[int, int] = {}  # bucket -> step of its next recheck
        self._quiet: dict[int, int] = {}  # bucket -> rechecks in a row that confirmed k=0
        self._up: dict[int, bool] = {}  # bucket -> direction of its last recheck

    @staticmethod
    def _bucket(n: int) -> int:
        return 1 << max(0, (n - 1).bit_length())  # 1, 2, 4, 8, ...

    @staticmethod
    def _line(sums: list[float], n: float) -> float | None:
        """Least-squares line through decayed sums at n; None if there are no points or only one batch size."""
        w, sn, snn, st, snt = sums
        det = w * snn - sn * sn
        if w <= 0 or det <= _SINGULAR * max(1.0, w * snn):
            return None
        b = (w * snt - sn * st) / det
        return (st - b * sn) / w + b * n

    def _local(self, bucket: int, ctx_len: int | None) -> list[float] | None:
        """The plain-step sums of this batch-size bucket at the context bucket of `ctx_len` (None: its best
        measured one), else at its nearest measured context bucket."""
        mine = [(cb, sums) for (b, cb), sums in self._fits.items() if b == bucket and sums[0] > 0]
        if not mine:
            return None
        if ctx_len is None:
            return max(mine, key=lambda x: x[1][0])[1]
        want = self._bucket(max(1, ctx_len)).bit_length()
        return min(mine, key=lambda x: (abs(x[0].bit_length() - want), -x[0]))[1]

    def ar_seconds(self, n: int, ctx_len: int | None = None) -> float | None:
        """Predicted plain-step seconds at n sequences and context length `ctx_len` (None before any plain step).

        A line through all recent plain steps misses the level where the cost curve bends (t(n) is flat while
        memory-bound and then steepens), which makes marginal speculation look like a win. So within a batch-size
        bucket the prediction comes from that bucket's own plain steps at the same context bucket (else the
        nearest measured one): a line through them, or the global line moved through their mean."""
        w, sn, _, st, _ = self._fit
        if w <= 0:
            return None
        glob = self._line(self._fit, n)
        if glob is None or glob <= 0:
            glob = st / w
        local = self._local(self._bucket(n), ctx_len)
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
        if self.fixed is not None or n <= 0:
            return
        bucket = self._bucket(n)
        seen = self._seen[bucket] = self._seen.get(bucket, 0) + 1
        if seen <= self.warmup or total <= 0:  # a warm-up step times compilation and allocation, not decoding
            return
        f = self.forget  # plain timings age with every step, plain or not: rare re-timings then dominate
        self._fit = [f * x for x in self._fit]
        for bb, sums in self._fits.items():
            self._fits[bb] = [f * x for x in sums]
        if k == 0:
            point = (1.0, n, n * n, total, n * total)
            self._fit = [x + y for x, y in zip(self._fit, point, strict=True)]
            key = (bucket, self._bucket(max(1, ctx_len)))
            self._fits[key] = [x + y for x, y in zip(self._fits.get(key, [0.0] * _FIT_SUMS), point, strict=True)]
            self._plain_at[bucket] = self.steps.get(bucket, 0)
            if bucket in self._ratio:  # the cost line forgets per step of its bucket, plain or not
                self._ratio[bucket] = [f * x for x in self._ratio[bucket]]
            return
        t_ar = self.ar_seconds(n, ctx_len)
        if t_ar is None:
            return
        y = total / t_ar
        old = self._ratio.get(bucket, [0.0] * _FIT_SUMS)
        self._ratio[bucket] = [self.forget * x + p for x, p in zip(old, (1.0, k, k * k, y, k * y), strict=True)]
        self._k_seen[bucket] = max(k, self._k_seen.get(bucket, 0))

    def observe_acceptance(self, num_accepted: Tensor, k: int) -> None:
        """Per-position acceptance of one step with k asked drafts: a row reaching position i counts as an attempt
        there even where a ragged proposal had no real draft (what choosing k yields, which the gain estimates)."""
        f = self.forget
        for i in range(self.k_max):  # forget old evidence a little at every speculative step
            self.att[i] *= f
            self.acc[i] *= f
        for i in range(k):
            self.att[i] += int((num_accepted >= i).sum())
            self.acc[i] += int((num_accepted > i).sum())

    def expected_tokens(self, k: int) -> float:
        """Tokens one sequence emits in a step with k drafts: 1 + sum_j prod_{i<j} r_i (unmeasured positions
        take the rate of the last measured one; PRIOR_ACCEPTANCE before any measurement)."""
        total, p, r = 1.0, 1.0, PRIOR_ACCEPTANCE
        for i in range(k):
            if self.att[i] > 0:
                r = self.acc[i] / self.att[i]
            p *= r
            total += p
        return total

    def cost(self, bucket: int, k: int) -> float | None:
        """Predicted (draft + verify seconds) / t_ar of a step with k drafts in this bucket: the bucket's cost line
        (None before any speculative step there)."""
        sums = self._ratio.get(bucket)
        if sums is None:
            return None
        w, sk, skk, sy, sky = sums
        return self._line([w + ANCHOR_WEIGHT, sk, skk, sy + ANCHOR_WEIGHT, sky], k)

    def gain(self, bucket: int, k: int) -> float | None:
        """Predicted speedup of k drafts over plain decoding at this batch-size bucket (None: no cost measured)."""
        c = self.cost(bucket, k)
        return None if c is None or c <= 0 else self.expected_tokens(k) / c

    # ---------------------------------------------------------------- choice
    def _gains(self, bucket: int) -> dict[int, float]:
        """Predicted gain of every k the choice may take in this bucket; k = 0 counts 1 + margin ({}: unmeasured)."""
        if bucket not in self._ratio:
            return {}
        top = min(self.k_max, self._k_seen[bucket] + LOOKAHEAD)
        g = {k: self.gain(bucket, k) for k in range(1, top + 1)}
        return {0: 1.0 + self.margin, **{k: v for k, v in g.items() if v is not None}}

    def _best(self, bucket: int) -> int | None:
        tried = self._gains(bucket)
        return max(tried, key=tried.get) if tried else None

    def choose(self, n: int, ctx_len: int) -> int:
        if self.fixed is not None:
            return self.fixed
        b = self._bucket(n)
        step = self.steps[b] = self.steps.get(b, 0) + 1
        return self._choose(b, step, self._bucket(max(1, ctx_len)))

    def _choose(self, b: int, step: int, ctx_bucket: int = 1) -> int:
        if (b, ctx_bucket) not in self._fits:  # a plain step: the baseline every gain here is measured against
            return 0  # (after the bucket's warm-up step, which is not timed)
        if b in self._ratio:
            best = self._best(b)
        else:  # no speculative step here yet: what the nearest measured bucket predicts (k = 1 at first)
            if not self._ratio:
                return min(1, self.k_max)
            near = min(self._ratio, key=lambda bb: abs(bb.bit_length() - b.bit_length()))
            best = self._best(near)
        if best and step - self._plain_at.get(b, 0) > self.retime:  # re-time plain decoding: the machine drifts
            return 0
        if step >= self._due.get(b, self.recheck):  # re-measure a neighbour so the choice can move
            if best == 0:  # switched off: each confirming probe doubles the wait, as a probe is costly (catch-up)
                quiet = self._quiet[b] = self._quiet.get(b, 0) + 1
                self._due[b] = step + self.recheck * 2 ** min(quiet, MAX_PROBE_DOUBLINGS)
                return min(1, self.k_max)
            self._quiet[b] = 0
            self._due[b] = step + self.recheck
            up = self._up[b] = not self._up.get(b, False)
            return min(best + 1, self.k_max) if up else best - 1
        return best

"""Adaptive draft length: choose k in 0..k_max per engine step to maximise measured tokens per second.

The quantity that matters is realised throughput: tokens emitted per second of (draft + verify) time, which
folds in the hardware's real cost of a B·(k+1)-token forward, the drafter's cost and the acceptance at once.
The controller keeps an EMA of it per (batch-size bucket, k), measured online on the hardware it runs on, and
hill-climbs over k: every bucket first measures k=0 (plain decoding) and k=1, then tries k+1 while that keeps
improving; every `recheck` steps it re-measures a neighbour of the current best so a drifting cost or
acceptance moves the choice. Until a bucket has its own measurements it starts from the choice of the nearest
measured bucket. With a fixed k the controller only returns that k.
"""

from __future__ import annotations

from torch import Tensor


class DraftLengthController:
    def __init__(self, k_max: int, num_draft_tokens: int | str, ema: float = 0.3, recheck: int = 8):
        self.k_max = k_max
        self.fixed = None if num_draft_tokens == "auto" else int(num_draft_tokens)
        self.ema = ema
        self.recheck = recheck
        self.tput: dict[tuple[int, int], float] = {}  # (bucket, k) -> tokens/s EMA
        self.steps: dict[int, int] = {}  # bucket -> steps taken
        self.acc = [0.0] * k_max
        self.att = [0.0] * k_max
        self._pending: tuple[int, int] | None = None  # (bucket, k) of the step being measured
        self._draft_s = 0.0
        self.last_choice: int | None = None

    @staticmethod
    def _bucket(n: int) -> int:
        return 1 << max(0, (n - 1).bit_length())  # 1, 2, 4, 8, ...

    # ---------------------------------------------------------------- observations
    def observe_draft(self, n: int, k: int, seconds: float) -> None:
        self._draft_s += seconds

    def observe_target(self, n: int, tokens_per_seq: int, ctx_len: int, seconds: float,
                       emitted: int | None = None) -> None:
        """One engine step finished: n sequences, `emitted` tokens (n for a plain step) in verify seconds."""
        key = (self._bucket(n), tokens_per_seq - 1)
        total = seconds + self._draft_s
        self._draft_s = 0.0
        if self.fixed is not None or total <= 0:
            return
        value = (n if emitted is None else emitted) / total
        old = self.tput.get(key)
        self.tput[key] = value if old is None else (1 - self.ema) * old + self.ema * value

    def observe_acceptance(self, num_accepted: Tensor, k: int) -> None:
        for i in range(k):
            self.att[i] += int((num_accepted >= i).sum())
            self.acc[i] += int((num_accepted > i).sum())

    def rates(self) -> list[float]:
        """Conditional per-position acceptance measured so far (for reporting)."""
        return [a / t if t else 0.0 for a, t in zip(self.acc, self.att, strict=True)]

    # ---------------------------------------------------------------- choice
    def _best(self, bucket: int) -> int | None:
        tried = {k: v for (b, k), v in self.tput.items() if b == bucket}
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
        tried = {k: v for (bb, k), v in self.tput.items() if bb == b}
        if not tried:  # a new batch size: start from the best k of the nearest measured bucket (or k=1)
            others = {bb for bb, _ in self.tput}
            if not others:
                return min(1, self.k_max)
            near = min(others, key=lambda bb: abs(bb.bit_length() - b.bit_length()))
            return self._best(near)
        best = max(tried, key=tried.get)
        for nb in (best - 1, best + 1):  # measure both neighbours of the best before settling
            if 0 <= nb <= self.k_max and nb not in tried:
                return nb
        if step % self.recheck == 0:  # re-measure a neighbour so the choice can move
            up = (step // self.recheck) % 2 == 1
            return min(best + 1, self.k_max) if up else max(best - 1, 0)
        return best

"""Per-sequence draft budgets: how many of the step's k drafts each row of the batch keeps.

`SequenceDraftBudget` owns one acceptance estimate per engine slot, built only from that sequence's own past
speculative steps: decayed counts of accepted drafts and of drafts that were tested (a row with d drafts that
accepted m tested min(m + 1, d) of them), so acc / tested estimates the per-position acceptance rate r. The state
is reset when a sequence enters a slot (a prior of PRIOR_RATE worth PRIOR_WEIGHT tested drafts) and moves with
the sequence when the engine compacts its slots. The rule: row i keeps k_i = the largest j <= k with r_i^j >=
`threshold` (r^j estimates the probability that all j drafts are accepted, i.e. the expected tokens the j-th draft
adds); a row with k_i = 0 learns nothing new, so after `probe_every` steps in a row at 0 it drafts one token
(a re-probe). Exactness: the budgets are a function of earlier steps' outcomes only (accepted counts, which
depend on uniforms at positions before the current one), never of this step's drafted tokens or this step's
uniforms, which are keyed to positions no earlier step decided on. So, conditioned on the past, row i's step is a
plain speculative step with its own fixed k_i: rejection sampling keeps p exactly, and seed_exact emits the
policy's own tokens whatever k_i is. The engine applies the budgets by marking drafts past k_i as not drafted
(`Proposal.num_drafts`) and by asking the drafter for max_i k_i drafts only.
"""

from __future__ import annotations

import torch
from torch import Tensor

from specrl.errors import SpecRLError

THRESHOLD = 0.3  # keep the j-th draft while the estimated P(first j drafts all accepted) >= this
PRIOR_RATE = 0.8  # per-position acceptance rate assumed for a sequence that has not drafted yet
PRIOR_WEIGHT = 2.0  # ... worth this many tested drafts
FORGET = 0.8  # per own speculative step: decay of a row's older counts, so the estimate follows the sequence
PROBE_EVERY = 4  # a row at k_i = 0 drafts one token after this many steps in a row at 0


class SequenceDraftBudget:
    """Per-slot acceptance estimates and the draft budgets derived from them (see the module docstring)."""

    def __init__(self, num_slots: int, threshold: float = THRESHOLD, forget: float = FORGET,
                 probe_every: int = PROBE_EVERY, prior_rate: float = PRIOR_RATE, prior_weight: float = PRIOR_WEIGHT):
        if not isinstance(num_slots, int) or num_slots < 1:
            raise SpecRLError(f"per-sequence draft budget: num_slots must be an integer >= 1, got {num_slots!r}")
        for name, v in (("threshold", threshold), ("prior_rate", prior_rate)):
            if isinstance(v, bool) or not isinstance(v, int | float) or not 0.0 < v < 1.0:
                raise SpecRLError(f"per-sequence draft budget: {name} must be a number in (0, 1), got {v!r}")
        if isinstance(forget, bool) or not isinstance(forget, int | float) or not 0.0 <= forget <= 1.0:
            raise SpecRLError(f"per-sequence draft budget: forget must be a number in [0, 1], got {forget!r}")
        if isinstance(probe_every, bool) or not isinstance(probe_every, int) or probe_every < 1:
            raise SpecRLError(f"per-sequence draft budget: probe_every must be an integer >= 1 (steps at k_i = 0 "
                              f"before a one-token re-probe), got {probe_every!r}")
        if isinstance(prior_weight, bool) or not isinstance(prior_weight, int | float) or not prior_weight > 0:
            raise SpecRLError(f"per-sequence draft budget: prior_weight must be a number > 0, got {prior_weight!r}")
        self.threshold = float(threshold)
        self.forget = float(forget)
        self.probe_every = probe_every
        self.prior_rate = float(prior_rate)
        self.prior_weight = float(prior_weight)
        self.accepted = torch.zeros(num_slots, dtype=torch.float64)
        self.tested = torch.zeros(num_slots, dtype=torch.float64)
        self.idle = torch.zeros(num_slots, dtype=torch.long)  # steps in a row at k_i = 0

    def enter(self, start: int, stop: int) -> None:
        """New sequences entered slots start..stop-1: no evidence yet (the prior)."""
        self.accepted[start:stop] = 0.0
        self.tested[start:stop] = 0.0
        self.idle[start:stop] = 0

    def compact(self, order: list[int]) -> None:
        """Slots order[0], order[1], ... became slots 0, 1, ...: each estimate moves with its sequence."""
        src = torch.tensor(order, dtype=torch.long)
        m = len(order)
        for t in (self.accepted, self.tested, self.idle):
            t[:m] = t[src].clone()

    def rates(self, n: int) -> Tensor:
        """[n] estimated per-position acceptance rate of slots 0..n-1."""
        w = self.prior_weight
        return (self.accepted[:n] + self.prior_rate * w) / (self.tested[:n] + w)

    def budgets(self, n: int, k: int) -> Tensor:
        """[n] long: k_i for slots 0..n-1 in a step whose k is `k` (0..k each)."""
        if k <= 0:
            return torch.zeros(n, dtype=torch.long)
        r = self.rates(n)
        powers = r[:, None] ** torch.arange(1, k + 1, dtype=torch.float64)[None, :]  # decreasing in j
        kb = (powers >= self.threshold * (1 - 1e-12)).sum(-1)
        probe = (kb == 0) & (self.idle[:n] >= self.probe_every)
        return torch.where(probe, torch.ones_like(kb), kb)

    def observe(self, drafted: Tensor, accepted: Tensor) -> None:
        """One step's outcome for slots 0..n-1: drafted[i] real drafts (k_i, or fewer where the drafter had
        fewer), accepted[i] of them accepted (0 for rows of a plain step)."""
        n = int(drafted.numel())
        d = drafted.to(torch.float64)
        m = accepted.to(torch.float64)
        did = drafted > 0
        f = torch.where(did, torch.full_like(d, self.forget), torch.ones_like(d))
        self.accepted[:n] = f * self.accepted[:n] + torch.where(did, m, torch.zeros_like(m))
        self.tested[:n] = f * self.tested[:n] + torch.where(did, torch.minimum(m + 1, d), torch.zeros_like(d))
        self.idle[:n] = torch.where(did, torch.zeros_like(self.idle[:n]), self.idle[:n] + 1)


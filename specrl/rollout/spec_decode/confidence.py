"""Draft length from the drafter's own confidence: how many of a step's k drafts each row sends to the verifier.

After the drafter has proposed k tokens per row, `ConfidenceCut` predicts each draft's chance of acceptance and
keeps only the drafts whose expected accepted tokens pay for their verify rows. Row i's feature at position j is
f_ij = max_v q_ij(v), the drafter's top probability there (1 for one-hot drafters, and for any drafter at T = 0,
where q is one-hot: the prediction is then the position's mean rate); a calibration table maps it to c_ij, the
probability that draft j is accepted given that drafts 1..j-1 were (decayed counts per draft position and
confidence bin, learned online from this engine's own verify outcomes: at the same top probability, a deeper draft
is accepted less often). The marginal expected accepted tokens of draft j is
m_ij = prod_{l<=j} c_il. Its price is tau = beta * G: beta the slope per draft of the step cost that auto k's cost
model measures at this active batch size (`DraftLengthController.cost`, in plain steps), G the gain of the asked k
(>= 1); before that model has measured the bucket (and always with a fixed k, which measures nothing) tau is
`threshold`. Mode "row" keeps row i's drafts while m_ij >= tau, the rule for a forward whose cost follows the real
rows; the native verify forward pads every row to the longest kept one, where a column costs all rows and is
kept while mean_i m_ij >= tau: mode "column" (rows then keep the same number of drafts, except where the drafter
gave fewer). If a rule keeps nothing, every row keeps its first draft (the step already paid the drafter).
Lossless: the decision to verify draft j uses q_i1..q_ij as distributions and never the sampled x_ij, so, given
the tokens before it, x_ij is still a draw from q_ij and rejection sampling (or seed_exact) emits p's token; the
calibration is a function of earlier steps only. (A rule that looked at q_ij(x_ij), the proposed token's own
probability, would bias the output: tests/test_confidence_cut.py shows the chi-square test catching one.)
"""

from __future__ import annotations

import torch
from torch import Tensor

from specrl.errors import SpecRLError

CONFIDENCE_CUTS = ("off", "row", "column")
BINS = 10  # calibration bins over the top probability in [0, 1]
PRIOR_RATE = 0.6  # acceptance assumed for a bin before it has evidence ...
PRIOR_WEIGHT = 2.0  # ... worth this many attempts
FORGET = 0.995  # per verify step: decay of old calibration counts, so the table follows a drafter being trained
THRESHOLD = 0.3  # tau while the cost model has no measurement at this batch size (or k is fixed)


def check_cut(mode: object) -> str:
    if mode not in CONFIDENCE_CUTS:
        raise SpecRLError(f"confidence_cut must be one of {list(CONFIDENCE_CUTS)} (off; row: each row keeps the "
                          f"drafts its predicted acceptance pays for; column: the same rule per padded verify "
                          f"column), got {mode!r}")
    return mode


class ConfidenceCut:
    """Calibrated per-draft acceptance from the drafter's q, and the draft lengths it pays for (module docstring)."""

    def __init__(self, mode: str, k_max: int, bins: int = BINS, threshold: float = THRESHOLD, forget: float = FORGET,
                 prior_rate: float = PRIOR_RATE, prior_weight: float = PRIOR_WEIGHT):
        check_cut(mode)
        if mode == "off":
            raise SpecRLError("ConfidenceCut: mode 'off' means no cut; build none instead")
        if isinstance(bins, bool) or not isinstance(bins, int) or bins < 1:
            raise SpecRLError(f"confidence cut: bins must be an integer >= 1, got {bins!r}")
        for name, v, lo, hi in (("threshold", threshold, 0.0, float("inf")), ("prior_rate", prior_rate, 0.0, 1.0)):
            if isinstance(v, bool) or not isinstance(v, int | float) or not lo < v < hi:
                raise SpecRLError(f"confidence cut: {name} must be a number in ({lo}, {hi}), got {v!r}")
        if isinstance(forget, bool) or not isinstance(forget, int | float) or not 0.0 < forget <= 1.0:
            raise SpecRLError(f"confidence cut: forget must be a number in (0, 1], got {forget!r}")
        if isinstance(prior_weight, bool) or not isinstance(prior_weight, int | float) or not prior_weight > 0:
            raise SpecRLError(f"confidence cut: prior_weight must be a number > 0, got {prior_weight!r}")
        self.mode, self.k_max, self.bins = mode, k_max, bins
        self.threshold, self.forget = float(threshold), float(forget)
        self.prior_rate, self.prior_weight = float(prior_rate), float(prior_weight)
        self.attempts = torch.zeros(k_max, bins, dtype=torch.float64)  # per draft position and confidence bin
        self.accepts = torch.zeros(k_max, bins, dtype=torch.float64)

    # ---------------------------------------------------------------- prediction
    @staticmethod
    def features(probs: Tensor | None, n: int, k: int) -> Tensor:
        """[n, k] float64: the drafter's top probability per drafted position (ones for one-hot drafts)."""
        if probs is None:
            return torch.ones(n, k, dtype=torch.float64)
        return probs[:, :k].amax(-1).to(torch.float64).cpu()

    def _bin(self, f: Tensor) -> Tensor:
        """[n, k] flat cell index (position * bins + confidence bin) of each draft."""
        b = (f.clamp(0.0, 1.0) * self.bins).long().clamp_max(self.bins - 1)
        return torch.arange(f.shape[1])[None, :] * self.bins + b

    def calibrated(self, f: Tensor) -> Tensor:
        """[n, k] predicted acceptance of each draft given the drafts before it were accepted."""
        w = self.prior_weight
        rate = (self.accepts + self.prior_rate * w) / (self.attempts + w)
        return rate.reshape(-1)[self._bin(f)]

    def price(self, controller, n: int, k: int) -> float:
        """tau: expected accepted tokens one more draft must bring (module docstring)."""
        if controller is None or controller.fixed is not None:
            return self.threshold
        bucket = controller._bucket(n)
        hi, lo = controller.cost(bucket, k), controller.cost(bucket, k - 1)
        gain = controller.gain(bucket, k)
        if hi is None or lo is None or gain is None:
            return self.threshold
        return max(hi - lo, 0.0) * max(gain, 1.0)

    def lengths(self, c: Tensor, num_drafts: Tensor | None, tau: float) -> Tensor:
        """[n] long: drafts each row keeps, from calibrated c [n, k], the rows' real drafts and the price tau."""
        n, k = c.shape
        real = torch.arange(k)[None, :] < (torch.full((n,), k) if num_drafts is None else num_drafts.cpu())[:, None]
        m = torch.cumprod(c, dim=1) * real  # marginal expected accepted tokens of each real draft; 0 past the last
        if self.mode == "row":
            keep = m >= tau
        else:
            col = m.sum(0) / max(n, 1) >= tau  # the padded column is paid by every row
            keep = col[None, :].expand(n, k) & real
        out = keep.long().cumprod(dim=1).sum(1)  # m decreases along a row, so this is the first failing position
        if int(out.max()) == 0:  # nothing pays: each row keeps its first draft (the drafter is already paid)
            out = real[:, 0].long() if k > 0 else out
        return out

    def cut(self, probs: Tensor | None, num_drafts: Tensor | None, n: int, k: int, controller) -> tuple[Tensor, Tensor]:
        """The engine's call: ([n] drafts each row keeps, never more than its real ones; [n, k] features)."""
        f = self.features(probs, n, k)
        kept = self.lengths(self.calibrated(f), num_drafts, self.price(controller, n, k))
        return (kept if num_drafts is None else torch.minimum(kept, num_drafts.cpu())), f

    # ---------------------------------------------------------------- outcomes
    def observe(self, f: Tensor, kept: Tensor, num_accepted: Tensor) -> tuple[Tensor, Tensor, Tensor]:
        """One verify step's outcome: row i verified kept[i] drafts and accepted num_accepted[i]. Updates the
        table and returns per position [k] the sums over reached drafts of (predicted c, attempts, accepts),
        predictions taken before the update (what the cut used)."""
        n, k = f.shape
        c = self.calibrated(f)
        pos = torch.arange(k)[None, :]
        acc = num_accepted.cpu()[:, None]
        reached = (pos < kept.cpu()[:, None]) & (pos <= acc)
        won = reached & (pos < acc)
        b = self._bin(f)
        for table, hit in ((self.attempts, reached), (self.accepts, won)):
            table.mul_(self.forget).view(-1).index_add_(0, b[hit], torch.ones(int(hit.sum()), dtype=torch.float64))
        return (c * reached).sum(0), reached.sum(0).to(torch.float64), won.sum(0).to(torch.float64)

"""Generation metrics: counters for one `generate` call, exported in `GenerationResult.metrics`.

Acceptance length is 1 + accepted / verify steps (a verify step = one sequence verified once), acceptance
rate is accepted / drafted, and the per-position rate at position i is accepted-at-i / drafted-at-i. The exported
dict carries the raw counters too, so `merge_metrics` can combine calls (several rollout workers' parts of one
step) by summing counters and deriving the rates once, here. `batch_trace` is the shape of the call over time: one
[seconds, active sequences, k, emitted tokens, verify seconds] row per decode step (seconds = the step's end, counted
over decode steps; verify seconds 0 for plain steps), which shows a rollout's tail (the batch draining while the
longest replies finish) and gives the throughput of each phase of it (`phase_rates`) and, in benchmarks, each
step's cost at its occupancy. The `history_*` counters count apart the drafts that came from the prompt's history
(the suffix index of the suffix and hybrid drafters: rows, drafted, accepted) and the size of that index at the
call's end (tokens and n-gram entries; merged calls report the largest).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
from torch import Tensor


@dataclass
class SpecMetrics:
    k_max: int
    prompt_tokens: int = 0
    generated_tokens: int = 0
    finished: int = 0
    ar_steps: int = 0  # engine steps without speculation (k = 0)
    spec_steps: int = 0  # engine steps with speculation
    verify_steps: int = 0  # sequences x speculative steps
    draft_tokens: int = 0
    accepted_tokens: int = 0
    bonus_tokens: int = 0  # verify steps that accepted every real draft and emitted the bonus token from p
    draft_seconds: float = 0.0
    verify_seconds: float = 0.0
    ar_seconds: float = 0.0
    prefill_seconds: float = 0.0
    total_seconds: float = 0.0
    k_histogram: dict = field(default_factory=dict)  # k -> engine steps
    drafted_at: list = field(default_factory=list)
    accepted_at: list = field(default_factory=list)
    _seq_steps: int = 0  # sequences x engine steps, plain and speculative (for the mean draft length)
    batch_trace: list = field(default_factory=list)  # [decode s at step end, active, k, emitted, verify s]
    _decode_s: float = 0.0
    history_rows: int = 0  # row-steps whose draft came from the prompt's history (suffix index)
    history_drafted: int = 0  # of draft_tokens, those from history
    history_accepted: int = 0  # of accepted_tokens, those from history
    history_tokens: int = 0  # tokens the history index held at the end of the call (summed over engines)
    history_entries: int = 0  # its n-gram entries
    verify_rows: int = 0  # rows of the verify forwards: n x (verified columns + 1) per step, padding included
    confidence_predicted_at: list = field(default_factory=list)  # per position: sum of predicted acceptance ...
    confidence_attempted_at: list = field(default_factory=list)  # ... over drafts the verifier reached
    confidence_accepted_at: list = field(default_factory=list)  # ... and how many of them it accepted

    def __post_init__(self):
        self.drafted_at = [0] * self.k_max
        self.accepted_at = [0] * self.k_max
        self.confidence_predicted_at = [0.0] * self.k_max
        self.confidence_attempted_at = [0.0] * self.k_max
        self.confidence_accepted_at = [0.0] * self.k_max

    def record_ar(self, n: int, seconds: float) -> None:
        self.ar_steps += 1
        self.ar_seconds += seconds
        self.generated_tokens += n
        self.k_histogram[0] = self.k_histogram.get(0, 0) + 1
        self._seq_steps += n
        self._trace(n, 0, seconds, n)

    def _trace(self, n: int, k: int, seconds: float, emitted: int, verify_s: float = 0.0) -> None:
        self._decode_s += seconds
        self.batch_trace.append([round(self._decode_s, 4), n, k, emitted, round(verify_s, 6)])

    def record_spec(self, k: int, num_accepted: Tensor, emitted: Tensor, draft_s: float, verify_s: float,
                    num_drafts: Tensor | None = None, from_history: Tensor | None = None) -> None:
        """One speculative step over n rows with k verified columns; `num_drafts` [n]: real drafts per row (the
        rest is padding of a ragged proposal, counted neither as drafted nor as accepted), None: all k;
        `from_history` [n] bool: rows whose draft came from the prompt's history, also counted apart."""
        n = int(num_accepted.numel())
        if from_history is not None and bool(from_history.any()):
            h = from_history.bool()
            real = torch.full((n,), k, dtype=torch.long) if num_drafts is None else num_drafts
            self.history_rows += int(h.sum())
            self.history_drafted += int(real[h].sum())
            self.history_accepted += int(num_accepted[h].sum())
        self.spec_steps += 1
        self.verify_steps += n
        self.verify_rows += n * (k + 1)
        self.draft_tokens += n * k if num_drafts is None else int(num_drafts.sum())
        self.accepted_tokens += int(num_accepted.sum())
        real_k = torch.full_like(num_accepted, k) if num_drafts is None else num_drafts
        self.bonus_tokens += int(((num_accepted >= real_k) & (real_k > 0)).sum())
        self.generated_tokens += int(emitted.sum())
        self.draft_seconds += draft_s
        self.verify_seconds += verify_s
        self.k_histogram[k] = self.k_histogram.get(k, 0) + 1
        self._seq_steps += n
        self._trace(n, k, draft_s + verify_s, int(emitted.sum()), verify_s)
        for i in range(k):
            self.drafted_at[i] += n if num_drafts is None else int((num_drafts > i).sum())
            self.accepted_at[i] += int((num_accepted > i).sum())

    def record_confidence(self, predicted: Tensor, attempted: Tensor, accepted: Tensor) -> None:
        """A confidence cut's calibration check for one step: per position, the summed predicted acceptance of the
        drafts the verifier reached, how many it reached and how many it accepted."""
        for i in range(int(predicted.numel())):
            self.confidence_predicted_at[i] += float(predicted[i])
            self.confidence_attempted_at[i] += float(attempted[i])
            self.confidence_accepted_at[i] += float(accepted[i])

    def calibration(self) -> dict:
        """Per position: mean predicted vs realised acceptance of reached drafts (None where none was reached)."""
        att = self.confidence_attempted_at
        return {"predicted": [p / a if a else None for p, a in zip(self.confidence_predicted_at, att, strict=True)],
                "realised": [r / a if a else None for r, a in zip(self.confidence_accepted_at, att, strict=True)],
                "attempts": list(att)}

    def as_dict(self) -> dict:
        total = max(self.total_seconds, 1e-9)
        return {
            "acceptance_length": 1.0 + self.accepted_tokens / self.verify_steps if self.verify_steps else 1.0,
            "acceptance_rate": self.accepted_tokens / self.draft_tokens if self.draft_tokens else 0.0,
            "acceptance_rate_per_position": [a / d if d else None for a, d in
                                             zip(self.accepted_at, self.drafted_at, strict=True)],
            "verify_steps": self.verify_steps,
            "draft_tokens": self.draft_tokens,
            "accepted_tokens": self.accepted_tokens,
            "bonus_tokens": self.bonus_tokens,
            "generated_tokens": self.generated_tokens,
            "prompt_tokens": self.prompt_tokens,
            "num_sequences": self.finished,
            "tokens_per_second": self.generated_tokens / total,
            "draft_seconds": self.draft_seconds,
            "verify_seconds": self.verify_seconds,
            "ar_seconds": self.ar_seconds,
            "prefill_seconds": self.prefill_seconds,
            "total_seconds": self.total_seconds,
            "ar_steps": self.ar_steps,
            "spec_steps": self.spec_steps,
            "num_draft_tokens_mean": self.draft_tokens / self._seq_steps if self._seq_steps else 0.0,
            "k_histogram": {int(k): v for k, v in sorted(self.k_histogram.items())},
            "drafted_per_position": list(self.drafted_at),
            "accepted_per_position": list(self.accepted_at),
            "sequence_steps": self._seq_steps,
            "batch_trace": [list(r) for r in self.batch_trace],
            "verify_rows": self.verify_rows,
            "verify_rows_per_token": self.verify_rows / self.generated_tokens if self.generated_tokens else 0.0,
            "confidence_calibration": self.calibration(),
            **{key: getattr(self, key) for key in _HISTORY},
        }

    @classmethod
    def from_dict(cls, d: dict) -> SpecMetrics:
        """The counters back from an `as_dict` export."""
        drafted, accepted = list(d["drafted_per_position"]), list(d["accepted_per_position"])
        m = cls(len(drafted))
        for key in _SUMMED:
            setattr(m, key, d.get(key, 0) if key in _OPTIONAL else d[key])
        for key in _HELD:
            setattr(m, key, d.get(key, 0))
        m.finished, m._seq_steps = d["num_sequences"], d["sequence_steps"]
        m.k_histogram = {int(k): v for k, v in d["k_histogram"].items()}
        m.drafted_at, m.accepted_at = drafted, accepted
        m.batch_trace = [list(r) for r in d.get("batch_trace", [])]
        cal = d.get("confidence_calibration")
        if cal is not None:  # sums back from the means
            att = list(cal["attempts"])
            m.confidence_attempted_at = att
            m.confidence_predicted_at = [(p or 0.0) * a for p, a in zip(cal["predicted"], att, strict=True)]
            m.confidence_accepted_at = [(r or 0.0) * a for r, a in zip(cal["realised"], att, strict=True)]
        return m


def phase_rates(trace: list[list]) -> dict[int, tuple[int, float]]:
    """Per active batch size n: (tokens emitted, decode seconds) over the steps that ran with n sequences."""
    out: dict[int, list] = {}
    prev = 0.0
    for t, n, _, emitted, *_ in trace:
        acc = out.setdefault(int(n), [0, 0.0])
        acc[0] += int(emitted)
        acc[1] += t - prev
        prev = t
    return {n: (tok, sec) for n, (tok, sec) in sorted(out.items())}


_SUMMED = ("prompt_tokens", "generated_tokens", "ar_steps", "spec_steps", "verify_steps", "draft_tokens",
           "accepted_tokens", "draft_seconds", "verify_seconds", "ar_seconds", "prefill_seconds", "total_seconds",
           "history_rows", "history_drafted", "history_accepted", "bonus_tokens", "verify_rows")
_HELD = ("history_tokens", "history_entries")  # sizes at a call's end: merged calls report the largest
_HISTORY = ("history_rows", "history_drafted", "history_accepted", *_HELD)
_OPTIONAL = (*_HISTORY, "bonus_tokens", "verify_rows")  # counters an older export may lack


def merge_metrics(parts: list[dict], wall_seconds: float | None = None) -> dict:
    """One metrics dict for several `generate` calls: counters summed, rates derived again. `total_seconds`
    (and so tokens_per_second) is `wall_seconds` when the calls ran in parallel, else their sum. The batch trace
    is the first part's (one engine's view of the rollout; parallel engines' traces do not add up)."""
    if not parts:
        raise ValueError("merge_metrics needs at least one metrics dict")
    ms = [SpecMetrics.from_dict(p) for p in parts]
    out = SpecMetrics(max(m.k_max for m in ms))
    for m in ms:
        for key in _SUMMED:
            setattr(out, key, getattr(out, key) + getattr(m, key))
        for key in _HELD:
            setattr(out, key, max(getattr(out, key), getattr(m, key)))
        out.finished += m.finished
        out._seq_steps += m._seq_steps
        for k, v in m.k_histogram.items():
            out.k_histogram[k] = out.k_histogram.get(k, 0) + v
        for i in range(m.k_max):
            out.drafted_at[i] += m.drafted_at[i]
            out.accepted_at[i] += m.accepted_at[i]
            out.confidence_predicted_at[i] += m.confidence_predicted_at[i]
            out.confidence_attempted_at[i] += m.confidence_attempted_at[i]
            out.confidence_accepted_at[i] += m.confidence_accepted_at[i]
    out.batch_trace = ms[0].batch_trace
    if wall_seconds is not None:
        out.total_seconds = wall_seconds
    return out.as_dict()

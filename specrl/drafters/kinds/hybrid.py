"""Hybrid drafter: a learned drafter (EAGLE, MTP, draft model) and the suffix drafter over the prompt's history, one
proposal per row.

GRPO's samples of one prompt share phrasing, and a prompt that comes back in a later epoch is answered much as it
was before, so where a sibling or an earlier rollout already wrote what follows the current context the suffix
index's continuation is often right for many tokens, while the learned drafter is the better guess everywhere
else. Each step both propose (the learned drafter always runs, so its state stays in step with the engine). A row
takes the suffix continuation only where it passes two gates: its match length (context tokens matched,
>= `min_match`) and its probability (the suffix drafter stops a draft where the product of its tokens' empirical
probabilities falls below its `min_prob`, and the row takes it only where the tokens it is expected to get
accepted, the sum of those probabilities times a calibration measured on earlier suffix rows, is at least
`min_ratio` (1 by default) times the learned drafter's expected accepted tokens at this k, from its measured
per-position acceptance). A suffix row
drafts only its continuation (ragged: no verify column is spent on guesses past it). Every gate reads the context
and earlier steps' outcomes, never this step's drafted tokens, so the row's draft distribution is a proper q
(one-hot for suffix rows, the learned q otherwise) and rejection sampling stays exact; in seed_exact mode any
proposal is exact. The single verifier (`specrl.rollout.spec_decode.verify.verify`) decides as for any other
drafter.
"""

from __future__ import annotations

import torch

from specrl.drafters.base import BindContext, DraftBatch, Drafter, Proposal
from specrl.drafters.kinds.suffix import SuffixDrafter
from specrl.errors import SpecRLError

DEFAULT_MIN_MATCH = 5  # context tokens the suffix must match before its continuation is trusted over the learned one
FORGET = 0.97  # per-step decay of the acceptance evidence, so the gates follow a policy that learns
PRIOR = 2.0  # pseudo-counts: the calibration starts at 1 and a per-position acceptance at 1/2


class HybridDrafter(Drafter):
    kind = "hybrid"

    def __init__(self, learned: Drafter, suffix: SuffixDrafter | None = None, min_match: int = DEFAULT_MIN_MATCH,
                 min_ratio: float = 1.0):
        if not isinstance(learned, Drafter) or isinstance(learned, (HybridDrafter, SuffixDrafter)):
            raise SpecRLError("a hybrid drafter combines a learned drafter (eagle/mtp/draft-model) with the suffix "
                              f"drafter; got {type(learned).__name__} as the learned part")
        if isinstance(min_match, bool) or not isinstance(min_match, int) or min_match < 1:
            raise SpecRLError(f"min_match must be an integer >= 1, got {min_match!r}")
        if isinstance(min_ratio, bool) or not isinstance(min_ratio, int | float) or not min_ratio >= 0:
            raise SpecRLError(f"min_ratio must be a number >= 0, got {min_ratio!r}")
        self.min_ratio = float(min_ratio)  # history row: expected accepted >= min_ratio x the learned drafter's
        self.learned = learned
        self.suffix = suffix or SuffixDrafter()
        self.min_match = min_match
        self.target_layers = learned.target_layers
        self.suffix_rows = 0  # rows that took the suffix proposal (for measurement)
        self.rows = 0
        self._att: list[float] = []  # learned rows: decayed attempts and acceptances per draft position
        self._acc: list[float] = []
        self._predicted = 0.0  # suffix rows: decayed expected accepted tokens (sum of probabilities) ...
        self._got = 0.0  # ... and accepted tokens
        self._last: tuple[list[bool], list[int], list[float]] | None = None  # this step's rows, for on_verified

    @property
    def catch_up_seconds(self) -> float:  # type: ignore[override]
        return self.learned.catch_up_seconds

    def bind(self, ctx: BindContext) -> None:
        self.learned.bind(ctx)
        self.suffix.bind(ctx)

    def on_prefill(self, slot_start: int, batch_tokens: list[list[int]], captured: dict | None) -> None:
        self.learned.on_prefill(slot_start, batch_tokens, captured)

    def calibration(self) -> float:
        """Measured accepted ÷ expected tokens of earlier suffix rows (1 before any)."""
        return (self._got + PRIOR) / (self._predicted + PRIOR)

    def learned_expected(self, k: int) -> float:
        """The learned drafter's expected accepted tokens per row at k: sum_j prod_{i<j} r_i, r_i measured."""
        total, p = 0.0, 1.0
        for i in range(k):
            att, acc = (self._att[i], self._acc[i]) if i < len(self._att) else (0.0, 0.0)
            p *= (acc + PRIOR / 2) / (att + PRIOR)
            total += p
        return total

    def propose(self, batch: DraftBatch, k: int) -> Proposal:
        learned = self.learned.propose(batch, k)
        matches = self.suffix.continuations(batch, k)
        bar = self.min_ratio * self.learned_expected(k) / self.calibration()
        use = [bool(m.tokens) and m.matched >= self.min_match and sum(m.probs) >= bar for m in matches]
        base = [k] * batch.size if learned.num_drafts is None else learned.num_drafts.tolist()
        drafted = [len(m.tokens) if u else base[b] for b, (m, u) in enumerate(zip(matches, use, strict=True))]
        self._last = (use, drafted, [sum(m.probs) for m in matches])
        self.rows += batch.size
        self.suffix_rows += sum(use)
        if not any(use):
            return learned
        tokens = learned.tokens.clone()
        probs = None if learned.probs is None else learned.probs.clone()
        for b, m in enumerate(matches):
            if use[b]:
                j = len(m.tokens)
                tokens[b, :j] = torch.tensor(m.tokens, dtype=torch.long)
                if probs is not None:  # a deterministic proposal: one-hot q at its real positions
                    probs[b, :j] = 0.0
                    probs[b, :j].scatter_(-1, tokens[b, :j, None], 1.0)
        return Proposal(tokens, probs, torch.tensor(drafted, dtype=torch.long),
                        from_history=torch.tensor(use, dtype=torch.bool))

    def on_verified(self, batch: DraftBatch, proposal: Proposal | None, num_emitted, captured: dict | None) -> None:
        if proposal is not None and self._last is not None:
            self._observe(num_emitted.tolist())
        self._last = None
        self.learned.on_verified(batch, proposal, num_emitted, captured)

    def _observe(self, emitted: list[int]) -> None:
        """Update the gates' evidence from this step's outcome (accepted = emitted - 1, at most what was drafted)."""
        use, drafted, predicted = self._last
        f = FORGET
        self._att = [f * x for x in self._att]
        self._acc = [f * x for x in self._acc]
        self._predicted *= f
        self._got *= f
        for u, d, pred, e in zip(use, drafted, predicted, emitted, strict=True):
            acc = max(0, min(e - 1, d))
            if u:
                self._predicted += pred
                self._got += acc
                continue
            while len(self._att) < d:
                self._att.append(0.0)
                self._acc.append(0.0)
            for i in range(min(acc + 1, d)):  # reached position i; accepted there if acc > i
                self._att[i] += 1
                self._acc[i] += acc > i

    def compact(self, order: list[int]) -> None:
        self.learned.compact(order)
        self.suffix.compact(order)

    def memory(self) -> dict[str, int]:
        return self.suffix.memory()

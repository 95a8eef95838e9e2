"""Hybrid drafter: a learned drafter (EAGLE, MTP, draft model) and the sibling-suffix drafter, one proposal per row.

GRPO's samples of one prompt share phrasing, so where a sibling already wrote what follows the current context the
suffix drafter's continuation is often right for many tokens, while the learned drafter is the better guess
everywhere else. Each step both propose (the learned drafter always runs, so its state stays in step with the
engine) and each row takes the suffix continuation when the suffix matched at least `min_match` context tokens and
has k tokens to offer, else the learned proposal. The choice depends only on the context (the match length), never
on the drafted tokens, so the row's draft distribution is a proper q (one-hot for suffix rows, the learned q
otherwise) and rejection sampling stays exact; in seed_exact mode any proposal is exact. The single verifier
(`specrl.rollout.spec_decode.verify.verify`) decides as for any other drafter.
"""

from __future__ import annotations

import torch

from specrl.drafters.base import BindContext, DraftBatch, Drafter, Proposal
from specrl.drafters.suffix import SuffixDrafter
from specrl.errors import SpecRLError

DEFAULT_MIN_MATCH = 5  # context tokens the suffix must match before its continuation is trusted over the learned one


class HybridDrafter(Drafter):
    kind = "hybrid"

    def __init__(self, learned: Drafter, suffix: SuffixDrafter | None = None, min_match: int = DEFAULT_MIN_MATCH):
        if not isinstance(learned, Drafter) or isinstance(learned, (HybridDrafter, SuffixDrafter)):
            raise SpecRLError("a hybrid drafter combines a learned drafter (eagle/mtp/draft-model) with the suffix "
                              f"drafter; got {type(learned).__name__} as the learned part")
        if not isinstance(min_match, int) or min_match < 1:
            raise SpecRLError(f"min_match must be an integer >= 1, got {min_match!r}")
        self.learned = learned
        self.suffix = suffix or SuffixDrafter()
        self.min_match = min_match
        self.target_layers = learned.target_layers
        self.suffix_rows = 0  # rows that took the suffix proposal (for measurement)
        self.rows = 0

    @property
    def catch_up_seconds(self) -> float:  # type: ignore[override]
        return self.learned.catch_up_seconds

    def bind(self, ctx: BindContext) -> None:
        self.learned.bind(ctx)
        self.suffix.bind(ctx)

    def on_prefill(self, slot_start: int, batch_tokens: list[list[int]], captured: dict | None) -> None:
        self.learned.on_prefill(slot_start, batch_tokens, captured)

    def propose(self, batch: DraftBatch, k: int) -> Proposal:
        learned = self.learned.propose(batch, k)
        conts = self.suffix.continuations(batch, k)
        use = [len(c) == k and m >= self.min_match for c, m in conts]
        self.rows += batch.size
        self.suffix_rows += sum(use)
        if not any(use):
            return learned
        tokens = learned.tokens.clone()
        probs = None if learned.probs is None else learned.probs.clone()
        for b, (c, _) in enumerate(conts):
            if use[b]:
                tokens[b] = torch.tensor(c, dtype=torch.long)
                if probs is not None:  # a deterministic proposal: one-hot q
                    probs[b] = 0.0
                    probs[b].scatter_(-1, tokens[b][:, None], 1.0)
        return Proposal(tokens, probs)

    def on_verified(self, batch: DraftBatch, proposal: Proposal | None, num_emitted, captured: dict | None) -> None:
        self.learned.on_verified(batch, proposal, num_emitted, captured)

    def compact(self, order: list[int]) -> None:
        self.learned.compact(order)
        self.suffix.compact(order)

"""Prompt-lookup (n-gram) drafter: propose the continuation that followed the latest occurrence of the
sequence's last n tokens in its own prompt and output (n from max_ngram down to min_ngram).

Deterministic: it returns one-hot q (`probs=None`), which the verifier handles exactly. Proposals are ragged
(`num_drafts`): a continuation shorter than k is not padded with guesses, and where nothing matches the row drafts
nothing (its step emits the policy's own token).
"""

from __future__ import annotations

from specrl.drafters.base import DraftBatch, Drafter, Proposal, ragged_proposal
from specrl.errors import SpecRLError


def lookup(tokens: list[int], k: int, min_ngram: int, max_ngram: int, corpus: list[int] | None = None) -> list[int]:
    """Continuation (up to k tokens) after the most recent earlier match of the suffix of `tokens`."""
    hay = tokens if corpus is None else corpus
    for n in range(min(max_ngram, len(tokens) - 1 if corpus is None else len(tokens)), min_ngram - 1, -1):
        pat = tokens[-n:]
        end = len(hay) - (1 if corpus is None else 0)  # in its own sequence, skip the trivial self-match
        for start in range(end - n, -1, -1):
            if hay[start:start + n] == pat:
                cont = hay[start + n:start + n + k]
                if cont:
                    return cont
    return []


class NGramDrafter(Drafter):
    kind = "ngram"

    def __init__(self, min_ngram: int = 1, max_ngram: int = 4):
        if not 1 <= min_ngram <= max_ngram:
            raise SpecRLError(f"need 1 <= min_ngram <= max_ngram, got {min_ngram}, {max_ngram}")
        self.min_ngram, self.max_ngram = min_ngram, max_ngram

    def propose(self, batch: DraftBatch, k: int) -> Proposal:
        return ragged_proposal([lookup(toks, k, self.min_ngram, self.max_ngram) for toks in batch.tokens], k)

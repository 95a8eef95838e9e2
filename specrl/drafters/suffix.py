"""Suffix drafter: propose continuations found in the *sibling samples* of the same prompt.

GRPO draws n samples per prompt and siblings share long stretches, so the best source of a draft is what
the other samples of this prompt (in the batch right now, and finished earlier, including earlier
`generate` calls) wrote after the same context. For each group (prompt) it keeps the finished sequences;
at draft time it searches the live siblings' and finished sequences' generated text for the longest match
(up to max_match tokens) of the current suffix and proposes what followed, breaking ties by how many
siblings agree. Deterministic: q is one-hot, verification stays exact.
"""

from __future__ import annotations

from collections import Counter, defaultdict

from specrl.drafters.base import DraftBatch, Drafter, Proposal, pad_proposals
from specrl.drafters.ngram import lookup
from specrl.errors import SpecRLError


class SuffixDrafter(Drafter):
    kind = "suffix"

    def __init__(self, max_match: int = 8, min_match: int = 2, max_history: int = 64, max_siblings: int = 16):
        if not 1 <= min_match <= max_match:
            raise SpecRLError(f"need 1 <= min_match <= max_match, got {min_match}, {max_match}")
        self.max_match, self.min_match, self.max_history = max_match, min_match, max_history
        self.max_siblings = max_siblings
        self.history: dict[int, list[list[int]]] = defaultdict(list)  # group -> finished sequences

    def on_finished(self, tokens: list[int], group_id: int) -> None:
        hist = self.history[group_id]
        hist.append(list(tokens))
        if len(hist) > self.max_history:
            del hist[0]

    def _candidates(self, me: int, batch: DraftBatch) -> list[list[int]]:
        g = batch.group_ids[me]
        live = [t for i, t in enumerate(batch.tokens) if i != me and batch.group_ids[i] == g]
        return live[: self.max_siblings] + self.history.get(g, [])[-self.max_siblings:]

    def propose(self, batch: DraftBatch, k: int) -> Proposal:
        rows = []
        for b, toks in enumerate(batch.tokens):
            best: list[int] = []
            for n in range(self.max_match, self.min_match - 1, -1):
                if len(toks) < n:
                    continue
                conts = [tuple(c) for c in (lookup(toks[-n:], k, n, n, corpus=s) for s in
                                            self._candidates(b, batch)) if c]
                if conts:
                    # the most common continuation among siblings (longest on ties)
                    counts = Counter(conts)
                    best = list(max(counts, key=lambda c: (counts[c], len(c))))
                    break
            if not best:
                best = lookup(toks, k, 1, 4)  # fall back to the sequence's own prompt/output
            rows.append(best + [toks[-1]] * (k - len(best)))
        return Proposal(pad_proposals(rows, k))

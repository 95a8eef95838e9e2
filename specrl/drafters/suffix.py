"""Suffix drafter: propose continuations found in the *sibling samples* of the same prompt.

GRPO draws n samples per prompt and siblings share long stretches, so the best source of a draft is what
the other samples of this prompt wrote after the same context — in the batch right now and in earlier
rollouts (finished sequences stay indexed, across `generate` calls). Per group (prompt) the drafter keeps an
incremental n-gram index: for each n in match_lengths it maps the n tokens ending at a position to the
RECENT_PER_NGRAM most recent (sequence, position) pairs where they occurred; only newly generated tokens are
indexed at each step, so a proposal costs O(k) dictionary look-ups per sequence. A proposal takes the longest
n whose last n tokens occurred anywhere in the group, and there the most recent occurrence with a non-empty
continuation, whether it lies in a sibling, an earlier rollout or the sequence's own prompt and output (only
the sequence's own current suffix is skipped). Deterministic: q is one-hot, verification stays exact. Proposals
are ragged (`num_drafts`): a short continuation is not padded with guesses, and a row without a match drafts
nothing.
"""

from __future__ import annotations

from specrl.drafters.base import DraftBatch, Drafter, Proposal, ragged_proposal
from specrl.errors import SpecRLError

RECENT_PER_NGRAM = 4  # occurrences remembered per n-gram (the most recent ones)


class _GroupIndex:
    def __init__(self, lengths: tuple[int, ...], per_ngram: int = RECENT_PER_NGRAM):
        self.lengths = lengths
        self.per_ngram = per_ngram
        self.seqs: dict[int, list[int]] = {}  # internal sequence id -> tokens
        self.ids: dict[int, int] = {}  # caller's sequence key -> current internal id
        self.table: dict[tuple, list[tuple[int, int]]] = {}  # n-gram -> recent (internal id, end position)

    def extend(self, key: int, tokens: list[int]) -> int:
        sid = self.ids.get(key)
        own = self.seqs.get(sid) if sid is not None else None
        if own is None or len(own) > len(tokens) or (own and own[-1] != tokens[len(own) - 1]):
            sid = self.ids[key] = len(self.seqs)  # a new sequence (an old one under this key stays as history)
            own = self.seqs[sid] = []
        start = len(own)
        own.extend(tokens[start:])
        for end in range(max(start, 1), len(own) + 1):
            for n in self.lengths:
                if end >= n:
                    hits = self.table.setdefault(tuple(own[end - n:end]), [])
                    hits.append((sid, end))
                    if len(hits) > self.per_ngram:
                        del hits[0]
        return sid

    def continuation(self, me: int, tokens: list[int], k: int) -> tuple[list[int], int]:
        """(up to k continuation tokens, the number of context tokens matched); ([], 0) without a match."""
        for n in self.lengths:
            if len(tokens) < n:
                continue
            for sid, end in reversed(self.table.get(tuple(tokens[-n:]), ())):
                if sid == me and end >= len(tokens):
                    continue  # our own latest n-gram: nothing follows it yet
                cont = self.seqs[sid][end:end + k]
                if cont:
                    return cont, n
        return [], 0


class SuffixDrafter(Drafter):
    kind = "suffix"

    def __init__(self, match_lengths: tuple[int, ...] = (8, 5, 3, 2), max_groups: int = 4096):
        if not match_lengths or min(match_lengths) < 1:
            raise SpecRLError(f"match_lengths must be positive integers, got {match_lengths!r}")
        self.lengths = tuple(sorted(set(match_lengths), reverse=True))
        self.max_groups = max_groups
        self.groups: dict[int, _GroupIndex] = {}

    def _group(self, gid: int) -> _GroupIndex:
        g = self.groups.get(gid)
        if g is None:
            if len(self.groups) >= self.max_groups:  # forget the oldest prompt's history
                self.groups.pop(next(iter(self.groups)))
            g = self.groups[gid] = _GroupIndex(self.lengths)
        return g

    def continuations(self, batch: DraftBatch, k: int) -> list[tuple[list[int], int]]:
        """Per row: (up to k continuation tokens, context tokens matched), after indexing the batch's new tokens."""
        ids = []
        for b, toks in enumerate(batch.tokens):  # index everything new first, so siblings see each other
            key = (int(batch.seeds[b]) << 32) ^ int(batch.request_ids[b])
            ids.append(self._group(batch.group_ids[b]).extend(key, toks))
        return [self._group(batch.group_ids[b]).continuation(ids[b], toks, k) for b, toks in enumerate(batch.tokens)]

    def propose(self, batch: DraftBatch, k: int) -> Proposal:
        return ragged_proposal([cont for cont, _ in self.continuations(batch, k)], k)

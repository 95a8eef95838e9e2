"""Suffix drafter: propose continuations found in the *sibling samples* of the same prompt and in its history.

GRPO draws n samples per prompt and siblings share long stretches, so the best source of a draft is what
the other samples of this prompt wrote after the same context — in the batch right now and in earlier
rollouts of the same prompt (finished sequences stay indexed across `generate` calls, so a prompt that comes back
in a later epoch drafts from its earlier rollouts). Per group (prompt) the drafter keeps an incremental n-gram
index: for each n in match_lengths it maps the n tokens ending at a position to the RECENT_PER_NGRAM most recent
(sequence, position) pairs where they occurred; only newly generated tokens are indexed at each step. A proposal is
built token by token: the longest n whose last n tokens (of the context plus the tokens drafted so far) occurred in
the group gives up to RECENT_PER_NGRAM occurrences with a next token; the most frequent next token is drafted
(ties: the most recent), and its frequency among them is its empirical probability. The row's *match length* is
the n of its first token, and a draft stops where the product of those probabilities falls below `min_prob`
(the probability gate: a context several histories continued differently drafts only its agreed part). Only the
sequence's own current suffix is skipped. Deterministic given the context: q is one-hot and verification stays
exact. Proposals are ragged (`num_drafts`): a short continuation is not padded with guesses, and a row without a
match drafts nothing.

Memory is bounded in tokens: the drafter holds at most `max_tokens` tokens over all prompts, and beyond it drops
the oldest sequences first, whichever prompt they belong to and the current batch's included (a sequence dropped
while it is still being generated stays out of the index until it ends; its siblings and the history still draft
for it). It also keeps at most `max_groups` prompts (the least recently used goes), and, where `max_history` is
given, at most that many sequences per prompt. `memory()` counts what is held (tokens and index entries);
measured, the index takes ~500 bytes of Python heap per held token (benchmarks/history_memory.py;
docs/drafters.md), so the default `max_tokens` of 2^21 holds ~1 GB at most, however long the responses.
"""

from __future__ import annotations

from typing import NamedTuple

from specrl.drafters.base import DraftBatch, Drafter, Proposal, ragged_proposal
from specrl.errors import SpecRLError

RECENT_PER_NGRAM = 4  # occurrences remembered per n-gram (the most recent ones)
MAX_HISTORY = None  # no cap on sequences per group: the bound is `max_tokens`, whatever the response lengths
MAX_GROUPS = 4096
MAX_TOKENS = 1 << 21  # tokens held over all groups: ~1 GB of index at the measured ~500 bytes per token
# a draft stops where the product of its tokens' empirical probabilities falls below this: with up to 4 occurrences
# per n-gram, one disagreement among 4 (0.75) keeps drafting and a 2-2 split after that (0.375) stops
DEFAULT_MIN_PROB = 0.3


class Match(NamedTuple):
    """One row's continuation: up to k tokens, the context tokens its first token matched (0: no match), and per
    token the cumulative empirical probability (the product of the frequencies of the tokens so far)."""

    tokens: list[int]
    matched: int
    probs: list[float]


class _GroupIndex:
    def __init__(self, lengths: tuple[int, ...], per_ngram: int = RECENT_PER_NGRAM):
        self.lengths = lengths
        self.per_ngram = per_ngram
        self.next_id = 0
        self.tokens = 0  # tokens held over this group's sequences
        self.seqs: dict[int, list[int]] = {}  # internal sequence id -> tokens, oldest first
        self.ids: dict[int, int] = {}  # caller's sequence key -> current internal id
        self.table: dict[tuple, list[tuple[int, int]]] = {}  # n-gram -> recent (internal id, end position)
        self.gone: dict[int, tuple[int, int]] = {}  # key of a running sequence dropped -> (its length, last token)

    def evict(self, sid: int, running: set[int] = frozenset()) -> int:
        """Drop sequence `sid` and every index entry that points into it; return its tokens. A key in `running`
        (still being generated) is remembered, so the rest of that sequence is not indexed anew."""
        old = self.seqs.pop(sid)
        self.tokens -= len(old)
        for key in [k for k, v in self.ids.items() if v == sid]:
            del self.ids[key]
            if key in running and old:
                self.gone[key] = (len(old), old[-1])
        for end in range(1, len(old) + 1):
            for n in self.lengths:
                if end >= n:
                    key = tuple(old[end - n:end])
                    hits = self.table.get(key)
                    if hits is not None:
                        hits[:] = [h for h in hits if h[0] != sid]
                        if not hits:
                            del self.table[key]
        return len(old)

    def memory(self) -> dict[str, int]:
        return {"sequences": len(self.seqs), "tokens": sum(map(len, self.seqs.values())),
                "index_entries": sum(map(len, self.table.values()))}

    def extend(self, key: int, tokens: list[int]) -> int | None:
        """Index the new tokens of the sequence under `key`; its internal id (None: it was dropped while running
        and stays out of the index)."""
        if key in self.gone:
            n, last = self.gone[key]
            if len(tokens) >= n and tokens[n - 1] == last:  # the dropped sequence, continued
                self.gone[key] = (len(tokens), tokens[-1])
                return None
            del self.gone[key]  # another sequence under this key
        sid = self.ids.get(key)
        own = self.seqs.get(sid) if sid is not None else None
        if own is None or len(own) > len(tokens) or (own and own[-1] != tokens[len(own) - 1]):
            sid = self.ids[key] = self.next_id  # a new sequence (an old one under this key stays as history)
            self.next_id += 1
            own = self.seqs[sid] = []
        start = len(own)
        own.extend(tokens[start:])
        self.tokens += len(tokens) - start
        for end in range(start + 1, len(own) + 1):  # positions not indexed yet (end = start was, last call)
            for n in self.lengths:
                if end >= n:
                    hits = self.table.setdefault(tuple(own[end - n:end]), [])
                    hits.append((sid, end))
                    if len(hits) > self.per_ngram:
                        del hits[0]
        return sid

    def _next(self, me: int | None, own_len: int, ctx: list[int]) -> tuple[int, float, int] | None:
        """(most frequent next token, its frequency, n matched) for the longest indexed n-gram ending `ctx`."""
        for n in self.lengths:
            if len(ctx) < n:
                continue
            counts: dict[int, int] = {}
            total = 0
            for sid, end in reversed(self.table.get(tuple(ctx[-n:]), ())):
                seq = self.seqs[sid]
                if end >= len(seq) or (sid == me and end >= own_len):
                    continue  # nothing follows it yet (our own latest n-gram among them)
                counts[seq[end]] = counts.get(seq[end], 0) + 1  # dicts keep insertion order: most recent first
                total += 1
            if total:
                tok = max(counts, key=counts.get)  # first maximum: the most recent of the tied ones
                return tok, counts[tok] / total, n
        return None

    def continuation(self, me: int | None, tokens: list[int], k: int, min_prob: float = 0.0) -> Match:
        """Up to k drafted tokens after `tokens`, stopping where the cumulative probability drops below min_prob."""
        out: list[int] = []
        probs: list[float] = []
        matched, p = 0, 1.0
        ctx = list(tokens[-self.lengths[0]:])  # the longest n-gram's worth of context is all a look-up reads
        while len(out) < k:
            nxt = self._next(me, len(tokens), ctx)
            if nxt is None:
                break
            tok, freq, n = nxt
            if not out:
                matched = n
            p *= freq
            if p < min_prob:
                break
            out.append(tok)
            probs.append(p)
            ctx.append(tok)
        return Match(out, matched if out else 0, probs)


class SuffixDrafter(Drafter):
    kind = "suffix"

    def __init__(self, match_lengths: tuple[int, ...] = (8, 5, 3, 2), max_groups: int = MAX_GROUPS,
                 max_history: int | None = MAX_HISTORY, min_prob: float = DEFAULT_MIN_PROB,
                 max_tokens: int = MAX_TOKENS):
        if not match_lengths or min(match_lengths) < 1:
            raise SpecRLError(f"match_lengths must be positive integers, got {match_lengths!r}")
        if isinstance(min_prob, bool) or not isinstance(min_prob, int | float) or not 0.0 <= min_prob <= 1.0:
            raise SpecRLError(f"min_prob must be a probability in [0, 1], got {min_prob!r}")
        self.min_prob = float(min_prob)
        for name, v in (("max_groups", max_groups), ("max_history", max_history), ("max_tokens", max_tokens)):
            if name == "max_history" and v is None:
                continue
            if not isinstance(v, int) or isinstance(v, bool) or v < 1:
                raise SpecRLError(f"{name} must be an integer >= 1, got {v!r}")
        self.lengths = tuple(sorted(set(match_lengths), reverse=True))
        self.max_groups = max_groups
        self.max_history = max_history
        self.max_tokens = max_tokens
        self.groups: dict[int, _GroupIndex] = {}
        self._order: dict[tuple[int, int], None] = {}  # (group, sequence id) of every held sequence, oldest first

    def _group(self, gid: int) -> _GroupIndex:
        g = self.groups.pop(gid, None)  # re-inserted last: the groups are kept in order of last use
        if g is None:
            if len(self.groups) >= self.max_groups:  # forget the least recently used prompt's history
                old_gid = next(iter(self.groups))
                for sid in self.groups.pop(old_gid).seqs:
                    self._order.pop((old_gid, sid), None)
            g = _GroupIndex(self.lengths)
        self.groups[gid] = g
        return g

    def _evict(self, gid: int, sid: int, running: dict[int, set[int]]) -> int:
        self._order.pop((gid, sid), None)
        return self.groups[gid].evict(sid, running.get(gid, frozenset()))

    def _fit_tokens(self, running: dict[int, set[int]]) -> None:
        """Drop the oldest sequences (of any prompt, the batch's included) while the index holds more than
        max_tokens; `running` (group -> keys) are the batch's sequences, still being generated."""
        total = sum(g.tokens for g in self.groups.values())
        while total > self.max_tokens and self._order:
            gid, sid = next(iter(self._order))
            total -= self._evict(gid, sid, running)
        for gid in [gid for gid, g in self.groups.items() if not g.seqs and gid not in running]:
            del self.groups[gid]  # a prompt whose history is all gone

    def memory(self) -> dict[str, int]:
        """What the index holds: groups, sequences, tokens and n-gram entries (bounded by the window)."""
        out = {"groups": len(self.groups), "sequences": 0, "tokens": 0, "index_entries": 0}
        for g in self.groups.values():
            for k, v in g.memory().items():
                out[k] += v
        return out

    def continuations(self, batch: DraftBatch, k: int, min_prob: float | None = None) -> list[Match]:
        """Per row: its `Match` (after indexing the batch's new tokens); min_prob defaults to the drafter's."""
        gate = self.min_prob if min_prob is None else min_prob
        ids, running = [], {}
        for b, toks in enumerate(batch.tokens):  # index everything new first, so siblings see each other
            key = (int(batch.seeds[b]) << 32) ^ int(batch.request_ids[b])
            gid = batch.group_ids[b]
            running.setdefault(gid, set()).add(key)
            g = self._group(gid)
            sid = g.extend(key, toks)
            if sid is not None and (gid, sid) not in self._order:
                self._order[(gid, sid)] = None
                if self.max_history is not None and len(g.seqs) > self.max_history:  # the prompt's oldest goes
                    self._evict(gid, next(iter(g.seqs)), running)
            ids.append(sid)
        self._fit_tokens(running)
        ids = [sid if sid is None or sid in self._group(gid).seqs else None
               for sid, gid in zip(ids, batch.group_ids, strict=True)]
        return [self._group(batch.group_ids[b]).continuation(ids[b], toks, k, gate)
                for b, toks in enumerate(batch.tokens)]

    def propose(self, batch: DraftBatch, k: int) -> Proposal:
        prop = ragged_proposal([m.tokens for m in self.continuations(batch, k)], k)
        return Proposal(prop.tokens, None, prop.num_drafts, from_history=prop.num_drafts > 0)

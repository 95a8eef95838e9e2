"""The engine's sequence bookkeeping: one `Sequence` per request (prompt, sampling parameters, request and group ids,
the tokens, behaviour log-probs and policy versions emitted so far, why it finished), built from the protocol's
requests by `make_sequences` (validated against the vocabulary and the context budget), the per-row tensors of their
sampling parameters (`param_tensors`), the context length of a batch (`context_length`), a ragged proposal cut to
its longest real draft (`trim`) and the protocol's outputs in request order (`outputs`). `specrl.rollout.engine`
decodes; this module keeps the books.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
from torch import Tensor

from specrl.rollout.drafter import Proposal
from specrl.rollout.protocol import RolloutOutput, RolloutRequest, normalize_requests
from specrl.rollout.sampling import SamplingParams


@dataclass
class Sequence:
    """One request in the engine: its prompt, sampling parameters, ids and what it has emitted so far."""

    index: int
    prompt: list[int]
    params: SamplingParams
    request_id: int
    group_id: int
    out: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    versions: list[int] = field(default_factory=list)  # per emitted token: the policy version that produced it
    finish_reason: str | None = None

    @property
    def tokens(self) -> list[int]:
        return self.prompt + self.out

    def emit(self, tok: int, lp: float, version: int) -> bool:
        """Append one token (produced by policy `version`); return True if the sequence is now finished."""
        self.out.append(tok)
        self.logprobs.append(lp)
        self.versions.append(version)
        if tok in self.params.stop_token_ids:
            self.finish_reason = "stop"
        elif len(self.out) >= self.params.max_new_tokens:
            self.finish_reason = "length"
        return self.finish_reason is not None


def make_sequences(requests: list[RolloutRequest] | list[list[int]], params: SamplingParams | list[SamplingParams],
                   vocab_size: int, max_seq_len: int) -> list[Sequence]:
    """The requests as sequences, checked (token ids within the vocabulary, prompt + max_new_tokens within
    max_seq_len); a request without a group id is grouped by its prompt (samples of one prompt are siblings, across
    calls too)."""
    reqs, plist = normalize_requests(requests, params, vocab_size, max_seq_len, "max_seq_len", "raise max_seq_len")
    return [Sequence(i, r.prompt_token_ids, sp, int(r.request_id),
                     int(hash(tuple(r.prompt_token_ids)) if r.group_id is None else r.group_id))
            for i, (r, sp) in enumerate(zip(reqs, plist, strict=True))]


def context_length(active: list[Sequence]) -> int:
    """The longest sequence of a batch, prompt and output."""
    return max(len(s.prompt) + len(s.out) for s in active)


def param_tensors(seqs: list[Sequence]) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor]:
    """Per row: seed, request id, temperature, top-p, top-k."""
    seeds = torch.tensor([s.params.seed for s in seqs], dtype=torch.long)
    rids = torch.tensor([s.request_id for s in seqs], dtype=torch.long)
    temp = torch.tensor([float(s.params.temperature) for s in seqs])
    top_p = torch.tensor([float(s.params.top_p) for s in seqs])
    top_k = torch.tensor([s.params.top_k for s in seqs], dtype=torch.long)
    return seeds, rids, temp, top_p, top_k


def outputs(seqs: list[Sequence], version: int) -> list[RolloutOutput]:
    """The protocol's outputs in request order; a sequence's version is its oldest token's (`version` if none)."""
    return [RolloutOutput(s.out, s.logprobs, s.finish_reason or "length", s.index, min(s.versions, default=version),
                          s.versions) for s in seqs]


def trim(proposal: Proposal) -> Proposal:
    """A ragged proposal cut to its longest real draft (None num_drafts where every row is full)."""
    nd = proposal.num_drafts
    if nd is None:
        return proposal
    kv = int(nd.max()) if nd.numel() else 0
    probs = proposal.probs[:, :kv] if proposal.probs is not None else None
    return Proposal(proposal.tokens[:, :kv], probs, None if bool((nd == kv).all()) else nd, proposal.from_history)

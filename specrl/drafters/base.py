"""The drafter protocol: drafters only propose; the engine verifies (see `specrl.rollout.verify`).

A drafter sees the active batch as a `DraftBatch` (sequences in engine slots 0..n-1, their tokens so far,
sampling parameters and the position-keyed noise) and returns a `Proposal`: k tokens per sequence and, for
drafters that sample from a full distribution, the processed probabilities q of every drafted position.
Deterministic drafters (n-gram, suffix, argmax drafting) return `probs=None`, meaning one-hot q.
Drafters with state (a KV cache, hidden features) keep it in step through the hooks: `on_prefill` when new
sequences enter slots, `on_verified` after each verification (with the captured target hidden states when
`target_layers` is non-empty), and `compact`/`move_slot` when the engine compacts its batch.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
from torch import Tensor

from specrl.errors import SpecRLError
from specrl.rollout.sampling import (
    STREAM_DRAFT,
    STREAM_SAMPLE,
    probs_from_logits,
    sample_inverse_cdf,
    uniform,
)


@dataclass
class DraftBatch:
    tokens: list[list[int]]  # per active sequence: prompt + generated tokens so far
    positions: Tensor  # [n] position of the first token to draft (= current length)
    seeds: Tensor  # [n]
    request_ids: Tensor  # [n]
    group_ids: list[int]  # [n] sequences sharing a prompt share a group id (suffix drafting)
    temperature: Tensor  # [n]
    top_p: Tensor  # [n]
    top_k: Tensor  # [n]
    verify_mode: str = "rejection"
    meta: dict = field(default_factory=dict)

    @property
    def size(self) -> int:
        return len(self.tokens)

    def noise(self, offset: int) -> Tensor:
        """The uniforms a sampling drafter uses for the token at positions + offset.

        In seed_exact mode this is the policy's own sampling noise (so a good drafter reproduces the
        policy's token); in rejection mode it is an independent stream.
        """
        stream = STREAM_SAMPLE if self.verify_mode == "seed_exact" else STREAM_DRAFT
        return uniform(self.seeds, self.request_ids, self.positions + offset, stream)

    def sample(self, logits: Tensor, offset: int) -> tuple[Tensor, Tensor]:
        """Process drafter logits [n, V] with each request's T/top-p/top-k and draw one token each."""
        q = probs_from_logits(logits, self.temperature, self.top_p, self.top_k)
        return sample_inverse_cdf(q, self.noise(offset)), q


@dataclass
class Proposal:
    tokens: Tensor  # [n, k] long
    probs: Tensor | None = None  # [n, k, V] processed q, or None for one-hot drafts


class Drafter:
    """Base class; subclasses implement `propose` and, if stateful, the hooks."""

    kind: str = "base"
    target_layers: tuple[int, ...] = ()  # target hidden states this drafter needs from verify forwards
    # seconds of the last `propose` spent catching up on tokens emitted by plain (k=0) steps: the deferred cost of
    # those steps, which the adaptive draft length does not charge to the speculative step that pays it
    catch_up_seconds: float = 0.0

    def bind(self, engine) -> None:
        """Called once by the engine: check compatibility with the target, allocate state."""

    def on_prefill(self, slot_start: int, batch_tokens: list[list[int]], captured: dict | None) -> None:
        """New sequences entered slots slot_start.. with these prompts (target prefill done)."""

    def propose(self, batch: DraftBatch, k: int) -> Proposal:
        raise NotImplementedError

    def on_verified(self, batch: DraftBatch, proposal: Proposal, num_emitted: Tensor,
                    captured: dict | None) -> None:
        """The engine kept num_emitted[b] tokens of row b (accepted drafts + one policy token)."""

    def move_slot(self, src: int, dst: int) -> None:
        """The engine moved the sequence in slot src to slot dst."""

    def compact(self, order: list[int]) -> None:
        """Slots order[0], order[1], ... became slots 0, 1, ... (order is increasing, so moving one at a
        time in ascending destination order never overwrites a source still to be read)."""
        for dst, src in enumerate(order):
            if src != dst:
                self.move_slot(src, dst)

    def on_finished(self, tokens: list[int], group_id: int) -> None:
        """A sequence finished (suffix drafters index it for later rollouts of the same prompt)."""


def pad_proposals(rows: list[list[int]], k: int, fill: Tensor | None = None) -> Tensor:
    """[n, k] tensor from ragged proposals; short rows are padded (with `fill` or token 0)."""
    out = torch.zeros(len(rows), k, dtype=torch.long) if fill is None else fill.clone()
    for b, r in enumerate(rows):
        if r:
            out[b, : len(r)] = torch.tensor(r[:k], dtype=torch.long)
    return out


def check_draft_vocab(draft_vocab, vocab_size: int, where: str = "draft_vocab") -> torch.Tensor:
    """Target token ids as a 1-D long tensor; a clear error for empty, out-of-range or repeated ids."""
    try:
        d2t = torch.as_tensor(draft_vocab, dtype=torch.long).flatten()
    except (TypeError, ValueError, RuntimeError) as e:
        raise SpecRLError(f"{where} must be a list of integer token ids ({e})") from None
    if d2t.numel() == 0:
        raise SpecRLError(f"{where} is empty; give the target token ids the drafter may propose")
    if int(d2t.min()) < 0 or int(d2t.max()) >= vocab_size:
        raise SpecRLError(f"{where} has ids outside the target vocabulary [0, {vocab_size})")
    if d2t.unique().numel() != d2t.numel():
        raise SpecRLError(f"{where} has repeated token ids")
    return d2t


def full_vocab_logits(red: Tensor, d2t: Tensor | None, vocab: int) -> Tensor:
    """Scatter reduced-vocabulary logits [..., Vd] into [..., V] with -inf outside the subset."""
    if d2t is None:
        return red.float()
    out = red.new_full((*red.shape[:-1], vocab), float("-inf"), dtype=torch.float32)
    out[..., d2t] = red.float()
    return out

"""Helpers every drafter kind shares; the drafter protocol itself is the engine's (`specrl.rollout.drafter`).

Re-exports `Drafter`, `DraftBatch`, `Proposal` and `BindContext` from the rollout layer, and owns what several
drafters need on top: padding ragged proposals, validating a reduced draft vocabulary, and scattering
reduced-vocabulary logits back to the full vocabulary.
"""

from __future__ import annotations

import torch
from torch import Tensor

from specrl.errors import SpecRLError
from specrl.rollout.drafter import BindContext, Drafter, DraftBatch, Proposal

__all__ = ["BindContext", "Drafter", "DraftBatch", "Proposal", "pad_proposals", "check_draft_vocab",
           "full_vocab_logits"]


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

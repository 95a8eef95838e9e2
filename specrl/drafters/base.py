"""Helpers every drafter kind shares; the drafter protocol itself is the engine's (`specrl.rollout.drafter`).

Re-exports `Drafter`, `DraftBatch`, `Proposal` and `BindContext` from the rollout layer, and owns what several
drafters need on top: padding ragged proposals (and marking the padding: `ragged_proposal`); validating a reduced
draft vocabulary, mapping it both ways (draft index -> target id is `d2t`, target id -> draft index is
`target_to_draft`) and scattering reduced-vocabulary logits back to the full vocabulary; and the decoder-layer
plumbing of the feature drafters (EAGLE, MTP): their layer architecture, RoPE, cached layer forwards, the
target-shape check and slot compaction.
"""

from __future__ import annotations

import torch
from torch import Tensor, nn

from specrl.errors import SpecRLError
from specrl.model.transformer import Block, KVCache, ModelArgs, _rope_inv_freq, cache_mask, rope_cos_sin
from specrl.rollout.drafter import BindContext, DraftBatch, Drafter, Proposal

__all__ = ["BindContext", "Drafter", "DraftBatch", "Proposal", "pad_proposals", "ragged_proposal", "check_draft_vocab",
           "is_full_vocab", "target_to_draft", "full_vocab_logits", "draft_layer_args", "Rope", "cached_block",
           "cached_kv", "check_target", "compact_slots"]

OUTSIDE_DRAFT_VOCAB = -1  # `target_to_draft` entry of a target token the draft vocabulary lacks


def pad_proposals(rows: list[list[int]], k: int, fill: Tensor | None = None) -> Tensor:
    """[n, k] tensor from ragged proposals; short rows are padded (with `fill` or token 0)."""
    out = torch.zeros(len(rows), k, dtype=torch.long) if fill is None else fill.clone()
    for b, r in enumerate(rows):
        if r:
            out[b, : len(r)] = torch.tensor(r[:k], dtype=torch.long)
    return out


def ragged_proposal(rows: list[list[int]], k: int) -> Proposal:
    """A one-hot `Proposal` from ragged rows (each up to k real drafts): padded to [n, k] with token 0, with
    `num_drafts` telling the engine which columns are real (padding is neither verified as a draft nor counted)."""
    return Proposal(pad_proposals(rows, k), num_drafts=torch.tensor([min(len(r), k) for r in rows], dtype=torch.long))


# ---------------------------------------------------------------------------------------------- draft vocabulary
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


def is_full_vocab(d2t: Tensor, vocab_size: int) -> bool:
    """Whether the draft vocabulary d2t is the whole target vocabulary in order (no reduction at all)."""
    return d2t.numel() == vocab_size and bool((d2t == torch.arange(vocab_size, device=d2t.device)).all())


def target_to_draft(d2t: Tensor, vocab_size: int) -> Tensor:
    """The inverse lookup of d2t: [vocab_size] long, each target id's draft index (OUTSIDE_DRAFT_VOCAB if none)."""
    t2d = torch.full((vocab_size,), OUTSIDE_DRAFT_VOCAB, dtype=torch.long, device=d2t.device)
    t2d[d2t] = torch.arange(d2t.numel(), device=d2t.device)
    return t2d


def full_vocab_logits(red: Tensor, d2t: Tensor | None, vocab: int) -> Tensor:
    """Scatter reduced-vocabulary logits [..., Vd] into [..., V] with -inf outside the subset."""
    if d2t is None:
        return red.float()
    out = red.new_full((*red.shape[:-1], vocab), float("-inf"), dtype=torch.float32)
    out[..., d2t] = red.float()
    return out


# ---------------------------------------------------------------------------------------------- feature drafters
def draft_layer_args(target: ModelArgs, num_layers: int, intermediate_size: int | None = None) -> ModelArgs:
    """Architecture of drafter decoder layers: the target's attention shape, plain Llama blocks."""
    return ModelArgs(arch="llama", vocab_size=target.vocab_size, hidden_size=target.hidden_size,
                     intermediate_size=intermediate_size or target.intermediate_size, num_layers=num_layers,
                     num_heads=target.num_heads, num_kv_heads=target.num_kv_heads, head_dim=target.head_dim,
                     rms_norm_eps=target.rms_norm_eps, rope_theta=target.rope_theta,
                     rope_scaling=target.rope_scaling, tie_word_embeddings=False, attention_bias=False,
                     qk_norm=False, max_position_embeddings=target.max_position_embeddings)


class Rope(nn.Module):
    """Rotary cos/sin; inv_freq stays float32 whatever dtype the drafter is cast to (not a buffer)."""

    def __init__(self, args: ModelArgs):
        super().__init__()
        self.inv_freq = _rope_inv_freq(args)

    def forward(self, pos: Tensor, dtype: torch.dtype) -> tuple[Tensor, Tensor]:
        return rope_cos_sin(self.inv_freq, pos, dtype)


def cached_block(block: Block, rope: Rope, x: Tensor, pos: Tensor, cache: KVCache, layer: int) -> Tensor:
    """One block over x [n,T,H] at positions pos [n,T], writing/reading cache slots 0..n-1 (a view)."""
    cos, sin = rope(pos, x.dtype)
    mask, kv_len = cache_mask(pos)
    return block(x, cos, sin, mask, layer, cache, pos, kv_len)


def cached_kv(block: Block, rope: Rope, x: Tensor, pos: Tensor, cache: KVCache, layer: int) -> None:
    """Write only the keys/values `cached_block` would write for x at pos: no attention, no MLP.

    In a one-layer drafter an entry's K/V depend on its own input alone, so entries whose output is not needed
    (the prompt, and all but the last entry of a catch-up) only have to land in the cache.
    """
    cos, sin = rope(pos, x.dtype)
    block.store_kv(x, cos, sin, cache, layer, pos)


def check_target(kind: str, cfg: dict, target_args: ModelArgs) -> None:
    """Raise a SpecRLError when a drafter config was made for a different target."""
    for key, name in (("hidden_size", "hidden size"), ("vocab_size", "vocabulary size"),
                      ("num_heads", "number of attention heads"), ("num_kv_heads", "number of KV heads"),
                      ("head_dim", "head dim")):
        if key in cfg and int(cfg[key]) != int(getattr(target_args, key)):
            raise SpecRLError(f"this {kind} drafter was made for a target with {name} {cfg[key]}, but the "
                              f"target has {name} {getattr(target_args, key)}; train a drafter for this target "
                              "(`specrl draft init`)")


def compact_slots(order: list[int], cache: KVCache, length: int, per_slot: tuple[Tensor, ...]) -> None:
    """The drafter side of `Drafter.compact`: slots order[i] move to slots i, in one gather per tensor.

    `cache` keeps its first `length` positions (capped at its size); every tensor of `per_slot` is indexed by
    slot along its first dimension.
    """
    cache.compact(order, min(cache.max_seq_len, length))
    src = torch.tensor(order)
    for t in per_slot:
        t[: len(order)] = t[src.to(t.device)]

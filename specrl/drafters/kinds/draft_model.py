"""Draft-model drafter: a smaller LM with the same tokenizer proposes k tokens autoregressively.

It keeps its own slot-indexed KV cache in step with the engine: `cached[slot]` counts the sequence's tokens
already in the drafter's cache. A proposal first catches up on the tokens the engine emitted since (one
ragged batched forward), then drafts k tokens one forward at a time, sampling each from its processed
distribution q with the request's position-keyed noise (`DraftBatch.sample`). After verification only the
accepted drafts stay valid; stale cache entries are never read because attention masks by position.

With `draft_vocab` (target token ids, e.g. the most frequent ones in the training data) the drafter scores only
those rows of its LM head: on models whose vocabulary is large next to their width (SmolLM2: a 49k x 576 head
costs as much as 8 of its layers) this cuts a draft forward by more than half. q is then the draft model's
distribution renormalised over the subset (zero elsewhere), which verification handles like any other q, so
decoding stays exact. `specrl draft init --drafter draft-model` stores the subset as `draft_vocab.json` next to
the checkpoint; transformers ignores that file.
"""

from __future__ import annotations

import json
import os
import time
from pathlib import Path

import torch

from specrl.drafters.base import BindContext, DraftBatch, Drafter, Proposal, check_draft_vocab, full_vocab_logits
from specrl.drafters.trainable import TrainableDrafter
from specrl.errors import SpecRLError


def slice_layers(target, layers: list[int] | tuple[int, ...]):
    """A draft model made of some of the target's layers (+ its embeddings, final norm and LM head).

    The copy is independent of the target (training it never touches the target). `layers` are target layer
    indices in increasing order, e.g. `range(4)` for the first four ("layer skip" draft) before distillation.
    """
    import copy
    import dataclasses

    from torch import nn

    n = target.args.num_layers
    layers = [int(i) for i in layers]
    if not layers:
        raise SpecRLError("a sliced draft model needs at least one layer; give target layer indices, e.g. [0, 1, 2, 3]")
    if any(i < 0 or i >= n for i in layers) or layers != sorted(set(layers)):
        raise SpecRLError(f"draft layers {layers} must be distinct, increasing target layer indices in [0, {n})")
    draft = copy.deepcopy(target)
    draft.layers = nn.ModuleList(draft.layers[i] for i in layers)
    draft.args = dataclasses.replace(target.args, num_layers=len(layers))
    return draft


DRAFT_VOCAB_FILE = "draft_vocab.json"
SPEC_STEP_TAIL = 2  # tokens a speculative step leaves outside the drafter's cache at most (more: a plain-step backlog)
TOKENIZER_FILES = ("special_tokens_map.json", "vocab.json", "merges.txt", "generation_config.json")


def save_draft_model(draft, model: str | os.PathLike, out: Path) -> None:
    """The draft model as an HF checkpoint plus the target's tokenizer files (so both we and transformers load it)."""
    import shutil

    from specrl.model import presets
    from specrl.model.hf_checkpoint import save_hf_checkpoint

    save_hf_checkpoint(draft, out)
    src = Path(model) if Path(model).exists() else presets.prepare(str(model))
    for f in src.iterdir():
        if f.is_file() and (f.name.startswith("tokenizer") or f.name in TOKENIZER_FILES):
            shutil.copy2(f, out / f.name)


class DraftModelDrafter(Drafter, TrainableDrafter):
    kind = "draft-model"

    def __init__(self, draft_model, draft_vocab=None):
        self.model = draft_model
        self.d2t = None if draft_vocab is None else check_draft_vocab(draft_vocab, draft_model.args.vocab_size)
        self._head: torch.Tensor | None = None
        self.cache = None
        self.cached: list[int] = []

    # ---------------------------------------------------------------- training (TrainableDrafter)
    @property
    def training_module(self):
        """The draft model (its embeddings / LM head train only if they require grad)."""
        return self.model

    def training_features(self, captured: dict, hidden: torch.Tensor) -> torch.Tensor:
        """No target features: a draft model reads the tokens alone."""
        return hidden[..., :0]

    def prepare_training(self, target) -> None:
        if self.model.args.vocab_size != target.args.vocab_size:
            raise SpecRLError(f"the draft model's vocabulary has {self.model.args.vocab_size} tokens but the "
                              f"target's has {target.args.vocab_size}; a draft model must share the target's tokenizer")

    def training_loss(self, batch: dict, ttt_steps: int) -> tuple[torch.Tensor, dict]:
        """Position t (tokens x_0..x_t) predicts the target distribution at t, over the full vocabulary."""
        tok, lens, loss_from = batch["tokens"], batch["len"], batch["loss_from"]
        pos = torch.arange(tok.shape[1], device=tok.device)[None, :]
        # index t (tokens x_0..x_t) predicts x_{t+1} with the target's distribution at t; logits only where counted
        valid = (pos <= lens[:, None] - 2) & (pos + 1 >= loss_from[:, None])
        hidden, _ = self.model.forward_hidden(tok)
        logits = self.model.logits(hidden[valid])
        ce = self.distill_loss(logits, batch["top_idx"][valid], batch["top_p"][valid])
        stats = {"positions": int(valid.sum()), "top1": int((logits.argmax(-1) == batch["top1"][valid]).sum())}
        return ce.sum() / valid.sum().clamp_min(1), stats

    @classmethod
    def check_build(cls, target, *, draft_layers: int = 4, **options) -> None:
        if not (isinstance(draft_layers, int) and 1 <= draft_layers < target.args.num_layers):
            raise SpecRLError(f"draft_layers must be an integer in [1, {target.args.num_layers - 1}] (the target "
                              f"has {target.args.num_layers} layers), got {draft_layers!r}")

    @classmethod
    def untrained(cls, target, *, draft_vocab=None, num_modules: int = 3, draft_layers: int = 4):
        """The target's first `draft_layers` layers; it trains over the full vocabulary (see `after_training`)."""
        draft = slice_layers(target, range(draft_layers)).float()
        draft.embed_tokens.weight.requires_grad_(False)  # tied to the LM head: keep the target's token geometry
        return cls(draft)

    def after_training(self, draft_vocab):
        """Trained over the full vocabulary, it drafts over `draft_vocab` (None: the full one)."""
        return self if draft_vocab is None else DraftModelDrafter(self.model, draft_vocab=draft_vocab)

    def build_report(self) -> dict:
        return {"draft_layers": self.model.args.num_layers}

    def save_built(self, out: Path, target, model: str | os.PathLike) -> None:
        """An HF checkpoint with the target's tokenizer (loadable by transformers as an `assistant_model` too),
        and the draft vocabulary as `draft_vocab.json`."""
        save_draft_model(self.model.to(target.dtype), model, out)
        if self.d2t is not None:
            (out / DRAFT_VOCAB_FILE).write_text(json.dumps([int(t) for t in self.d2t]))

    def bind(self, ctx: BindContext) -> None:
        t, d = ctx.target.args, self.model.args
        if t.vocab_size != d.vocab_size:
            raise SpecRLError(f"draft model vocab size {d.vocab_size} differs from the target's {t.vocab_size}; "
                              "a draft model must share the target's tokenizer and vocabulary")
        self.cache = self.model.new_cache(ctx.max_batch_size, ctx.cache_len)
        self.cached = [0] * ctx.max_batch_size
        if self.d2t is not None:  # the head rows of the subset, gathered once (the weights are frozen here)
            self.d2t = self.d2t.to(self.model.lm_head.weight.device)
            self._head = self.model.lm_head.weight.detach()[self.d2t].contiguous()

    def _logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """Full-vocabulary logits [n, V] (-inf outside the draft vocabulary, if there is one)."""
        if self._head is None:
            return self.model.logits(hidden)
        return full_vocab_logits(hidden @ self._head.T, self.d2t, self.model.args.vocab_size)

    @torch.no_grad()
    def _run(self, rows: list[list[int]], starts: list[int], slot0: int = 0) -> torch.Tensor:
        """Feed ragged token rows into slots slot0.. from positions `starts`; return the hidden states [n, m, H].

        Short rows are padded; the padding writes keys/values past the row's end, which are rewritten before any
        query reads them (a query at p reads keys <= p only), clamped to the cache's last position (never a real
        entry: the engine keeps k_max + 1 positions of margin)."""
        n, m = len(rows), max(len(r) for r in rows)
        toks = torch.zeros(n, m, dtype=torch.long)
        for b, r in enumerate(rows):
            toks[b, : len(r)] = torch.tensor(r, dtype=torch.long)
        pos = (torch.tensor(starts)[:, None] + torch.arange(m)[None, :]).clamp_max(self.cache.max_seq_len - 1)
        h, _ = self.model.forward_hidden(toks, pos, self.cache.slots(slot0, slot0 + n))
        return h

    def _feed(self, rows: list[list[int]], starts: list[int]) -> torch.Tensor:
        """Feed ragged token rows for slots 0..n-1 starting at positions `starts`; logits at each row's end."""
        h = self._run(rows, starts)
        last = h[torch.arange(len(rows)), torch.tensor([len(r) - 1 for r in rows])]
        return self._logits(last)

    @torch.no_grad()
    def on_prefill(self, slot_start, batch_tokens, captured) -> None:
        rows = [t[:-1] for t in batch_tokens]
        self._run(rows, [0] * len(rows), slot_start)
        for b, r in enumerate(rows):
            self.cached[slot_start + b] = len(r)

    @torch.no_grad()
    def propose(self, batch: DraftBatch, k: int) -> Proposal:
        n = batch.size
        rows = [toks[self.cached[b]:] for b, toks in enumerate(batch.tokens)]
        starts = self.cached[:n]
        self.catch_up_seconds = 0.0
        if max(len(r) for r in rows) > SPEC_STEP_TAIL:  # a backlog from plain (k=0) steps
            t0 = time.perf_counter()
            back = [r[:-1] for r in rows]
            self._run(back, starts)
            starts = [s + len(r) for s, r in zip(starts, back, strict=True)]
            rows = [r[-1:] for r in rows]
            self.catch_up_seconds = time.perf_counter() - t0
        logits = self._feed(rows, starts)
        tokens, probs = [], []
        for i in range(k):
            tok, q = batch.sample(logits, i)
            tokens.append(tok)
            probs.append(q)
            if i + 1 < k:
                pos = (batch.positions + i)[:, None]
                h, _ = self.model.forward_hidden(tok[:, None], pos, self.cache.slots(0, n))
                logits = self._logits(h[:, -1])
        for b in range(n):
            self.cached[b] = len(batch.tokens[b]) + k - 1  # x_1..x_{k-1} are in the cache (tentatively)
        return Proposal(torch.stack(tokens, 1), torch.stack(probs, 1))

    def on_verified(self, batch, proposal, num_emitted, captured) -> None:
        if proposal is None:
            return
        k = proposal.tokens.shape[1]
        for b in range(batch.size):
            self.cached[b] = len(batch.tokens[b]) + min(int(num_emitted[b]) - 1, k - 1)

    def compact(self, order: list[int]) -> None:
        self.cache.compact(order, max(self.cached[i] for i in order))
        self.cached[: len(order)] = [self.cached[i] for i in order]

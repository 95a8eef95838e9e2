"""Parallel drafter: EAGLE-3's layer drafting all k tokens in ONE forward, from learned placeholder entries.

The head is an EAGLE-3 head (`eagle.py`: the three fused target layers, one `Eagle3Block`, its own LM head over a
draft vocabulary, the target's frozen embedding) plus `max_k - 1` learned placeholder entries, each a [embedding;
hidden] pair (2H) that stands where a not-yet-known token and its feature would be (P-EAGLE's mask positions), its
hidden part added to the feature of the forward's last context entry. At sequence length n its context is the
entries (g_t, x_{t+1}) for t <= n-2, kept in the same slot-indexed KV cache EAGLE keeps; one forward of the layer
over [entry n-2, placeholder 1, ..., placeholder k-1] at positions n-2 .. n+k-3 (causal over the cache and each
other) gives k output states, and output i draws draft i+1 with its probabilities q at the run's sampling settings,
exactly as EAGLE's drafts do. So a verify step costs one drafter forward whatever k is, instead of EAGLE's k; the
drafts never see each other's tokens, only the placeholders' positions. Placeholder entries sit past the verified
length and are overwritten before they can be read, as EAGLE's drafted entries are, so rollback is free; the
pending-feature bookkeeping is EAGLE's. `forward_parallel` is the same computation for every anchor of a training
sequence at once (`training_loss`: output i at anchor t learns the target's distribution of x_{t+2+i}, weighted
DEPTH_WEIGHT^i), and tests compare what the engine drafted with it. A head drafts at most `max_k` tokens per
forward; a larger k is refused naming that maximum. With `markov` (DSpark's Markov head), draft i+1's output state
also reads draft i's token before the LM head: h + W_down(silu(W_gate x) * W_up x) with x = [norm(h); embed(draft
i)], a gated MLP of width H/2 (W_down starts at zero, so a fresh mix changes nothing); the layer still runs once per
verify step, the k draws become sequential, and training feeds the sequence's own previous token.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from specrl.drafters.base import DraftBatch, Proposal, cached_block
from specrl.drafters.kinds.eagle import TTT_STEP_WEIGHT, EagleDrafter
from specrl.errors import SpecRLError
from specrl.model.transformer import RMSNorm

DEFAULT_MAX_K = 7  # drafts per forward of a fresh head: its last context entry + 6 placeholders
DEPTH_WEIGHT = TTT_STEP_WEIGHT  # draft i's share of the loss weighs DEPTH_WEIGHT ** (i - 1), as EAGLE's TTT steps
PLACEHOLDER_INIT_STD = 0.02


def _check_max_k(max_k, where: str = "max_k") -> int:
    if not isinstance(max_k, int) or isinstance(max_k, bool) or max_k < 1:
        raise SpecRLError(f"{where} must be an integer >= 1 (the most tokens the parallel head drafts per forward, "
                          f"e.g. {DEFAULT_MAX_K}), got {max_k!r}")
    return max_k


def _check_markov(markov, where: str = "markov") -> bool:
    if not isinstance(markov, bool):
        raise SpecRLError(f"{where} must be true or false (whether each draft after the first reads the token "
                          f"drafted before it), got {markov!r}")
    return markov


class MarkovMix(nn.Module):
    """h + W_down(silu(W_gate x) * W_up x), x = [norm(h); e]: a draft's output state h [..., H] corrected by the
    embedding e [..., H] of the token drafted before it. W_down starts at zero: a fresh mix is the identity."""

    def __init__(self, hidden_size: int, eps: float):
        super().__init__()
        width = hidden_size // 2
        self.norm = RMSNorm(hidden_size, eps)
        self.gate = nn.Linear(2 * hidden_size, width, bias=False)
        self.up = nn.Linear(2 * hidden_size, width, bias=False)
        self.down = nn.Linear(width, hidden_size, bias=False)
        nn.init.zeros_(self.down.weight)

    def forward(self, hidden: Tensor, prev_embed: Tensor) -> Tensor:
        x = torch.cat([self.norm(hidden), prev_embed.to(hidden.dtype)], dim=-1)
        return hidden + self.down(F.silu(self.gate(x)) * self.up(x))


def _ahead(x: Tensor, s: int, fill: float) -> Tensor:
    """x [B, T, ...] shifted s positions left along T, the last s positions `fill`."""
    out = torch.full_like(x, fill)
    if s < x.shape[1]:
        out[:, : x.shape[1] - s] = x[:, s:]
    return out


class ParallelDrafter(EagleDrafter):
    kind = "parallel"
    training_methods = ("fuse_concat", "forward_parallel", "head")
    unrolls_steps = False
    takes_markov = True
    CONFIG_FIELDS = (*EagleDrafter.CONFIG_FIELDS, "max_k")

    def __init__(self, target, layers: tuple[int, ...] | list[int] | None = None,
                 draft_vocab: list[int] | Tensor | None = None, intermediate_size: int | None = None,
                 max_k: int = DEFAULT_MAX_K, markov: bool = False):
        _check_max_k(max_k)
        _check_markov(markov)
        super().__init__(target, layers=layers, draft_vocab=draft_vocab, intermediate_size=intermediate_size)
        self._set_max_k(max_k)
        self._set_markov(markov)
        with torch.no_grad():
            self.placeholders.normal_(0.0, PLACEHOLDER_INIT_STD)

    def _set_markov(self, markov: bool) -> None:
        a = self.target_args
        self.markov = MarkovMix(a.hidden_size, a.rms_norm_eps).to(self.device, self.dtype) if markov else None

    def mix(self, hidden: Tensor, prev_tokens: Tensor) -> Tensor:
        """Output states [..., H] of drafts after the first, given the tokens drafted before them [...]: the
        Markov mix with `markov`, the states unchanged without."""
        return hidden if self.markov is None else self.markov(hidden, self.embed(prev_tokens))

    def _set_max_k(self, max_k: int) -> None:
        self.max_k = max_k
        # row i: the [embedding; hidden] input of the entry that drafts token i+2 of a forward
        self.placeholders = nn.Parameter(torch.zeros(max_k - 1, 2 * self.target_args.hidden_size,
                                                     dtype=self.dtype, device=self.device))

    def config(self) -> dict:
        return {**super().config(), "max_k": self.max_k, "markov": self.markov is not None}

    # ---------------------------------------------------------------- training
    def forward_parallel(self, fused: Tensor, tokens: Tensor, depths: int | None = None,
                         start: int = 0) -> list[Tensor]:
        """Output hidden states [B, T-start, H] of drafts 1..depths (default max_k) at the anchors t = start..T-1.

        fused [B,T,H] = g_t, tokens [B,T] = x_t. Depth 0 at anchor t is the context entry (g_t, x_{t+1}) at position
        t, attending to entries <= t; depth i >= 1 at anchor t is placeholder i of the forward whose context ends at
        entry t: position t+i, attending to entries <= t and to placeholders 1..i of the same anchor, exactly what
        `propose` computes over its cache. Depth i at t predicts x_{t+2+i}; the last index's token is a pad. Each
        placeholder attends to the context keys of its anchor and to its anchor's own placeholders in one softmax
        (no key blocks of other anchors). Anchors before `start` (prompt positions no loss reads) are context only:
        no queries, no MLP.
        """
        depths = self.max_k if depths is None else depths
        if not 1 <= depths <= self.max_k:
            raise SpecRLError(f"depths={depths}: this parallel head drafts 1..{self.max_k} tokens per forward")
        blk, att = self.block, self.block.self_attn
        b, t = tokens.shape
        if not 0 <= start < t:
            raise SpecRLError(f"start={start}: the first anchor must be a position of the {t}-token sequences")
        nxt = torch.cat([tokens[:, 1:], tokens.new_zeros(b, 1)], dim=1)
        anchors = torch.arange(start, t, device=tokens.device)
        visible = torch.arange(t, device=tokens.device)[None, :] <= anchors[:, None]  # [A, T] context keys
        attn_in, h = blk._split(self.layer_input(fused, nxt))
        cos, sin = self.rope(torch.arange(t, device=tokens.device).expand(b, t), self.dtype)
        q, k0, v0 = att.project(attn_in, cos, sin)
        ctx = (k0[:, :, None], v0[:, :, None])  # [B, kv_heads, 1, T, d]: broadcast over each group's heads
        outs = [self._finish(h[:, start:], self._attend(q[:, :, start:], ctx, visible, [], []))]
        ks: list[Tensor] = []
        vs: list[Tensor] = []
        for i in range(1, depths):
            x = self._placeholder_input(fused[:, start:], i - 1, i)[:, :, 0]  # [B, A, 2H]
            attn_in, h = blk._split(x)
            cos, sin = self.rope((anchors + i)[None], self.dtype)
            q, k, v = att.project(attn_in, cos, sin)  # [B, heads | kv_heads, A, d]
            ks.append(k)
            vs.append(v)
            outs.append(self._finish(h, self._attend(q, ctx, visible, ks, vs)))
        return outs

    def _placeholder_input(self, anchor_feature: Tensor, first: int, last: int) -> Tensor:
        """Inputs [..., last - first, 2H] of placeholders first+1..last for anchors whose fused feature is
        `anchor_feature` [..., H]: each its learned [embedding; hidden] pair, the hidden part added to the anchor's
        feature (so a placeholder's residual stream starts where the last known entry's does, as EAGLE's does)."""
        ph = self.placeholders[first:last].to(self.dtype)
        g = anchor_feature.to(self.dtype)[..., None, :]
        return ph + torch.cat([torch.zeros_like(g), g], dim=-1)

    def _attend(self, q: Tensor, ctx: tuple[Tensor, Tensor], visible: Tensor, ks: list[Tensor],
                vs: list[Tensor]) -> Tensor:
        """o_proj(attention) of queries q [1|B, heads, A, d] over the context keys they see (`visible` [A, T]) and
        over the same anchor's placeholder keys `ks` [B, kv_heads, A, d] (one softmax over both): [B, A, H]."""
        a = self.args
        g = a.num_heads // a.num_kv_heads
        qg = q.reshape(q.shape[0], a.num_kv_heads, g, *q.shape[2:])  # [., kv_heads, group, A, d]
        scale = a.head_dim ** -0.5
        s = (qg @ ctx[0].transpose(-1, -2)) * scale  # [B, kv_heads, group, A, T]
        s = s.masked_fill(~visible, float("-inf"))
        if ks:
            kp = torch.stack(ks, dim=-2)[:, :, None]  # [B, kv_heads, 1, A, i, d]
            sp = (qg[..., None, :] * kp).sum(-1) * scale  # [., kv_heads, group, A, i]
            s = torch.cat([s, sp.expand(*s.shape[:-1], len(ks))], dim=-1)
        p = torch.softmax(s.float(), dim=-1).to(ctx[1].dtype)
        t = ctx[0].shape[-2]
        out = p[..., :t] @ ctx[1]  # [B, kv_heads, group, A, d]
        if ks:
            vp = torch.stack(vs, dim=-2)[:, :, None]  # [B, kv_heads, 1, A, i, d]
            out = out + (p[..., t:, None] * vp).sum(-2)
        b, _, _, n, d = out.shape
        return self.block.self_attn.o_proj(out.reshape(b, a.num_heads, n, d).transpose(1, 2).reshape(b, n, -1))

    def _finish(self, h: Tensor, attn: Tensor) -> Tensor:
        """The rest of `Eagle3Block.forward` after attention: residual from h, then the MLP."""
        r = h + attn
        return r + self.block.mlp(self.block.post_attention_layernorm(r))

    def training_loss(self, batch: dict, ttt_steps: int) -> tuple[Tensor, dict]:
        """Every anchor t whose drafts the engine could ask for (t + 2 >= the prompt length) learns, at each depth
        i < max_k, the target's distribution of x_{t+2+i} (`distill_loss`), weighted DEPTH_WEIGHT^i; the head runs
        only on those positions. `ttt_steps` is EAGLE's and unused: every placeholder trains."""
        tok, lens, loss_from = batch["tokens"], batch["len"], batch["loss_from"]
        start = min(max(int(loss_from.min()) - 2, 0), tok.shape[1] - 1)  # earlier anchors are context only
        pos = torch.arange(start, tok.shape[1], device=tok.device)[None, :]
        total = torch.zeros((), device=tok.device)
        stats = {"positions": 0, "top1": 0}
        weight_sum = 0.0
        for i, hidden in enumerate(self.forward_parallel(self.fuse_concat(batch["feats"]), tok, start=start)):
            # depth i at anchor t predicts x_{t+2+i}: the target's distribution at t+1+i
            tgt_i = _ahead(batch["top_idx"], 1 + i, -1)[:, start:]
            tgt_p = _ahead(batch["top_p"], 1 + i, 0.0)[:, start:]
            valid = (pos <= lens[:, None] - 2 - i) & (pos + 2 >= loss_from[:, None])
            hidden = hidden[valid]
            if i > 0:  # the token before x_{t+2+i}: x_{t+1+i}, the sequence's own (a drafted token when accepted)
                hidden = self.mix(hidden, _ahead(tok, 1 + i, 0)[:, start:][valid])
            logits = self.head(hidden)
            w = DEPTH_WEIGHT ** i
            total = total + w * self.distill_loss(logits, tgt_i[valid], tgt_p[valid]).sum() / valid.sum().clamp_min(1)
            weight_sum += w
            if i == 0:
                pred = logits.argmax(-1)
                pred = pred if self.full_vocab else self.d2t[pred]
                stats["positions"] = int(valid.sum())
                stats["top1"] = int((pred == _ahead(batch["top1"], 1, 0)[:, start:][valid]).sum())
        return total / weight_sum, stats

    @classmethod
    def untrained(cls, target, *, draft_vocab=None, num_modules: int = 3, draft_layers: int = 4,
                  max_k: int = DEFAULT_MAX_K):
        return cls(target, draft_vocab=draft_vocab, max_k=max_k)

    @classmethod
    def from_recipe(cls, target, recipe, draft_vocab=None):
        return cls(target, draft_vocab=draft_vocab, max_k=recipe.max_k, markov=recipe.markov)

    def checkpoint_setting(self) -> dict:
        return {"kind": self.kind, "max_k": self.max_k, "markov": self.markov is not None}

    # ---------------------------------------------------------------- drafter directories
    @classmethod
    def from_directory(cls, target, cfg: dict, state: dict, where):
        max_k = _check_max_k(cfg["max_k"], f"{where}/config.json: max_k")
        have = state.get("placeholders")
        if have is None or have.dim() != 2 or have.shape[0] != max_k - 1:
            raise SpecRLError(f"{where}: config says max_k {max_k} (so {max_k - 1} placeholder rows) but tensor "
                              f"'placeholders' is {None if have is None else list(have.shape)}")
        markov = _check_markov(cfg.get("markov", False), f"{where}/config.json: markov")
        drafter = super().from_directory(target, cfg, state, where)
        drafter._set_max_k(max_k)
        drafter._set_markov(markov)
        return drafter

    @classmethod
    def old_format_error(cls, where, version: int, min_version: int) -> str:
        return (f"{where} is a parallel drafter of format {version}; this specrl reads format {min_version} and "
                "later. Rebuild it with `specrl draft build` (a recipe with kind parallel)")

    # ---------------------------------------------------------------- Drafter protocol
    def _draw(self, batch: DraftBatch, reduced: Tensor, offsets: Tensor) -> tuple[Tensor, Tensor]:
        """EAGLE's `_sample` from reduced-vocabulary logits [n, k, Vd] already computed, all k positions in one
        draw (each position's token and q as EAGLE draws them one at a time)."""
        if self.full_vocab:
            return batch.sample(reduced.float(), offsets)
        key = (self.d2t.device, self.d2t._version, self.d2t.data_ptr())
        if self._id_order is None or self._id_order[0] != key:
            self._id_order = (key, *self.d2t.sort())
        _, ids, order = self._id_order
        return batch.sample_subset(reduced[..., order], ids, self.target_args.vocab_size, offsets)

    def propose(self, batch: DraftBatch, k: int) -> Proposal:
        if not 1 <= k <= self.max_k:
            raise SpecRLError(f"k={k} but this parallel drafter drafts at most {self.max_k} tokens per forward (its "
                              f"max_k: the placeholders it was trained with); lower num_draft_tokens / k_max to "
                              f"<= {self.max_k}, or train a head with a larger max_k")
        n = batch.size
        if not torch.equal(self.pend_start[:n] + self.pend_cnt[:n], batch.positions - 1):
            raise RuntimeError("ParallelDrafter state is out of step with the engine (missed a hook call)")
        rows = torch.arange(n, device=self.pend.device)
        last = self.pend[rows, (self.pend_cnt[:n] - 1).to(self.pend.device)]  # entry n-2's feature
        self._catch_up(batch.tokens, n, need_output=False)  # every pending entry's keys/values
        x = self.layer_input(last[:, None], torch.tensor([[r[-1]] for r in batch.tokens], device=self.device))
        if k > 1:
            x = torch.cat([x, self._placeholder_input(last, 0, k - 1)], dim=1)
        pos = (batch.positions - 2)[:, None] + torch.arange(k)[None, :]
        out = cached_block(self.block, self.rope, x, pos.to(self.device), self.cache.slots(0, n), 0)
        if self.markov is None:
            toks, qs = self._draw(batch, self.head(out), torch.arange(k, device=batch.positions.device))
            return Proposal(toks, qs)
        # each draft after the first reads the token drawn before it: k sequential draws, q straight into [n, k, V]
        buf = None if self.full_vocab else torch.zeros(n, k, self.target_args.vocab_size, device=out.device)
        drawn, probs = [], []
        for i in range(k):
            h = out[:, i] if i == 0 else self.mix(out[:, i], drawn[-1].to(out.device))
            tok, q = self._sample(batch, h, i, None if buf is None else buf[:, i])
            drawn.append(tok)
            probs.append(q)
        return Proposal(torch.stack(drawn, 1), torch.stack(probs, 1) if buf is None else buf)

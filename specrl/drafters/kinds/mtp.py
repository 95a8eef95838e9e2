"""DeepSeek-V3 style multi-token prediction (MTP) drafter: D sequential modules on the target's last hidden.

Module j (1..D) at position t: h^j_t = Block_j(proj_j([norm(h^{j-1}_t); norm(embed(x_{t+j}))])) with causal
attention over positions, h^0 = the target's final-normed hidden state (`captured["final"]`), and its own
final norm + the target's LM head (shared, frozen, not saved) predicting x_{t+j+1}. Drafting at sequence
length n reads module j at t = n-2: draft j = x_{n+j-1}.

Each module keeps a slot-indexed KV cache (one cache layer per module). Module j's entry at t is final
once x_{t+j} is a verified token (t <= n-1-j); its frontier f_j = n - j marks the first entry that is not.
Every call (propose, or the catch-up after an autoregressive step) runs module j over [f_j, end] in one
forward: end = n-2 when drafting (entries past the frontier use drafted tokens and are recomputed next time),
n-1-j otherwise. Module j needs h^{j-1} at f_j = f_{j-1} - 1, which is why the output at each module's last
final entry is kept (`last_out`). The target hidden states of a verification stay *pending* (from position
f_1 on) until the next call, because the engine hands the drafter the emitted tokens only through the next `DraftBatch`.
`forward_train` is the same computation over whole sequences (what training and the exactness tests use).
"""

from __future__ import annotations

import torch
from torch import Tensor, nn

from specrl.drafters.base import (
    BindContext,
    DraftBatch,
    Drafter,
    Proposal,
    Rope,
    cached_block,
    check_target,
    compact_slots,
    draft_layer_args,
)
from specrl.drafters.trainable import TrainableDrafter
from specrl.errors import SpecRLError
from specrl.model.transformer import Block, KVCache, ModelArgs, RMSNorm

PENDING_EXTRA = 2  # pending-queue entries per slot beyond k_max (a verification leaves up to k_max + 1)
CACHE_EXTRA = 4  # cache positions per slot beyond the engine's cache_len + k_max + num_modules


class MTPModule(nn.Module):
    def __init__(self, args: ModelArgs):
        super().__init__()
        h = args.hidden_size
        self.hidden_norm = RMSNorm(h, args.rms_norm_eps)
        self.embed_norm = RMSNorm(h, args.rms_norm_eps)
        self.proj = nn.Linear(2 * h, h, bias=False)
        self.block = Block(args)
        self.norm = RMSNorm(h, args.rms_norm_eps)

    def layer_input(self, prev_hidden: Tensor, emb: Tensor) -> Tensor:
        return self.proj(torch.cat([self.hidden_norm(prev_hidden), self.embed_norm(emb)], dim=-1))


class MTPDrafter(nn.Module, Drafter, TrainableDrafter):
    kind = "mtp"
    target_layers = ()  # reads captured["final"], which the engine always provides
    training_methods = ("forward_train", "head")
    CONFIG_FIELDS = ("hidden_size", "vocab_size", "num_modules", "intermediate_size")

    def __init__(self, target, num_modules: int = 3, intermediate_size: int | None = None):
        nn.Module.__init__(self)
        if not isinstance(num_modules, int) or num_modules < 1:
            raise SpecRLError(f"num_modules must be an integer >= 1, got {num_modules!r}")
        a: ModelArgs = target.args
        self.target_args = a
        self.num_modules = num_modules
        self.args = draft_layer_args(a, num_modules, intermediate_size)
        self.mtp = nn.ModuleList(MTPModule(self.args) for _ in range(num_modules))
        self.rope = Rope(self.args)
        with torch.no_grad():
            for m in self.mtp:
                m.norm.weight.copy_(target.norm.weight.float())
        self._shared = {"embed": target.embed_tokens, "lm_head": target.lm_head}
        self.cache: KVCache | None = None

    def config(self) -> dict:
        a = self.target_args
        return {"kind": self.kind, "hidden_size": a.hidden_size, "vocab_size": a.vocab_size,
                "num_target_layers": a.num_layers, "num_heads": a.num_heads, "num_kv_heads": a.num_kv_heads,
                "head_dim": a.head_dim, "num_modules": self.num_modules,
                "intermediate_size": self.args.intermediate_size}

    @property
    def dtype(self) -> torch.dtype:
        return self.mtp[0].proj.weight.dtype

    @property
    def device(self) -> torch.device:
        return self.mtp[0].proj.weight.device

    def attach(self, target) -> None:
        self._shared = {"embed": target.embed_tokens, "lm_head": target.lm_head}

    def embed(self, tokens: Tensor) -> Tensor:
        return self._shared["embed"](tokens.to(self.device)).detach().to(self.dtype)

    def head(self, j: int, hidden: Tensor) -> Tensor:
        """Full-vocabulary logits (float32) of module j (0-based) through the shared target head."""
        w = self._shared["lm_head"].weight
        return torch.nn.functional.linear(self.mtp[j].norm(hidden).to(w.dtype), w.detach()).float()

    # ---------------------------------------------------------------- training forward
    def forward_train(self, h0: Tensor, tokens: Tensor, num_modules: int | None = None) -> list[Tensor]:
        """Hidden states of modules 1..D over whole sequences: h0 [B,T,H] target final hidden, tokens [B,T].

        Returns [h^1, ..., h^D] ([B,T,H] each); index t of h^j is meaningful for t <= T-1-j and predicts
        x_{t+j+1} (apply `head(j-1, .)`).
        """
        b, t = tokens.shape
        pos = torch.arange(t, device=tokens.device).expand(b, t)
        cos, sin = self.rope(pos, self.dtype)
        emb = self.embed(tokens)
        h = h0.to(self.dtype)
        outs = []
        for j, m in enumerate(self.mtp[: num_modules or self.num_modules], start=1):
            e = torch.cat([emb[:, j:], emb.new_zeros(b, j, emb.shape[-1])], dim=1)  # embed(x_{t+j})
            h = m.block(m.layer_input(h, e), cos, sin, None, 0, None, None, t)
            outs.append(h)
        return outs

    # ---------------------------------------------------------------- training (TrainableDrafter)
    def training_loss(self, batch: dict, ttt_steps: int) -> tuple[Tensor, dict]:
        """Module j at t predicts the target distribution at t+j (the final hidden is the features)."""
        tok, lens, loss_from = batch["tokens"], batch["len"], batch["loss_from"]
        pos = torch.arange(tok.shape[1], device=tok.device)[None, :]
        total = torch.zeros((), device=tok.device)
        stats = {"positions": 0, "top1": 0}
        outs = self.forward_train(batch["feats"].to(self.dtype), tok)
        for j, h in enumerate(outs, start=1):
            # module j, index t predicts x_{t+j+1} with the target's distribution at t+j
            tgt_i = torch.cat([batch["top_idx"][:, j:], torch.full_like(batch["top_idx"][:, :j], -1)], 1)
            tgt_p = torch.cat([batch["top_p"][:, j:], torch.zeros_like(batch["top_p"][:, :j])], 1)
            valid = (pos <= lens[:, None] - 1 - j) & (pos + j + 1 >= loss_from[:, None])
            logits = self.head(j - 1, h)
            ce = self.distill_loss(logits, tgt_i, tgt_p)
            total = total + (ce * valid).sum() / valid.sum().clamp_min(1)
            if j == 1:
                top1 = torch.cat([batch["top1"][:, 1:], batch["top1"][:, -1:]], 1)
                stats["positions"] = int(valid.sum())
                stats["top1"] = int(((logits.argmax(-1) == top1) & valid).sum())
        return total / len(outs), stats

    @classmethod
    def untrained(cls, target, *, draft_vocab=None, num_modules: int = 3, draft_layers: int = 4):
        return cls(target, num_modules=num_modules)

    @classmethod
    def from_directory(cls, target, cfg: dict, state: dict, where):
        return cls(target, num_modules=int(cfg["num_modules"]), intermediate_size=int(cfg["intermediate_size"]))

    # ---------------------------------------------------------------- Drafter protocol
    def bind(self, ctx: BindContext) -> None:
        check_target("MTP", {"hidden_size": self.target_args.hidden_size,
                             "vocab_size": self.target_args.vocab_size}, ctx.target.args)
        self.attach(ctx.target)
        slots, d, h = ctx.max_batch_size, self.num_modules, self.target_args.hidden_size
        self.cache = KVCache(self.args, slots, ctx.cache_len + ctx.k_max + d + CACHE_EXTRA, self.dtype, self.device)
        self.pend = torch.zeros(slots, ctx.k_max + PENDING_EXTRA, h, dtype=self.dtype, device=self.device)
        self.pend_cnt = torch.zeros(slots, dtype=torch.long)  # pending states start at front[:, 0] (= f_1)
        self.front = torch.zeros(slots, d, dtype=torch.long)  # f_j (may be <= 0 early on)
        self.last_out = torch.zeros(slots, d, h, dtype=self.dtype, device=self.device)

    def _advance(self, slot0: int, tokens: list[list[int]], h0: Tensor, lengths: Tensor, batch: DraftBatch | None,
                 k: int) -> Proposal | None:
        """Bring every module of slots slot0.. up to sequence lengths `lengths`; draft k tokens if batch given.

        h0 [n, T0, H] holds the target hidden states at positions f_1.. (the pending ones).
        """
        n = len(tokens)
        sl = slice(slot0, slot0 + n)
        dev = self.device
        front = self.front[sl].clone()
        prev_last = self.last_out[sl].clone()
        rows = torch.arange(n)
        # the tokens any module reads sit at positions >= min_j f_j: a right-aligned window of width w, to
        # which drafts are appended as columns (position p of row b is column p - (lengths[b] - w))
        w = max(1, int((lengths - front[:, -1].clamp_min(0)).max()))
        win = torch.tensor([r[-w:] if len(r) >= w else [0] * (w - len(r)) + r for r in tokens])
        off = lengths - w
        draft_toks, draft_qs = [], []
        seq = h0  # module j-1's hidden states; index 0 is position base_prev
        base_prev = front[:, 0]
        for j in range(1, self.num_modules + 1):
            m = self.mtp[j - 1]
            drafting = batch is not None and j <= k
            start = front[:, j - 1].clamp_min(0)
            end = lengths - 2 if drafting else lengths - 1 - j
            cnt = (end - start + 1).clamp_min(0)
            t = int(cnt.max())
            out = None
            if t > 0:
                pos = start[:, None] + torch.arange(t)[None, :]
                idx = (pos - base_prev[:, None]).clamp(0, seq.shape[1] - 1)
                prev_h = seq[rows[:, None], idx.to(seq.device)]
                nxt = win.gather(1, (pos + j - off[:, None]).clamp(0, win.shape[1] - 1))
                x = m.layer_input(prev_h, self.embed(nxt))
                out = cached_block(m.block, self.rope, x, pos.to(dev), self.cache.slots(slot0, slot0 + n), j - 1)
            # this module's hidden states with index 0 = position start-1 (the kept last final output)
            seq = prev_last[:, j - 1, None] if out is None else torch.cat([prev_last[:, j - 1, None], out], dim=1)
            base_prev = start - 1
            keep = lengths - 1 - j  # last final entry
            ki = (keep - base_prev).clamp(0, seq.shape[1] - 1)
            self.last_out[sl][:, j - 1] = torch.where((keep >= start)[:, None].to(dev), seq[rows, ki.to(dev)],
                                                      prev_last[:, j - 1])
            if drafting:
                di = (lengths - 2 - base_prev).clamp(0, seq.shape[1] - 1)
                tok, q = batch.sample(self.head(j - 1, seq[rows, di.to(dev)]), j - 1)
                draft_toks.append(tok)
                draft_qs.append(q)
                win = torch.cat([win, tok[:, None].to(win.device)], dim=1)
        self.front[sl] = lengths[:, None] - torch.arange(1, self.num_modules + 1)[None, :]
        self.pend_cnt[sl] = 0
        if batch is None:
            return None
        return Proposal(torch.stack(draft_toks, 1), torch.stack(draft_qs, 1))

    def on_prefill(self, slot_start: int, batch_tokens: list[list[int]], captured: dict | None) -> None:
        if self.cache is None:
            raise SpecRLError("MTPDrafter is not bound to an engine; pass it as RolloutEngine(drafter=...)")
        m = len(batch_tokens)
        sl = slice(slot_start, slot_start + m)
        self.front[sl] = 1 - torch.arange(1, self.num_modules + 1)[None, :]  # nothing computed: f_j = 1-j
        lengths = torch.tensor([len(t) for t in batch_tokens])
        self._advance(slot_start, batch_tokens, captured["final"].to(self.dtype), lengths, None, 0)

    def propose(self, batch: DraftBatch, k: int) -> Proposal:
        n = batch.size
        if k > self.num_modules:
            raise SpecRLError(f"the MTP drafter has {self.num_modules} modules, so it drafts at most "
                              f"{self.num_modules} tokens per step; got k={k} (lower num_draft_tokens/k_max)")
        if not torch.equal(self.front[:n, 0] + self.pend_cnt[:n], batch.positions - 1):
            raise RuntimeError("MTPDrafter state is out of step with the engine (missed a hook call)")
        return self._advance(0, batch.tokens, self.pend[:n], batch.positions, batch, k)

    def on_verified(self, batch: DraftBatch, proposal: Proposal | None, num_emitted: Tensor,
                    captured: dict | None) -> None:
        n = batch.size
        if bool((self.pend_cnt[:n] > 0).any()):  # an AR step: nothing consumed the pending states
            self._advance(0, batch.tokens, self.pend[:n], batch.positions, None, 0)
        final = captured["final"]
        self.pend[:n, : final.shape[1]] = final.to(self.dtype)
        self.pend_cnt[:n] = num_emitted

    def compact(self, order: list[int]) -> None:
        src = torch.tensor(order)
        compact_slots(order, self.cache, int(self.front[src, 0].max()) + 1,
                      (self.pend, self.pend_cnt, self.front, self.last_out))

"""EAGLE-3 drafter: one decoder layer over fused target hidden states, drafting in feature space.

Entry t of the drafter's sequence is (fused target feature g_t, token x_{t+1}); it lives at position t of the
drafter's own slot-indexed KV cache and its output hidden o_t predicts x_{t+2}. g_t = fc([n1(h_low); n2(h_mid);
n3(h_high)]) fuses three captured target layers (default (1, L//2-1, L-4)), each RMS-normalised first. The layer
is EAGLE-3's "midlayer", exactly as vLLM runs it (`Eagle3Block`): attention reads [input_layernorm(embed(x_{t+1}));
hidden_norm(g_t)] (2H -> q/k/v), the residual stream is g_t itself, then the usual MLP; logits =
lm_head(norm(o_t)). So a head trained here exports to vLLM's EAGLE-3 checkpoint layout by renaming alone
(`specrl.drafters.storage.export`; the per-layer norms are vLLM's `fc_norm`). The embedding is the target's (shared,
frozen, not saved), and the LM head is the drafter's own, optionally over a reduced vocabulary with `d2t`
mapping draft index -> target id (returned probabilities are always over the full target vocabulary, zero
outside the subset).

Drafting k tokens at sequence length n: the first forward consumes the *pending* entries (target features that
arrived with the last verification, plus those queued by plain (k=0) steps since, whose next tokens are known only
now) and ends at entry n-2, whose output gives draft 1; drafts 2..k feed the layer's own output hidden back in
place of the target feature (EAGLE-3). Entries written with drafted features sit past the verified length and are
overwritten before they can be read (attention masks by position), so rollback is free. The training forward
(`forward_train`) reproduces exactly this computation with "training-time test" masks, so tests can compare what
the engine drafted with a from-scratch recomputation.
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
    cached_kv,
    check_draft_vocab,
    check_target,
    compact_slots,
    draft_layer_args,
    full_vocab_logits,
    is_full_vocab,
    target_to_draft,
)
from specrl.drafters.trainable import TrainableDrafter
from specrl.errors import SpecRLError
from specrl.model.transformer import Attention, Block, KVCache, ModelArgs, RMSNorm

NUM_FUSED_LAYERS = 3  # EAGLE-3 fuses a low, a middle and a high target layer
PENDING_EXTRA = 2  # pending-queue entries per slot beyond k_max (a verification queues up to k_max + 1)
CACHE_EXTRA = 2  # drafter cache positions beyond the engine's cache_len + k_max (drafts run ahead of it)
TTT_STEP_WEIGHT = 0.8  # step s of training-time test weighs TTT_STEP_WEIGHT ** (s - 1)


def default_layers(num_layers: int) -> tuple[int, int, int]:
    """The fused target layers by default: the second, the one before the middle, and the fourth from last."""
    return (1, num_layers // 2 - 1, num_layers - 4)


class Eagle3Block(Block):
    """EAGLE-3's decoder layer. Its input x is [embed(x_{t+1}); h] (2H, both raw): attention reads
    [input_layernorm(embed); hidden_norm(h)] through 2H -> q/k/v projections, the residual stream starts at h,
    and the output is h + attn + mlp (pre-norm, the next draft's h). `store_kv` and the cached forwards see the
    same x, so the shared cached-layer helpers serve it unchanged."""

    def __init__(self, args: ModelArgs):
        super().__init__(args)
        h, d, a = args.hidden_size, args.head_dim, self.self_attn
        a.q_proj = nn.Linear(2 * h, args.num_heads * d, bias=False)
        a.k_proj = nn.Linear(2 * h, args.num_kv_heads * d, bias=False)
        a.v_proj = nn.Linear(2 * h, args.num_kv_heads * d, bias=False)
        self.hidden_norm = RMSNorm(h, args.rms_norm_eps)

    def _split(self, x: Tensor) -> tuple[Tensor, Tensor]:
        emb, h = x.chunk(2, dim=-1)
        return torch.cat([self.input_layernorm(emb), self.hidden_norm(h)], dim=-1), h

    def forward(self, x, cos, sin, mask, layer, cache, input_pos, kv_len, prefix=None):
        attn_in, h = self._split(x)
        r = h + self.self_attn(attn_in, cos, sin, mask, layer, cache, input_pos, kv_len, prefix)
        return r + self.mlp(self.post_attention_layernorm(r))

    def store_kv(self, x: Tensor, cos: Tensor, sin: Tensor, cache: KVCache, layer: int, input_pos: Tensor) -> None:
        _, k, v = self.self_attn.project(self._split(x)[0], cos, sin, queries=False)
        Attention.store(cache, layer, k, v, input_pos)


# ---------------------------------------------------------------------------------------------- drafter
class EagleDrafter(nn.Module, Drafter, TrainableDrafter):
    kind = "eagle"
    training_methods = ("fuse_concat", "forward_train", "head")
    unrolls_steps = True
    CONFIG_FIELDS = ("hidden_size", "vocab_size", "layers", "draft_vocab_size", "intermediate_size")
    builds_from_features = True

    def __init__(self, target, layers: tuple[int, ...] | list[int] | None = None,
                 draft_vocab: list[int] | Tensor | None = None, intermediate_size: int | None = None):
        nn.Module.__init__(self)
        a: ModelArgs = target.args
        n_layers = a.num_layers
        layers = default_layers(n_layers) if layers is None else tuple(int(i) for i in layers)
        if len(layers) != NUM_FUSED_LAYERS:
            raise SpecRLError(f"EAGLE-3 fuses exactly {NUM_FUSED_LAYERS} target layers (low, mid, high), got "
                              f"{list(layers)}")
        for i in layers:
            if not 0 <= i < n_layers:
                raise SpecRLError(f"EAGLE layer index {i} is out of range for a target with {n_layers} layers "
                                  f"(valid indices 0..{n_layers - 1}); the default for {n_layers} layers is "
                                  f"{list(default_layers(n_layers))}")
        self.fuse_layers = layers
        self.target_layers = tuple(sorted(set(layers)))
        self.target_args = a
        h, v = a.hidden_size, a.vocab_size
        if draft_vocab is None:
            d2t = torch.arange(v)
            self.full_vocab = True
        else:
            d2t = check_draft_vocab(draft_vocab, v)
            self.full_vocab = is_full_vocab(d2t, v)
        self.register_buffer("d2t", d2t)
        self.args = draft_layer_args(a, 1, intermediate_size)
        # per-layer RMSNorm before fusing: target residual streams carry huge outlier activations (SmolLM2:
        # |h| up to ~2.5e4 at attention-sink positions), which make a raw fc hard to train
        self.layer_norms = nn.ModuleList(RMSNorm(h, a.rms_norm_eps) for _ in range(NUM_FUSED_LAYERS))
        self.fc = nn.Linear(NUM_FUSED_LAYERS * h, h, bias=False)
        self.block = Eagle3Block(self.args)
        self.norm = RMSNorm(h, a.rms_norm_eps)
        self.lm_head = nn.Linear(h, d2t.numel(), bias=False)
        self.rope = Rope(self.args)
        with torch.no_grad():  # start the head from the target's (a far better start than random)
            self.lm_head.weight.copy_(target.lm_head.weight[d2t].float())
            self.norm.weight.copy_(target.norm.weight.float())
        self._shared = {"embed": target.embed_tokens}
        self.cache: KVCache | None = None
        self._id_order: tuple | None = None  # (d2t's identity, d2t ascending, its order), for `_sample`

    # ---------------------------------------------------------------- config / dtype
    def config(self) -> dict:
        a = self.target_args
        return {"kind": self.kind, "hidden_size": a.hidden_size, "vocab_size": a.vocab_size,
                "num_target_layers": a.num_layers, "num_heads": a.num_heads, "num_kv_heads": a.num_kv_heads,
                "head_dim": a.head_dim, "layers": list(self.fuse_layers), "draft_vocab_size": int(self.d2t.numel()),
                "intermediate_size": self.args.intermediate_size}

    @property
    def dtype(self) -> torch.dtype:
        return self.fc.weight.dtype

    @property
    def device(self) -> torch.device:
        return self.fc.weight.device

    def attach(self, target) -> None:
        """Use this target's (frozen) embedding: call after weight updates replace the target module."""
        self._shared["embed"] = target.embed_tokens

    def embed(self, tokens: Tensor) -> Tensor:
        return self._shared["embed"](tokens).detach().to(self.dtype)

    # ---------------------------------------------------------------- math shared by inference and training
    def fuse(self, captured: dict) -> Tensor:
        """g = fc([norm(h_low); norm(h_mid); norm(h_high)]) from captured target layers {layer: [n,T,H]}."""
        return self.fuse_concat(torch.cat([captured[i] for i in self.fuse_layers], dim=-1))

    def fuse_concat(self, hidden3: Tensor) -> Tensor:
        """g from the three captured layers already concatenated [..., 3H] (what training stores)."""
        parts = hidden3.float().chunk(NUM_FUSED_LAYERS, dim=-1)
        normed = [norm(p).to(self.dtype) for norm, p in zip(self.layer_norms, parts, strict=True)]
        return self.fc(torch.cat(normed, dim=-1))

    def layer_input(self, feature: Tensor, next_tokens: Tensor) -> Tensor:
        """The layer's input for entries (feature, next token): [embed(next); feature], [..., 2H]."""
        return torch.cat([self.embed(next_tokens), feature.to(self.dtype)], -1)

    def head(self, hidden: Tensor) -> Tensor:
        """Reduced-vocabulary logits (float32) from output hidden states."""
        return self.lm_head(self.norm(hidden)).float()

    def to_full_vocab(self, reduced_logits: Tensor) -> Tensor:
        """[..., Vd] -> [..., V] logits, -inf outside the draft vocabulary."""
        return full_vocab_logits(reduced_logits, None if self.full_vocab else self.d2t, self.target_args.vocab_size)

    def full_logits(self, hidden: Tensor) -> Tensor:
        return self.to_full_vocab(self.head(hidden))

    def _sample(self, batch: DraftBatch, hidden: Tensor, offset: int, out: Tensor | None = None
                ) -> tuple[Tensor, Tensor]:
        """Draw the draft token at positions + offset from output hidden states [n, H]: over the draft vocabulary
        only (its ids in ascending order, so a uniform picks the token full-vocabulary sampling would), with q
        scattered into the full vocabulary for the verifier (into `out`, a zeroed [n, V] view, when given)."""
        if self.full_vocab:
            return batch.sample(self.full_logits(hidden), offset)
        key = (self.d2t.device, self.d2t._version, self.d2t.data_ptr())  # a loaded state may replace d2t
        if self._id_order is None or self._id_order[0] != key:
            self._id_order = (key, *self.d2t.sort())
        _, ids, order = self._id_order
        return batch.sample_subset(self.head(hidden)[..., order], ids, self.target_args.vocab_size, offset, out)

    def target_to_draft(self) -> Tensor | None:
        """Each target id's draft-vocabulary index (-1 outside it); None when drafting over the full vocabulary."""
        return None if self.full_vocab else target_to_draft(self.d2t, self.target_args.vocab_size)

    def forward_train(self, fused: Tensor, tokens: Tensor, steps: int = 1, logits: bool = True) -> list[Tensor]:
        """Training forward with `steps` of training-time test: reduced logits [B,T,Vd] per step (with
        logits=False the output hidden states [B,T,H] instead, for a caller that runs `head` only where a loss
        is counted: the steps feed each other hidden states, never logits).

        fused [B,T,H] = g_t, tokens [B,T] = x_t. Step s at index t is the entry at position t with token
        x_{t+1} whose feature is the step s-1 output at t-1 (the target's g_t for s = 1); it attends to
        step-1 entries at positions <= t-s+1 and to the step-j entry at position t-s+j (j = 2..s), exactly as
        the s-th draft attends to the cache at inference. Its logits predict x_{t+2}; index t is meaningful
        for t >= s-1 (and t <= T-2). The last index's token is a pad.
        """
        b, t = tokens.shape
        nxt = torch.cat([tokens[:, 1:], tokens.new_zeros(b, 1)], dim=1)
        pos = torch.arange(t, device=tokens.device).expand(b, t)
        cos, sin = self.rope(pos, self.dtype)
        idx = torch.arange(t, device=tokens.device)
        prefix: tuple[list[Tensor], list[Tensor]] = ([], [])  # keys/values of the earlier steps (the block appends)
        outs = []
        feature = fused
        for s in range(1, steps + 1):
            x = self.layer_input(feature, nxt)
            blocks = [idx[None, :] <= idx[:, None] - (s - 1)]  # step-1 keys
            blocks += [idx[None, :] == idx[:, None] - (s - j) for j in range(2, s + 1)]
            mask = torch.cat(blocks, dim=1)  # [T, s*T]
            o = self.block(x, cos, sin, mask, 0, None, None, t, prefix)
            outs.append(self.head(o) if logits else o)
            feature = torch.cat([o.new_zeros(b, 1, o.shape[-1]), o[:, :-1]], dim=1)
        return outs

    # ---------------------------------------------------------------- training (TrainableDrafter)
    @property
    def training_capture(self) -> tuple[int, ...]:  # type: ignore[override]
        return self.fuse_layers

    def training_features(self, captured: dict, hidden: Tensor) -> Tensor:
        """The three fused layers, concatenated [..., T, 3H] (what `fuse_concat` reads)."""
        return torch.cat([captured[j] for j in self.fuse_layers], -1)

    def training_loss(self, batch: dict, ttt_steps: int) -> tuple[Tensor, dict]:
        """Entry t = (g_t, x_{t+1}) predicts the target distribution at t+1, over `ttt_steps` unrolled steps of
        training-time test weighted TTT_STEP_WEIGHT^(s-1); the head (norm + draft-vocabulary projection, most of
        the drafter's FLOPs) runs only on the positions whose loss counts (responses, not prompts)."""
        tok, lens, loss_from = batch["tokens"], batch["len"], batch["loss_from"]
        pos = torch.arange(tok.shape[1], device=tok.device)[None, :]
        total = torch.zeros((), device=tok.device)
        stats = {"positions": 0, "top1": 0}
        steps = self.forward_train(self.fuse_concat(batch["feats"]), tok, steps=ttt_steps, logits=False)
        # step s, index t predicts x_{t+2} with the target's distribution at t+1
        tgt_i = torch.cat([batch["top_idx"][:, 1:], batch["top_idx"][:, -1:]], 1)
        tgt_p = torch.cat([batch["top_p"][:, 1:], torch.zeros_like(batch["top_p"][:, -1:])], 1)
        top1 = torch.cat([batch["top1"][:, 1:], batch["top1"][:, -1:]], 1)
        weight_sum = 0.0
        for s, hidden in enumerate(steps, start=1):
            valid = (pos <= lens[:, None] - 2) & (pos >= s - 1) & (pos + 2 >= loss_from[:, None])
            logits = self.head(hidden[valid])
            ce = self.distill_loss(logits, tgt_i[valid], tgt_p[valid])
            w = TTT_STEP_WEIGHT ** (s - 1)
            total = total + w * ce.sum() / valid.sum().clamp_min(1)
            weight_sum += w
            if s == 1:
                pred = logits.argmax(-1)
                pred = pred if self.full_vocab else self.d2t[pred]
                stats["positions"] = int(valid.sum())
                stats["top1"] = int((pred == top1[valid]).sum())
        return total / weight_sum, stats

    @classmethod
    def untrained(cls, target, *, draft_vocab=None, num_modules: int = 3, draft_layers: int = 4):
        return cls(target, draft_vocab=draft_vocab)

    # ---------------------------------------------------------------- drafter directories
    @classmethod
    def from_directory(cls, target, cfg: dict, state: dict, where):
        ta = target.args
        layers = [int(i) for i in cfg["layers"]]
        bad = [i for i in layers if not 0 <= i < ta.num_layers]
        if bad:
            raise SpecRLError(f"{where}: EAGLE layer indices {layers} (made for a {cfg.get('num_target_layers')}-"
                              f"layer target) are out of range for this target with {ta.num_layers} layers")
        if "d2t" not in state:
            raise SpecRLError(f"{where}/model.safetensors lacks the tensor 'd2t' (the draft vocabulary)")
        d2t = state["d2t"]
        if d2t.numel() != int(cfg["draft_vocab_size"]):
            raise SpecRLError(f"{where}: config says draft_vocab_size {cfg['draft_vocab_size']} but tensor d2t has "
                              f"{d2t.numel()} entries")
        if d2t.numel() and (int(d2t.min()) < 0 or int(d2t.max()) >= ta.vocab_size):
            raise SpecRLError(f"{where}: d2t has token ids outside this target's vocabulary [0, {ta.vocab_size})")
        vocab = None if is_full_vocab(d2t, ta.vocab_size) else d2t
        return cls(target, layers=layers, draft_vocab=vocab, intermediate_size=int(cfg["intermediate_size"]))

    @classmethod
    def old_format_error(cls, where, version: int, min_version: int) -> str:
        return (f"{where} is an EAGLE head of format {version}, made by an older specrl whose layer differs from "
                f"EAGLE-3's (format {min_version}: vLLM's layout); its weights cannot be converted. Rebuild it "
                "with `specrl draft init` (or, for eagle:default / eagle:think, `specrl prepare --drafter eagle`, "
                "which rebuilds it)")

    # ---------------------------------------------------------------- Drafter protocol
    def bind(self, ctx: BindContext) -> None:
        ta = ctx.target.args
        check_target("EAGLE", {"hidden_size": self.target_args.hidden_size,
                               "vocab_size": self.target_args.vocab_size}, ta)
        if max(self.fuse_layers) >= ta.num_layers:
            raise SpecRLError(f"EAGLE layer indices {list(self.fuse_layers)} are out of range for a target with "
                              f"{ta.num_layers} layers")
        self.attach(ctx.target)
        slots = ctx.max_batch_size
        cap = ctx.k_max + PENDING_EXTRA
        self.cache = KVCache(self.args, slots, ctx.cache_len + ctx.k_max + CACHE_EXTRA, self.dtype, self.device)
        h = self.target_args.hidden_size
        self.pend = torch.zeros(slots, cap, h, dtype=self.dtype, device=self.device)
        self.pend_cnt = torch.zeros(slots, dtype=torch.long)
        self.pend_start = torch.zeros(slots, dtype=torch.long)

    def _entries(self, feature: Tensor, next_tokens: Tensor, pos: Tensor, slot0: int) -> Tensor:
        n = feature.shape[0]
        x = self.layer_input(feature, next_tokens.to(self.device))
        return cached_block(self.block, self.rope, x, pos.to(self.device), self.cache.slots(slot0, slot0 + n), 0)

    def _catch_up(self, tokens: list[list[int]], n: int, need_output: bool = True) -> Tensor | None:
        """Run the pending entries of slots 0..n-1 (their next tokens are in `tokens`); return o at n-2.

        Every pending entry's K/V is written; the full layer (attention + MLP) runs only for the last entry of
        each slot, whose output starts drafting (and not at all with need_output=False).
        """
        cnt, start = self.pend_cnt[:n].clone(), self.pend_start[:n].clone()  # copies: both are reset below
        t = int(cnt.max())
        # the pending entries' next tokens are the last cnt[b] tokens of each sequence
        tail = torch.tensor([r[-t:] if len(r) >= t else [0] * (t - len(r)) + r for r in tokens])
        nxt = tail.gather(1, (t - cnt[:, None] + torch.arange(t)[None, :]).clamp_max(t - 1))
        pos = (start[:, None] + torch.arange(t)[None, :]).to(self.device)
        x = self.layer_input(self.pend[:n, :t], nxt.to(self.device))
        cache = self.cache.slots(0, n)
        cached_kv(self.block, self.rope, x, pos, cache, 0)
        self.pend_start[:n] += cnt
        self.pend_cnt[:n] = 0
        if not need_output:
            return None
        rows, last = torch.arange(n, device=x.device), (cnt - 1).clamp_min(0).to(x.device)
        return cached_block(self.block, self.rope, x[rows, last][:, None], pos[rows, last][:, None], cache, 0)[:, 0]

    def on_prefill(self, slot_start: int, batch_tokens: list[list[int]], captured: dict | None) -> None:
        if self.cache is None:
            raise SpecRLError("EagleDrafter is not bound to an engine; pass it as RolloutEngine(drafter=...)")
        m = len(batch_tokens)
        lens = torch.tensor([len(t) - 1 for t in batch_tokens])  # prompt lengths
        fused = self.fuse(captured)  # [m, maxP, H]
        t = fused.shape[1] - 1
        if t > 0:  # entries 0..P-2 (token x_{t+1} is a prompt token); entry P-1 stays pending. Their outputs are
            # never used, so only their keys/values are written
            nxt = torch.tensor([r[1: t + 1] + [0] * (t + 1 - len(r)) for r in batch_tokens])
            x = self.layer_input(fused[:, :t], nxt.to(self.device))
            cached_kv(self.block, self.rope, x, torch.arange(t, device=x.device).expand(m, t),
                      self.cache.slots(slot_start, slot_start + m), 0)
        sl = slice(slot_start, slot_start + m)
        self.pend[sl, 0] = fused[torch.arange(m), (lens - 1).to(fused.device)]
        self.pend_cnt[sl] = 1
        self.pend_start[sl] = lens - 1

    def propose(self, batch: DraftBatch, k: int) -> Proposal:
        n = batch.size
        if not torch.equal(self.pend_start[:n] + self.pend_cnt[:n], batch.positions - 1):
            raise RuntimeError("EagleDrafter state is out of step with the engine (missed a hook call)")
        o = self._catch_up(batch.tokens, n)
        pos = (batch.positions - 1)[:, None]
        # q of every draft straight into the proposal's [n, k, V] (no stacking copy; full-vocabulary heads stack)
        buf = None if self.full_vocab else torch.zeros(n, k, self.target_args.vocab_size, device=o.device)
        toks, qs = [], []
        for i in range(k):
            tok, q = self._sample(batch, o, i, None if buf is None else buf[:, i])
            toks.append(tok)
            qs.append(q)
            if i + 1 < k:
                o = self._entries(o[:, None], tok[:, None], pos + i, 0)[:, 0]
        return Proposal(torch.stack(toks, 1), torch.stack(qs, 1) if buf is None else buf)

    def on_verified(self, batch: DraftBatch, proposal: Proposal | None, num_emitted: Tensor,
                    captured: dict | None) -> None:
        n = batch.size
        fused = self.fuse({i: captured[i] for i in self.fuse_layers})
        cnt = self.pend_cnt[:n]
        if proposal is None and int(cnt.max()) < self.pend.shape[1]:
            # an AR step: queue its entry behind the pending ones instead of running the layer now; the backlog
            # is consumed in one forward when drafting resumes (or the queue is full), so plain decoding with a
            # drafter attached costs almost nothing extra
            self.pend[torch.arange(n), cnt.to(self.pend.device)] = fused[:, 0]
            self.pend_cnt[:n] += 1
            return
        if bool((cnt > 0).any()):  # pending entries that were not drafted from (a full queue)
            self._catch_up(batch.tokens, n, need_output=False)
        self.pend[:n, : fused.shape[1]] = fused
        self.pend_cnt[:n] = num_emitted

    def compact(self, order: list[int]) -> None:
        src = torch.tensor(order)
        compact_slots(order, self.cache, int((self.pend_start[src] + 1).max()),
                      (self.pend, self.pend_cnt, self.pend_start))

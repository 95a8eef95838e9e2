"""One step's training tensors: collation, the split into mini- and micro-batches, and the scoring forward.

`collate` turns a step's `Rollouts` into a right-padded `Batch` (tokens, response mask, behaviour log-probs,
group advantages). `update_plan` splits the batch's sequences into `grpo.mini_batches` contiguous mini-batches
(one optimizer step each) and each mini-batch into micro-batches of `policy.train_micro_batch_size` sequences
(one forward/backward each); every stage walks the same plan, so what the drafter trainer keeps of micro-batch c
lines up with micro-batch c of every update (the batch itself holds no drafter state). `micro` trims a
micro-batch to its longest sequence, and `response_logprobs` is the policy forward that scores the response
tokens (the LM head only on those positions).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch
from torch import Tensor

from specrl.algorithms.grpo import group_advantages, token_logprobs
from specrl.algorithms.logprobs import head_logprobs
from specrl.algorithms.rollouts import Rollouts


@dataclass
class Batch:
    """Right-padded training tensors; position t of `mask`/`*_logp` scores token t+1 of `tokens`."""

    tokens: Tensor  # [N, T]
    mask: Tensor  # [N, T-1] bool: target token is a response token
    gen_logp: Tensor  # [N, T-1] behaviour log-probs from the rollout backend
    advantages: Tensor  # [N]
    old_logp: Tensor | None = None  # proximal log-probs: the weights at the start of the step
    ref_logp: Tensor | None = None
    plan: list[list[list[int]]] = field(default_factory=list)  # mini-batches of micro-batches of sequence indices

    def to(self, device: torch.device) -> Batch:
        """The collated tensors on `device` (the policy's: run.device); returns self."""
        self.tokens, self.mask = self.tokens.to(device), self.mask.to(device)
        self.gen_logp, self.advantages = self.gen_logp.to(device), self.advantages.to(device)
        return self

    @property
    def micro_batches(self) -> list[list[int]]:
        """Every micro-batch of the plan, in order (the order of the drafter trainer's captures)."""
        return [idx for mini in self.plan for idx in mini]


def collate(r: Rollouts, group_size: int, scale_by_std: bool) -> Batch:
    """A right-padded `Batch` of the step's samples, with group advantages (std-scaled when asked)."""
    n = len(r.prompts)
    lengths = [len(p) + len(x) for p, x in zip(r.prompts, r.responses, strict=True)]
    t = max(lengths)
    tokens = torch.zeros(n, t, dtype=torch.long)
    mask = torch.zeros(n, t - 1, dtype=torch.bool)
    gen_logp = torch.zeros(n, t - 1, dtype=torch.float32)
    for b, (p, x, lp) in enumerate(zip(r.prompts, r.responses, r.gen_logprobs, strict=True)):
        tokens[b, : len(p) + len(x)] = torch.tensor(p + x, dtype=torch.long)
        mask[b, len(p) - 1: len(p) - 1 + len(x)] = True
        gen_logp[b, len(p) - 1: len(p) - 1 + len(x)] = torch.tensor(lp, dtype=torch.float32)
    return Batch(tokens, mask, gen_logp, group_advantages(r.rewards, group_size, scale_by_std))


def chunks(n: int, size: int, start: int = 0) -> list[list[int]]:
    """Consecutive index lists of `size` (the last one shorter) covering start .. start + n - 1."""
    return [list(range(start + i, start + min(n, i + size))) for i in range(0, n, size)]


def update_plan(n: int, mini_batches: int, micro_size: int) -> list[list[list[int]]]:
    """`mini_batches` contiguous mini-batches of n sequences, as even as possible (the first n % mini_batches
    get one more, so a batch that dynamic sampling left short still takes every optimizer step; at most n
    mini-batches), each split into micro-batches of micro_size. With one mini-batch this is the whole batch in
    micro-batches."""
    m = max(1, min(mini_batches, n))
    sizes = [n // m + (1 if i < n % m else 0) for i in range(m)]
    plan, start = [], 0
    for s in sizes:
        plan.append(chunks(s, micro_size, start))
        start += s
    return plan


def micro(batch: Batch, idx: list[int]) -> tuple[Tensor, Tensor]:
    """Tokens and mask of a micro-batch, trimmed to its longest sequence."""
    m = batch.mask[idx]
    last = int(m.any(0).nonzero().max()) + 2 if bool(m.any()) else 2
    return batch.tokens[idx, :last], m[:, : last - 1]


def response_span(mask: Tensor) -> tuple[Tensor, Tensor]:
    """Per row of a response mask [B, T-1] (mask[:, j]: token j+1 is a response token), the first and the last
    scored position j, as [B] long tensors; a row with no response token gets (0, 0)."""
    b, t1 = mask.shape
    has = mask.any(1)
    zero = torch.zeros(b, dtype=torch.long, device=mask.device)
    first = torch.where(has, mask.float().argmax(1), zero)
    last = torch.where(has, (t1 - 1) - mask.flip(1).float().argmax(1), zero)
    return first, last


def shared_prefix_hidden(model: Any, toks: Tensor, mask: Tensor, capture: tuple = ()
                         ) -> tuple[Tensor, dict] | None:
    """`model.forward_hidden(toks, capture=capture)` for rows that share prompts, with each prompt run once.

    A row's prompt is everything before its first response token (`mask`); the shared part is the prompt less its
    last token, whose hidden state scores the first response token and so runs with the row's own tokens. The
    outputs (final hidden states and captured layers, [B, T, H]) are laid out as the plain forward's, equal to
    them up to summation order, and zero at padding. Returns None when no two rows share a prompt, a row has no
    response token or a prompt is a single token: the plain forward is then as cheap.
    """
    if not hasattr(model, "forward_hidden_shared") or not bool(mask.any(1).all()):
        return None
    b, t = toks.shape
    first, ends = (x.tolist() for x in response_span(mask))  # first = prompt length - 1: the shared prefix's
    # length; ends: the last scored position (the row ends at +2)
    if min(first) < 1:
        return None
    rows = toks.tolist()
    keys: dict[tuple, int] = {}
    group = [keys.setdefault(tuple(r[:f]), len(keys)) for r, f in zip(rows, first, strict=True)]
    if len(keys) == b:
        return None
    lens = [len(key) for key in keys]  # in group order: keys were numbered as they were inserted
    p, s = max(lens), max(e + 2 - f for e, f in zip(ends, first, strict=True))
    dev = toks.device
    prefix = torch.zeros(len(keys), p, dtype=toks.dtype, device=dev)
    for key, gi in keys.items():
        prefix[gi, : len(key)] = torch.tensor(key, dtype=toks.dtype)
    own = torch.zeros(b, s, dtype=toks.dtype, device=dev)
    # flat index of every [B, T] position into cat(prefix outputs [G*P], row outputs [B*S], one zero row)
    index = torch.full((b, t), len(keys) * p + b * s, dtype=torch.long)
    for r, (gi, f, e) in enumerate(zip(group, first, ends, strict=True)):
        own[r, : e + 2 - f] = toks[r, f: e + 2]
        index[r, :f] = gi * p + torch.arange(f)
        index[r, f: e + 2] = len(keys) * p + r * s + torch.arange(e + 2 - f)
    g_idx = torch.tensor(group, device=dev)
    hp, hr, caps = model.forward_hidden_shared(prefix, torch.tensor(lens, device=dev), own, g_idx, capture)
    index = index.to(dev)

    def full(pre: Tensor, row: Tensor) -> Tensor:
        flat = torch.cat([pre.reshape(-1, pre.shape[-1]), row.reshape(-1, row.shape[-1]),
                          row.new_zeros(1, row.shape[-1])])
        return flat[index]

    return full(hp, hr), {i: full(*caps[i]) for i in capture}


def response_logprobs(model: Any, toks: Tensor, mask: Tensor, temperature: float,
                      capture: tuple = (), top: int = 0, share_prefixes: bool = True, top_p: float = 1.0,
                      top_k: int = 0) -> tuple[Tensor, dict]:
    """Log-probabilities [B, T-1] of toks[:, 1:] (0 where mask is false) and the captured hidden states.

    The LM head (a large share of a small model's FLOPs) runs only on the response positions of `mask`, in row
    chunks (`specrl.algorithms.logprobs`), so no [B·T, V] logits are kept; with top > 0 captured["response_top"] holds
    (top-`top` probabilities, their ids, argmax ids) of the untempered distribution at those positions, in mask
    order, detached. With `share_prefixes`, rows of one GRPO group run their common prompt once
    (`shared_prefix_hidden`). `top_p` / `top_k` are the sampler's filter: the log-probabilities are those of the
    distribution the tokens were sampled from (`grpo.token_logprobs`).
    """
    if hasattr(model, "forward_hidden") and isinstance(getattr(model, "lm_head", None), torch.nn.Linear):
        shared = shared_prefix_hidden(model, toks, mask, capture) if share_prefixes else None
        hidden, captured = shared if shared is not None else model.forward_hidden(toks, capture=capture)
        captured["final"] = hidden
        flat, tops = head_logprobs(hidden[:, :-1][mask], model.lm_head, toks[:, 1:][mask], temperature, top=top,
                                   top_p=top_p, top_k=top_k)
        if top:
            captured["response_top"] = tops
        return torch.zeros(mask.shape, dtype=flat.dtype, device=flat.device).masked_scatter(mask, flat), captured
    logits, captured = model(toks, capture=capture)
    if top:
        sel = logits[:, :-1][mask].detach().float()
        probs = torch.softmax(sel, dim=-1)
        p, i = probs.topk(min(top, probs.shape[-1]), dim=-1)
        captured["response_top"] = (p, i, sel.argmax(-1))
    return token_logprobs(logits[:, :-1], toks[:, 1:], temperature, top_p, top_k) * mask, captured

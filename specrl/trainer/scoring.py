"""The scoring forward: the model's log-probabilities of a micro-batch's response tokens (trainer side: the learner owns
the model; `specrl.algorithms` computes on the tensors it returns).

`response_logprobs` runs the policy (or the reference) over a micro-batch's tokens and scores the response tokens,
the LM head only on those positions (`specrl.algorithms.logprobs.head_logprobs`); it also returns the hidden states
the drafter trainer asks to keep. `shared_prefix_hidden` runs a GRPO group's common prompt once.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor

from specrl.algorithms.batch import response_span
from specrl.algorithms.grpo import token_logprobs
from specrl.algorithms.logprobs import head_logprobs


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

"""One step's training tensors: collation and the split into mini- and micro-batches (tensors only, no model).

`collate` turns a step's `Rollouts` into a right-padded `Batch` (tokens, response mask, behaviour log-probs,
group advantages) on the learner's device, with its update plan: `update_plan` splits the batch's sequences into
`grpo.mini_batches` contiguous mini-batches (one optimizer step each) and each mini-batch into micro-batches of
`policy.train_micro_batch_size` sequences (one forward/backward each); every stage walks the same plan, so what
the drafter trainer keeps of micro-batch c lines up with micro-batch c of every update (the batch itself holds no
drafter state). `micro` trims a micro-batch to its longest sequence; `response_span` finds each row's scored
positions. The model forward that scores a micro-batch is the learner's (`specrl.trainer.scoring`).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
from torch import Tensor

from specrl.algorithms.grpo import group_advantages
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

    @property
    def micro_batches(self) -> list[list[int]]:
        """Every micro-batch of the plan, in order (the order of the drafter trainer's captures)."""
        return [idx for mini in self.plan for idx in mini]


def collate(r: Rollouts, group_size: int, scale_by_std: bool, mini_batches: int = 1, micro_size: int | None = None,
            device: torch.device | str = "cpu") -> Batch:
    """A right-padded `Batch` of the step's samples on `device`, with group advantages (std-scaled when asked) and
    its update plan (`update_plan`: `mini_batches` mini-batches of micro-batches of `micro_size` sequences; the
    whole batch in one micro-batch without a size)."""
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
    advantages = group_advantages(r.rewards, group_size, scale_by_std)
    return Batch(tokens.to(device), mask.to(device), gen_logp.to(device), advantages.to(device),
                 plan=update_plan(n, mini_batches, micro_size or n))


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

"""One step's training tensors: collation and the split into mini- and micro-batches (tensors only, no model).

`collate(r, spec)` turns a step's `Rollouts` into a right-padded `Batch` (tokens, response mask, behaviour
log-probs, group advantages) on the learner's device, with everything the learner's passes read: the update plan
(`update_plan`: `grpo.mini_batches` contiguous mini-batches, one optimizer step each, each split into micro-batches
of `policy.train_micro_batch_size` sequences, one forward/backward each), each mini-batch's loss normaliser, and each
row's scored length, to which a micro-batch is trimmed. A learner on one of N data-parallel ranks gets its rank's
1/N of every mini-batch, and normalisers of the whole mini-batch over N (the ranks' gradients are averaged), so the
ranks together take one process's step. Every stage walks the same plan, so what the drafter trainer keeps of
micro-batch c lines up with micro-batch c of every update (the batch itself holds no drafter state). The model
forward that scores a micro-batch is the learner's (`specrl.trainer.scoring`).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
from torch import Tensor

from specrl.algorithms.grpo import group_advantages
from specrl.algorithms.losses import loss_normalizer
from specrl.algorithms.rollouts import Rollouts
from specrl.errors import SpecRLError


@dataclass(frozen=True)
class CollateSpec:
    """What `collate` needs from the learner: the GRPO group size, std scaling of advantages, the update plan's
    mini-batches and micro-batch size (None: the whole share in one), the loss's normaliser kind and the generation
    limit it may use, this learner's rank among `world_size`, and the device the batch lives on."""

    group_size: int
    scale_by_std: bool
    mini_batches: int = 1
    micro_size: int | None = None
    normalizer: str = "tokens"
    max_new_tokens: int | None = None  # the `max_tokens` normaliser's generation limit (required by it)
    rank: int = 0
    world_size: int = 1
    device: torch.device | str = "cpu"


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
    norms: list[float] = field(default_factory=list)  # the loss normaliser of each mini-batch (optimizer step)
    ends: list[int] = field(default_factory=list)  # per row: prompt + response tokens (0 without a response)

    @property
    def micro_batches(self) -> list[list[int]]:
        """Every micro-batch of the plan, in order (the order of the drafter trainer's captures)."""
        return [idx for mini in self.plan for idx in mini]


def collate(r: Rollouts, spec: CollateSpec) -> Batch:
    """This rank's right-padded `Batch` of the step's samples on `spec.device`: group advantages (std-scaled when
    asked), its update plan and each mini-batch's loss normaliser (module docstring)."""
    n, ws = len(r.prompts), spec.world_size
    if ws < 1 or not 0 <= spec.rank < ws:
        raise SpecRLError(f"collate: rank {spec.rank} of world_size {ws}; a rank is 0 .. world_size - 1, "
                          "world_size >= 1")
    if spec.normalizer == "max_tokens" and spec.max_new_tokens is None:
        raise SpecRLError("collate: the max_tokens normaliser needs CollateSpec.max_new_tokens "
                          "(generation.max_new_tokens)")
    lengths = [len(p) + len(x) for p, x in zip(r.prompts, r.responses, strict=True)]
    t = max(lengths)
    tokens = torch.zeros(n, t, dtype=torch.long)
    mask = torch.zeros(n, t - 1, dtype=torch.bool)
    gen_logp = torch.zeros(n, t - 1, dtype=torch.float32)
    for b, (p, x, lp) in enumerate(zip(r.prompts, r.responses, r.gen_logprobs, strict=True)):
        tokens[b, : len(p) + len(x)] = torch.tensor(p + x, dtype=torch.long)
        mask[b, len(p) - 1: len(p) - 1 + len(x)] = True
        gen_logp[b, len(p) - 1: len(p) - 1 + len(x)] = torch.tensor(lp, dtype=torch.float32)
    advantages = group_advantages(r.rewards, spec.group_size, spec.scale_by_std)
    full = update_plan(n, spec.mini_batches, n)  # one micro-batch per mini-batch: the rows of each
    sizes = [len(mini[0]) for mini in full]
    if any(s % ws for s in sizes):
        raise SpecRLError(f"{n} sequences in {len(sizes)} mini-batch(es) of {sizes} cannot be split evenly over "
                          f"{ws} learner ranks; every mini-batch (grpo.mini_batches) needs a multiple of "
                          f"learner.world_size sequences")
    norms = [loss_normalizer(spec.normalizer, mask[mini[0]], spec.max_new_tokens or 0) / ws for mini in full]
    rows, plan = [], []
    for mini in full:
        share = len(mini[0]) // ws
        rows.extend(mini[0][spec.rank * share: (spec.rank + 1) * share])
        plan.append(chunks(share, spec.micro_size or share, len(rows) - share))
    ends = [lengths[i] if r.responses[i] else 0 for i in rows]
    if ws > 1:
        idx = torch.tensor(rows, dtype=torch.long)
        tokens, mask, gen_logp, advantages = tokens[idx], mask[idx], gen_logp[idx], advantages[idx]
    d = spec.device
    return Batch(tokens.to(d), mask.to(d), gen_logp.to(d), advantages.to(d), plan=plan, norms=norms, ends=ends)


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


def response_span(mask: Tensor) -> tuple[Tensor, Tensor]:
    """Per row of a response mask [B, T-1] (mask[:, j]: token j+1 is a response token), the first and the last
    scored position j, as [B] long tensors; a row with no response token gets (0, 0)."""
    b, t1 = mask.shape
    has = mask.any(1)
    zero = torch.zeros(b, dtype=torch.long, device=mask.device)
    first = torch.where(has, mask.float().argmax(1), zero)
    last = torch.where(has, (t1 - 1) - mask.flip(1).float().argmax(1), zero)
    return first, last

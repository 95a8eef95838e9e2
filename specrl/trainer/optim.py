"""The policy's optimizer and learning-rate schedule, built from the config by builders of their own (torchtitan's
`build_optimizers` / `build_lr_schedulers` components), so the learner receives them instead of making them inline.

`build_optimizer(cfg, policy)` is AdamW over the policy's trainable parameters only (the drafter trainer has an
optimizer of its own), fused: one kernel over all parameters, the same AdamW up to float rounding.
`lr_schedule(cfg)` is the multiplier of the base learning rate per RL step (warm-up, then constant, linear or
cosine down to `policy.min_lr_ratio`), shared by the policy's scheduler and the drafter trainer;
`build_scheduler(optimizer, schedule)` steps the policy's optimizer along it. `apply_config_hyperparams` puts this
config's learning rate, betas and weight decay into an optimizer and scheduler restored from a checkpoint.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

import torch

from specrl.config.schema import TrainConfig


def lr_factor(step: int, warmup: int, total: int, schedule: str, min_ratio: float) -> float:
    """Multiplier of the base learning rate for RL step `step` (0-based)."""
    if warmup > 0 and step < warmup:
        return (step + 1) / warmup
    if schedule == "constant" or total <= warmup:
        return 1.0
    progress = min(1.0, (step - warmup) / max(1, total - warmup))
    if schedule == "linear":
        return 1.0 - (1.0 - min_ratio) * progress
    return min_ratio + (1.0 - min_ratio) * 0.5 * (1.0 + math.cos(math.pi * progress))


def lr_schedule(cfg: TrainConfig) -> Callable[[int], float]:
    """The config's schedule: RL step (0-based) -> multiplier of the base learning rate."""
    pc, total = cfg.policy, cfg.run.steps

    def factor(s: int) -> float:
        return lr_factor(s, pc.warmup_steps, total, pc.lr_schedule, pc.min_lr_ratio)

    return factor


def build_optimizer(cfg: TrainConfig, policy: torch.nn.Module) -> torch.optim.Optimizer:
    """AdamW (fused) over the policy's trainable parameters with `policy.learning_rate`, betas and weight decay."""
    pc = cfg.policy
    return torch.optim.AdamW([{"params": [p for p in policy.parameters() if p.requires_grad],
                               "lr": pc.learning_rate}],
                             betas=pc.adam_betas, weight_decay=pc.weight_decay, fused=True)


def build_scheduler(optimizer: torch.optim.Optimizer,
                    schedule: Callable[[int], float]) -> torch.optim.lr_scheduler.LambdaLR:
    """The optimizer's learning rate along `schedule`, stepped once per RL step."""
    return torch.optim.lr_scheduler.LambdaLR(optimizer, schedule)


def apply_config_hyperparams(optimizer: torch.optim.Optimizer, scheduler: Any, cfg: TrainConfig, step_count: int,
                             log: Callable[[str], None]) -> None:
    """After loading optimizer and scheduler state: use this config's learning rate, betas and weight decay.

    The loaded state carries the values of the run that wrote it, so `--resume RUN --set
    policy.learning_rate=X` would otherwise keep the old rate while config.yaml says X. The schedule's
    position (steps taken) is kept; an unchanged config gives bit-identical rates. (The drafter trainer
    applies its own: `DrafterTrainer.apply_hyperparams`.)
    """
    pc = cfg.policy
    group, base = optimizer.param_groups[0], pc.learning_rate
    old = scheduler.base_lrs[0]
    if old != base:
        log(f"[specrl] resume: policy.learning_rate {old:g} -> {base:g} (the optimizer uses the new value "
            f"from step {step_count + 1})")
    scheduler.base_lrs[0] = base
    group["initial_lr"] = base
    group["lr"] = base * scheduler.lr_lambdas[0](scheduler.last_epoch)
    if tuple(group["betas"]) != tuple(pc.adam_betas) or group["weight_decay"] != pc.weight_decay:
        log(f"[specrl] resume: policy.adam_betas / weight_decay now {tuple(pc.adam_betas)} / {pc.weight_decay:g}")
        group["betas"], group["weight_decay"] = tuple(pc.adam_betas), pc.weight_decay

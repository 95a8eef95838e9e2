"""Weight sync: the one interface through which the trainer's weights reach the rollout engine.

The `prepare` stage of every RL step calls `WeightSync.push(policy_state, drafter_state)`. Here the trainer
and the engine share a process and `LocalWeightSync` copies tensors in place (casting to the engine's dtype);
in the asynchronous pipeline the engine becomes a separate actor and another implementation of the same
protocol (e.g. a Ray object-store or NCCL broadcast) replaces it, without touching the step definition.
"""

from __future__ import annotations

from typing import Protocol

import torch
from torch import Tensor, nn


class WeightSync(Protocol):
    def push(self, policy_state: dict[str, Tensor], drafter_state: dict[str, Tensor] | None = None) -> None:
        """Make the rollout side generate with these weights from the next `generate` call on."""


def policy_state(model: nn.Module) -> dict[str, Tensor]:
    """Parameter tensors by name (tied weights appear once), detached: what `push` sends."""
    return {name: p.detach() for name, p in model.named_parameters()}


class LocalWeightSync:
    """In-process sync: `engine.load_weights` for the policy, `load_state_dict` for the engine's drafter."""

    def __init__(self, engine) -> None:
        self.engine = engine
        self.pushes = 0

    @torch.no_grad()
    def push(self, policy_state: dict[str, Tensor], drafter_state: dict[str, Tensor] | None = None) -> None:
        self.engine.load_weights(policy_state)
        if drafter_state is not None:
            drafter = getattr(self.engine, "drafter", None)
            if drafter is None or not hasattr(drafter, "load_state_dict"):
                raise TypeError("push got drafter weights but the rollout engine has no trainable drafter")
            drafter.load_state_dict(drafter_state)
        self.pushes += 1

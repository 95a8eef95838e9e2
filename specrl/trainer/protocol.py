"""The learner contract: what every learner offers the trainers that drive it (`LearnerProtocol`).

A learner trains on one step's `Rollouts` and owns the policy's weights, optimizer and schedule. Three kinds
implement this one contract: the one-process `specrl.trainer.learner.Learner`, the data-parallel rank group
`specrl.cluster.learner_group.LearnerGroup`, and so the async pipeline's learner actor, which holds either. The sync
trainer and the learner actor call only these methods, so they never ask which kind they hold. `learn` returns the
step's `StepRecord` everywhere; `version` is the number of RL steps trained (what `named_weights` is tagged with).
`publish`, `resident_parameters`, `export` and `close` have defaults for a learner that holds its whole policy in
this process (push the named tensors, count its parameters, write it as an HF checkpoint, nothing to release); a
learner whose weights live elsewhere overrides them. The anchor is torchtitan's trainer components and TRL's trainer:
one interface, its state in checkpoint parts.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from specrl.algorithms.rollouts import Rollouts
from specrl.model.hf_checkpoint import save_hf_checkpoint
from specrl.observability.step_record import StepRecord


class LearnerProtocol(ABC):
    """The learner contract; subclasses set `step_count` (RL steps trained) and `log` (where event lines go)."""

    step_count: int
    log: Callable[[str], None]
    policy: torch.nn.Module  # the defaults below read it; a learner without the policy here overrides them

    @property
    def version(self) -> int:
        """The version of the weights `named_weights` returns: RL steps (batches) trained."""
        return self.step_count

    @abstractmethod
    def learn(self, r: Rollouts, seconds: dict[str, float]) -> StepRecord:
        """Train on one step's rollouts; `seconds` holds the producer's stage times. The step's record."""

    @abstractmethod
    def named_weights(self) -> tuple[int, dict[str, Any], dict[str, Any] | None]:
        """(version, policy tensors under HF names, the online drafter's tensors or None)."""

    @abstractmethod
    def check_weights(self, step: int) -> None:
        """The pre-checkpoint check (NaN/inf scan + probe forward/backward); raises NonFiniteError."""

    @abstractmethod
    def state_parts(self) -> dict[str, Any]:
        """Checkpoint parts: `learner` (bookkeeping) and the model/optimizer directory part."""

    @abstractmethod
    def load_parts(self, parts: dict[str, Any], st: dict[str, Any]) -> None:
        """Restore from checkpoint parts; `st` is the `learner` bookkeeping."""

    def publish(self, sync: Any) -> None:
        """Hand this version's weights to the async pipeline's weight sync (`push` of the named tensors)."""
        sync.push(*self.named_weights())

    def resident_parameters(self) -> int:
        """Parameter elements of the policy held in this process."""
        return sum(p.numel() for p in self.policy.parameters())

    def export(self, directory: str | Path) -> None:
        """The policy as an HF checkpoint directory (config.json + model.safetensors)."""
        save_hf_checkpoint(self.policy, directory)

    def close(self) -> None:  # noqa: B027  (a default: nothing to release for a learner in this process)
        """Release the learner's processes; nothing for one in this process."""

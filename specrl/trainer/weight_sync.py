"""Versioned weight sync: the one way the learner's weights reach a rollout backend.

The learner publishes `push(version, policy, drafter=None)` once per RL step: policy tensors under HF checkpoint
names, the trainable drafter (if any) under its checkpoint names, and the version (RL steps, i.e. batches, trained;
a batch may take several optimizer steps, see docs/algorithms.md). The rollout side picks the newest version up
between generate calls and tags every output with it; `wait_for(version)` blocks until at least that version is
live and returns the live one. `LocalWeightSync` is the in-process case (sync training): a direct copy into the
backend through its protocol `load_weights`, so `wait_for` never has anything to wait for. The async pipeline
publishes through Ray's object store instead, behind the same two methods. Every load is acknowledged: `refit`
checks the backend's digest of what it holds against what was sent (`specrl.rollout.digest`), so a dropped,
partial or misnamed load stops the step.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Protocol

import torch
from torch import Tensor

from specrl.errors import SpecRLError
from specrl.rollout.digest import check_refit
from specrl.rollout.protocol import RolloutBackend


class WeightSync(Protocol):
    def push(self, version: int, policy: Mapping[str, Tensor], drafter: Mapping[str, Tensor] | None = None) -> None:
        """Make the rollout side generate with these weights (tagged `version`) from its next generate call."""

    def wait_for(self, version: int, timeout: float | None = None) -> int:
        """Block until a version >= `version` is live on the rollout side; return the live version."""


def refit(backend: RolloutBackend, which: str, tensors: Mapping[str, Tensor], version: int) -> dict[str, str]:
    """`backend.load_weights(which, tensors, version)`, then `check_refit` of its acknowledgement against
    `tensors`: a RefitError naming the backend and the tensors it does not hold as sent. Returns the digest."""
    ack = backend.load_weights(which, tensors, version)
    check_refit(tensors, ack, which, getattr(getattr(backend, "capabilities", None), "name", type(backend).__name__),
                version)
    return ack


class LocalWeightSync:
    """In-process sync: `backend.load_weights` for the policy and, when given, the drafter."""

    def __init__(self, backend: RolloutBackend) -> None:
        self.backend = backend
        self.version: int | None = None  # the newest version pushed
        self.pushes = 0

    def push(self, version: int, policy: Mapping[str, Tensor], drafter: Mapping[str, Tensor] | None = None) -> None:
        if not isinstance(version, int) or version < 0:
            raise SpecRLError(f"weight sync: version must be an integer >= 0, got {version!r}")
        if self.version is not None and version < self.version:
            raise SpecRLError(f"weight sync: version {version} is older than the live version {self.version}; "
                              "versions never go back")
        refit(self.backend, "policy", policy, version)
        if drafter is not None:
            refit(self.backend, "drafter", drafter, version)
        self.version = version
        self.pushes += 1

    def wait_for(self, version: int, timeout: float | None = None) -> int:
        if self.version is None or self.version < version:
            raise SpecRLError(f"weight sync: version {version} was never pushed (live: {self.version}); an "
                              "in-process sync has no other publisher to wait for")
        return self.version


def cast_in_place(policy: dict, dtype: torch.dtype) -> dict:
    """`policy` with its floating tensors cast to `dtype`, one at a time, each original dropped as its copy is
    made: the caller never holds the policy twice (a publish keeps one copy in flight)."""
    for k in list(policy):
        v = policy[k]
        if v.is_floating_point() and v.dtype != dtype:
            policy[k] = v.to(dtype)
        del v
    return policy

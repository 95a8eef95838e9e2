"""The local Ray specrl starts runs its actors at the driver's scheduling priority, not Ray's default niceness 15
(at which any competing process on the machine starves the learner and the rollout workers)."""

from __future__ import annotations

import os

import pytest
import ray

from specrl.cluster.local_ray import start_local_ray

# `make test` runs this module alone, after its parallel part: it starts a local Ray.
pytestmark = pytest.mark.serial


def test_workers_run_at_the_drivers_niceness():
    start_local_ray(1)
    try:
        @ray.remote
        def niceness() -> int:
            return os.nice(0)

        assert ray.get(niceness.remote()) == os.nice(0)
    finally:
        ray.shutdown()

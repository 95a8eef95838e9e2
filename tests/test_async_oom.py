"""An actor of the async pipeline killed by Ray's out-of-memory monitor ends the run with a SpecRLError that says
what happened and what to change, not Ray's traceback."""

from __future__ import annotations

import pytest
import ray

from specrl.cluster import async_trainer
from specrl.errors import SpecRLError


def test_out_of_memory_is_a_clear_error(monkeypatch):
    def killed(ref):
        raise ray.exceptions.OutOfMemoryError("2 worker(s) were killed due to the node running low on memory.\n"
                                              "Memory on the node was 22.91GB used / 23.54GB limit")

    monkeypatch.setattr(async_trainer.ray, "get", killed)
    with pytest.raises(SpecRLError, match=r"memory \(2 worker.*num_rollout_workers"):
        async_trainer._get(object())


def test_other_ray_errors_pass_through(monkeypatch):
    def lost(ref):
        raise ray.exceptions.GetTimeoutError("timed out")

    monkeypatch.setattr(async_trainer.ray, "get", lost)
    with pytest.raises(ray.exceptions.GetTimeoutError):
        async_trainer._get(object())

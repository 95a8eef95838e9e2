"""Refit acknowledgement in the async pipeline: a rollout worker whose refit is dropped (drafter), partial,
loaded under the wrong layer name or left at the old weights under the new version stops the step it happens in
with a RefitError naming the tensors, the backend and the worker (the faults come from `tests.faults.faulty_worker`)."""

from __future__ import annotations

import pytest
import ray
import torch

from specrl.rollout.digest import RefitError
from specrl.trainer.config_check import validate_config
from tests.test_async import async_cfg
from tests.tiny import make_tiny_checkpoint

# `make test` runs this module alone, after its parallel part: it starts a local Ray and async rollout workers.
pytestmark = pytest.mark.serial


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return make_tiny_checkpoint(tmp_path_factory.mktemp("tiny") / "ckpt", seed=0)


@pytest.fixture(scope="module")
def eagle(tiny, tmp_path_factory):
    from specrl import load_model
    from specrl.drafters import EagleDrafter
    from specrl.drafters.storage.io import save_drafter

    model, _ = load_model(tiny, dtype=torch.float32)
    torch.manual_seed(1)
    return save_drafter(EagleDrafter(model), tmp_path_factory.mktemp("eagle") / "head")


@pytest.mark.parametrize("fault,which,match", [
    ("drop-drafter", "drafter", r"tensor\(s\) hold other values than were sent: (layer_norms|fc)\."),
    ("partial-policy", "policy", r"tensor\(s\) hold other values than were sent: model\."),
    ("wrong-name", "policy", r"2 tensor\(s\) hold other values than were sent: model\.layers\.[01]\."),
    ("stale", "policy", r"tensor\(s\) hold other values than were sent"),
])
def test_worker_refit_faults_stop_the_step_they_happen_in(tiny, eagle, tmp_path, local_ray, fault, which, match,
                                                          monkeypatch):
    import specrl.cluster.actors as actors
    from specrl.checkpoint.sharded_state import DCP_PART
    from specrl.cluster.async_trainer import AsyncGRPOTrainer
    from tests.faults import faulty_worker

    monkeypatch.setattr(actors, "RolloutWorker", faulty_worker())

    cfg = validate_config(async_cfg(tiny, lag=0, speculative__drafter=f"eagle:{eagle}", drafter__online=True,
                                    drafter__learning_rate=1e-2))
    a = AsyncGRPOTrainer(cfg, tmp_path / "run")
    try:
        a.step()
        parts = ray.get(a.learner.state_parts.remote())  # make sure step 2's policy differs from step 1's
        with torch.no_grad():  # a copy of the actor's modules: shifted, written as a checkpoint part, loaded back
            for p in parts[DCP_PART].policy.parameters():
                p.add_(0.01)
        parts[DCP_PART].write_dir(tmp_path / "shifted")
        ray.get(a.learner.load_parts.remote({DCP_PART: tmp_path / "shifted"}, parts["learner"],
                                            ray.get(a.learner.data_state.remote())))
        a._published = a._publish()
        ray.get(a.workers[0].inject_refit_fault.remote(fault))
        with pytest.raises(RefitError, match=rf"\({which}, version 1\).*worker 0\).*{match}"):
            a.step()
        assert a.step_count == 1  # step 2 was never trained
    finally:
        a.close()

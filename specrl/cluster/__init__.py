"""specrl.cluster: the pipelines on Ray: the async GRPO driver (`async_trainer.py`), its actors (`actors.py`:
rollout workers, learner, weight store), the N data-parallel learner ranks (`learner_group.py`), the local Ray
(`local_ray.py`), and the users' plugins carried to every actor (`plugin_env.py`).

The actors run the same producer and learner code as the sync trainer (`specrl.trainer`); this folder only places
them in processes, moves weights through Ray's object store with versions, and schedules generation ahead of
training within the policy-lag bound. `make_trainer(cfg, run_dir)` is the factory the CLI hands to the run loop:
the sync `GRPOTrainer` for `pipeline.mode: sync`, `AsyncGRPOTrainer` for `async`; with `learner.world_size > 1`
the learner is a `LearnerGroup` of data-parallel ranks (`learner_group`) in either.
"""

from __future__ import annotations

from pathlib import Path


def make_trainer(cfg, run_dir: Path):
    if cfg.pipeline.mode == "async":
        from specrl.cluster.async_trainer import AsyncGRPOTrainer

        return AsyncGRPOTrainer(cfg, run_dir)
    if cfg.learner.world_size > 1:
        from specrl.cluster.learner_group import LearnerGroup
        from specrl.trainer.sync_trainer import GRPOTrainer

        return GRPOTrainer.from_config(cfg, make_learner=LearnerGroup)
    from specrl.run.loop import sync_trainer

    return sync_trainer(cfg, run_dir)

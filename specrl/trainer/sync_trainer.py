"""Synchronous GRPO: the producer and the learner composed in one process, with a versioned weight sync.

One step runs the five timed stages: `data` and `gen` on the producer (`specrl.trainer.producer`), `prepare` (the
learner's named weights and version published through a `WeightSync`) between them, then `logprob` and `train`
on the learner (`specrl.trainer.learner`), which returns the step's `metrics.jsonl` record. Nothing here touches the
rollout backend except through the protocol (`specrl.rollout.protocol`); the backend comes from the registry
(`specrl.backends.registry.build_backend`), and the drafters from their specs
(`specrl.drafters.storage.default.resolve_drafter`).
The async pipeline composes the same producer and learner on Ray actors.
"""

from __future__ import annotations

import random
import time
from collections.abc import Callable
from typing import Any

import numpy as np
import torch

from specrl.algorithms.batch import Batch
from specrl.algorithms.rollouts import Rollouts
from specrl.backends.registry import build_backend, check_backend
from specrl.config.hardware import resolve_hardware
from specrl.config.schema import TrainConfig
from specrl.drafters.storage import default as default_drafter
from specrl.errors import SpecRLError
from specrl.model.hf_checkpoint import parse_dtype
from specrl.model.loader import load_model
from specrl.model.tokenizer import stop_token_ids
from specrl.observability.step_record import StepRecord
from specrl.rollout.protocol import RolloutBackend
from specrl.trainer.learner import Learner
from specrl.trainer.producer import RolloutProducer
from specrl.trainer.scoring import response_logprobs
from specrl.trainer.weight_check import NonFiniteError
from specrl.trainer.weight_sync import LocalWeightSync, WeightSync

__all__ = ["GRPOTrainer", "NonFiniteError", "Rollouts", "Batch", "response_logprobs", "seed_everything"]


class GRPOTrainer:
    """One producer, one learner, one weight sync: the five stages of a synchronous GRPO step."""

    def __init__(self, cfg: TrainConfig, producer: RolloutProducer, learner: Learner, weight_sync: WeightSync):
        self.cfg = cfg
        self.producer = producer
        self.learner = learner
        self.weight_sync = weight_sync
        self.last_rollouts: Rollouts | None = None

    @classmethod
    def from_config(cls, cfg: TrainConfig, backend: RolloutBackend | None = None,
                    make_learner: Callable[[TrainConfig], Any] | None = None) -> GRPOTrainer:
        """Load the model, build the backend (the native engine unless one is given), the drafters, the producer,
        the learner and the in-process weight sync. `make_learner(cfg)` builds a learner with the `Learner`
        interface elsewhere (the data-parallel `specrl.cluster.learner_group.LearnerGroup`)."""
        cfg = resolve_hardware(cfg)  # idempotent: a run's config is already resolved by setup_run
        policy, tokenizer = load_model(cfg.model.name, dtype=parse_dtype(cfg.model.dtype), device=cfg.run.device)
        if tokenizer is None:
            raise SpecRLError(f"model {cfg.model.name!r} has no tokenizer files; GRPO needs one to build prompts")
        ctx = policy.args.max_position_embeddings
        if cfg.model.max_seq_len > ctx:
            raise SpecRLError(f"model.max_seq_len ({cfg.model.max_seq_len}) exceeds the model's context "
                              f"({ctx} positions); set model.max_seq_len <= {ctx}")
        if backend is None:
            backend = build_backend(cfg, policy)
        else:
            check_backend(backend, cfg)
        producer = RolloutProducer(cfg, tokenizer, backend, stop_token_ids(tokenizer, policy.args))
        if make_learner is not None:
            return cls(cfg, producer, make_learner(cfg), LocalWeightSync(backend))
        trainer_drafter = default_drafter.resolve_drafter(cfg.speculative.drafter, policy) if cfg.drafter.online \
            else None
        policy.train()
        return cls(cfg, producer, Learner(cfg, policy, trainer_drafter), LocalWeightSync(backend))

    # ------------------------------------------------------------------ what the run loop reads
    @property
    def policy(self) -> torch.nn.Module:
        return self.learner.policy

    @property
    def drafter(self) -> Any:
        return self.learner.drafter

    @property
    def backend(self) -> RolloutBackend:
        return self.producer.backend

    @property
    def tokenizer(self) -> Any:
        return self.producer.formatter.tokenizer

    @property
    def step_count(self) -> int:
        return self.learner.step_count

    @property
    def log(self):
        return self.learner.log

    @log.setter
    def log(self, fn) -> None:
        self.learner.log = fn

    # ------------------------------------------------------------------ the five stages
    def stage_data(self) -> list[int]:
        return self.producer.stage_data()

    def stage_prepare(self) -> None:
        """Publish the learner's weights (and trainable drafter) with their version to the rollout backend."""
        self.weight_sync.push(*self.learner.named_weights())

    def stage_gen(self, prompt_indices: list[int]) -> Rollouts:
        """The step's groups, then dynamic sampling's extra groups (when grpo.filter_zero_advantage_groups)."""
        step = self.learner.step_count
        r = self.producer.stage_gen(step, prompt_indices)
        return self.producer.fill_groups(step, r, lambda idx, first: self.producer.stage_gen(step, idx, first))

    def step(self) -> StepRecord:
        """data → prepare → gen (producer) → logprob → train (learner); return the step's metrics record."""
        t0 = time.perf_counter()
        prompt_idx = self.stage_data()
        t1 = time.perf_counter()
        self.stage_prepare()
        t2 = time.perf_counter()
        r = self.stage_gen(prompt_idx)
        t3 = time.perf_counter()
        rec = self.learner.learn(r, {"data": t1 - t0, "prepare": t2 - t1, "gen": t3 - t2})
        self.last_rollouts = r
        return rec

    def validate(self) -> dict[str, Any]:
        """Greedy accuracy on the held-out split with the learner's current weights."""
        self.stage_prepare()
        return self.producer.validate()

    def save_final(self, directory) -> None:
        """Write the final policy (the learner's `export`: an HF checkpoint) and the tokenizer into `directory`."""
        self.learner.export(directory)
        self.tokenizer.save_pretrained(str(directory))

    def close(self) -> None:
        """Release the learner's processes, if it has any (the async trainer stops its Ray actors here)."""
        self.learner.close()

    # ------------------------------------------------------------------ checkpoint state
    def check_weights(self, step: int) -> None:
        """The learner's pre-checkpoint check (NaN/inf scan + probe forward/backward); raises NonFiniteError."""
        self.learner.check_weights(step)

    def state_parts(self) -> dict[str, Any]:
        parts = self.learner.state_parts()
        parts["trainer"] = {**parts.pop("learner"), **self.producer.state_dict()}
        return parts

    def load_parts(self, parts: dict[str, Any]) -> None:
        self.learner.load_parts(parts, parts["trainer"])
        self.producer.load_state_dict(parts["trainer"])


def seed_everything(seed: int) -> None:
    random.seed(seed)
    np.random.seed(seed % 2**32)
    torch.manual_seed(seed)

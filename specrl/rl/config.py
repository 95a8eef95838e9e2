"""The training config: pydantic models, YAML loading, `--set key=value` overrides and friendly errors.

This module owns the vocabulary of `specrl train` (NeMo-RL / TRL names such as `grpo.num_prompts_per_step`,
`grpo.num_generations`, `policy.learning_rate`, `generation.temperature`, `speculative.num_draft_tokens`) and
its validation. Every model forbids unknown keys; `load_config` turns pydantic's errors into one
`SpecRLError` that names each bad key by its full dotted path, lists the allowed values, and for misspelled
keys suggests the closest valid one. Cross-field checks (groups of at least two, micro-batches that divide
the batch, prompt + response fitting the context) live on `TrainConfig`.
"""

from __future__ import annotations

import difflib
import re
from pathlib import Path
from typing import Any, Literal

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator

from specrl.errors import SpecRLError
from specrl.rl.backends import SECTION_KEYS, VLLMConfig, check_backend_name
from specrl.rl.losses import LOSSES
from specrl.rollout.drafter_spec import parse_drafter_spec

# Names other libraries (TRL, NeMo-RL, vLLM) use for our keys, so a habit gets pointed at the right key.
SYNONYMS = {
    "lr": "learning_rate",
    "num_samples": "num_generations",
    "num_generations_per_prompt": "num_generations",
    "batch_size": "num_prompts_per_step",
    "epsilon": "clip_low",
    "epsilon_high": "clip_high",
    "ratio_clip_min": "clip_low",
    "ratio_clip_max": "clip_high",
    "beta": "kl_coef",
    "reference_policy_kl_penalty": "kl_coef",
    "scale_rewards": "normalize_rewards",
    "max_completion_length": "max_new_tokens",
    "max_tokens": "max_new_tokens",
    "max_grad_norm_clip": "max_grad_norm",
    "per_device_train_batch_size": "train_micro_batch_size",
    "num_speculative_tokens": "num_draft_tokens",
    "k": "num_draft_tokens",
    "max_steps": "steps",
    "ppo_epochs": "num_iterations",
    "num_ppo_epochs": "num_iterations",
    "num_mini_batches": "mini_batches",
    "loss": "loss_type",
    "dynamic_sampling": "filter_zero_advantage_groups",
    "num_steps": "steps",
}


class _Section(BaseModel):
    model_config = ConfigDict(extra="forbid", validate_assignment=True, allow_inf_nan=False)


class ModelConfig(_Section):
    name: str = Field("smollm2-135m", min_length=1)
    """A preset name (smollm2-135m) or a path to an HF checkpoint directory."""
    dtype: Literal["float32", "bfloat16"] = "float32"
    """Trainer (policy) weights and optimizer dtype."""
    rollout_dtype: Literal["auto", "float32", "bfloat16"] = "auto"
    """Dtype of the rollout engine's copy of the policy. auto: bfloat16 where the device has bf16 matrix units
    (AVX512-BF16 / AMX CPUs, CUDA), float32 elsewhere (AVX2-only CPUs emulate bf16 ~6.6x slower); resolved once at
    start (specrl.device) and recorded as the resolved value in the run's config.yaml."""
    max_seq_len: int = Field(1024, ge=16)
    """Context budget of one sequence (prompt + response) in the rollout engine and trainer."""


class TaskConfig(_Section):
    name: str = "chain_sum"
    difficulty: str = "easy"
    options: dict[str, Any] = Field(default_factory=dict)
    """Raw reasoning-gym generator fields, applied over the difficulty preset."""
    train_size: int = Field(10000, ge=1)
    val_size: int = Field(64, ge=0)
    seed: int = Field(0, ge=0, le=2**63 - 1)
    answer_format: Literal["auto", "number", "reasoning", "tags", "line"] = "auto"
    """How the answer is asked for and read back (specrl.rl.tasks.ANSWER_FORMATS); auto: number for
    chain_sum/basic_arithmetic, tags otherwise."""
    format_weight: float = Field(0.0, ge=0.0)
    """Extra reward when an answer can be read back (see specrl.rl.tasks.score_response)."""
    system_prompt: str | None = None
    """A system turn; None leaves the chat template's default."""
    path: str | None = None
    """name=dataset: a .jsonl / .parquet file or a `datasets` save_to_disk directory (see specrl.rl.data)."""
    validation_path: str | None = None
    """name=dataset: validation rows from this file; else a held-out validation_fraction of task.path."""
    validation_fraction: float = Field(0.1, ge=0.0, lt=1.0)
    split: str = "train"
    """name=dataset: the split of a save_to_disk DatasetDict."""
    prompt_column: str = "prompt"
    """name=dataset: the column holding a prompt string or a list of chat messages."""
    answer_column: str | None = "answer"
    """name=dataset: an optional reference-answer column (every column reaches the reward functions anyway)."""


class RewardConfig(_Section):
    functions: list[str] = Field(default_factory=list)
    """Reward functions `package.module:function` or `path/file.py:function`, each called as
    fn(prompt, completion, row) -> float (see specrl.rl.rewards). Empty: the task's built-in scorer."""
    weights: list[float] | None = None
    """One weight per function (default 1.0 each); the step's reward is the weighted sum."""


class GRPOConfig(_Section):
    num_prompts_per_step: int = Field(8, ge=1)
    num_generations: int = 8
    """Samples per prompt (the group size); GRPO needs at least 2."""
    normalize_rewards: bool | None = None
    """Divide group-centred rewards by the group std (False = Dr. GRPO style, mean-centring only). None: what
    the loss_type expects (true for dapo, grpo, gspo; false for dr_grpo)."""
    loss_type: str = "dapo"
    """The policy loss by name (specrl.rl.losses): dapo (token-level mean over the optimizer step's tokens),
    grpo (each sequence's token mean, then the mean over sequences), dr_grpo (summed tokens over sequences x
    generation.max_new_tokens, advantages not divided by the std), gspo (sequence-level importance ratio)."""
    num_iterations: int = 1
    """Updates per batch (mu in the GRPO paper): passes over the step's rollouts. With one optimizer step per
    batch the proximal log-probs are the train forward's own (no logprob forward); with more, the logprob stage
    computes them from the weights at the start of the step and the clip bounds how far the updates go."""
    mini_batches: int = 1
    """Optimizer steps per iteration: the step's sequences are split into this many contiguous mini-batches
    (must divide num_prompts_per_step * num_generations)."""
    filter_zero_advantage_groups: bool = False
    """DAPO dynamic sampling: drop groups whose rewards are all equal (zero advantage, no gradient) and
    generate more prompts until the step has num_prompts_per_step groups or max_extra_prompt_draws is spent."""
    max_extra_prompt_draws: int = Field(16, ge=0)
    """Cap on the extra prompts one step may draw to replace filtered groups; when it is spent the step trains
    on the groups it has (groups_trained < num_prompts_per_step in metrics.jsonl)."""
    clip_low: float = Field(0.2, ge=0.0, lt=1.0)
    clip_high: float = Field(0.28, ge=0.0)
    kl_coef: float = Field(0.0, ge=0.0)
    """Weight of the k3 KL penalty to the initial policy (0 disables it and the reference model)."""
    val_every: int = Field(5, ge=0)
    """Validation accuracy every N steps (0 = only at the end)."""
    importance_sampling_correction: bool = False
    """Weight each token's policy-gradient term by min(pi_old / mu, cap), mu = the distribution the rollout backend
    sampled from (behaviour log-probs). Off: bit-identical to the uncorrected loss (sync, on-policy)."""
    importance_sampling_cap: float = Field(2.0, ge=1.0)
    """Truncation cap of the importance weights (TIS)."""

    @field_validator("num_generations")
    @classmethod
    def _groups(cls, v: int) -> int:
        if v < 2:
            raise ValueError(f"must be >= 2 (GRPO normalises rewards within a group of samples), got {v}")
        return v

    @field_validator("num_iterations", "mini_batches", mode="before")
    @classmethod
    def _updates(cls, v: Any, info) -> Any:
        what = {"num_iterations": "passes over each batch", "mini_batches": "optimizer steps per pass"}
        if isinstance(v, bool) or not isinstance(v, int) or v < 1:
            raise ValueError(f"must be an integer >= 1 ({what[info.field_name]}; 1 = one), got {v!r}")
        return v

    @field_validator("loss_type")
    @classmethod
    def _loss(cls, v: str) -> str:
        if v not in LOSSES:
            raise ValueError(f"unknown loss {v!r}; allowed: {', '.join(sorted(LOSSES))} (more with "
                             "specrl.rl.losses.register_loss)")
        return v

    @model_validator(mode="after")
    def _std(self) -> GRPOConfig:
        if self.normalize_rewards and not LOSSES[self.loss_type].scale_by_std:
            raise ValueError(f"loss_type={self.loss_type} does not divide advantages by the group std, but "
                             "normalize_rewards=true asks for it; leave normalize_rewards unset (or false), or "
                             "choose a loss_type that scales by the std (dapo, grpo, gspo)")
        return self

    @property
    def scale_advantages_by_std(self) -> bool:
        """Whether advantages are divided by the group std: normalize_rewards, or the loss's own default."""
        if self.normalize_rewards is not None:
            return self.normalize_rewards
        return LOSSES[self.loss_type].scale_by_std

    @property
    def optimizer_steps(self) -> int:
        """Optimizer steps per batch: num_iterations x mini_batches."""
        return self.num_iterations * self.mini_batches


class PolicyConfig(_Section):
    learning_rate: float = 1e-6
    weight_decay: float = Field(0.0, ge=0.0)
    adam_betas: tuple[float, float] = (0.9, 0.999)
    max_grad_norm: float = Field(1.0, gt=0.0)
    lr_schedule: Literal["constant", "linear", "cosine"] = "constant"
    warmup_steps: int = Field(0, ge=0)
    min_lr_ratio: float = Field(0.1, ge=0.0, le=1.0)
    precision: Literal["auto", "fp32", "bf16-mixed"] = "auto"
    """bf16-mixed: fp32 master weights and optimizer, bf16 autocast for the logprob/train forward+backward.
    auto: bf16-mixed where the device has bf16 matrix units, fp32 elsewhere (resolved once at start)."""
    train_micro_batch_size: int = Field(8, ge=1)
    """Sequences per forward/backward (logprob, train); must divide num_prompts_per_step * num_generations."""

    @field_validator("learning_rate")
    @classmethod
    def _lr(cls, v: float) -> float:
        if not v > 0:
            raise ValueError(f"must be > 0 (e.g. 1e-6), got {v}")
        return v


class GenerationConfig(_Section):
    temperature: float = Field(1.0, gt=0.0)
    top_p: float = Field(1.0, gt=0.0, le=1.0)
    top_k: int = Field(0, ge=0)
    max_new_tokens: int = Field(128, ge=1)
    max_batch_size: int = Field(64, ge=1)
    """Rollout engine slots (sequences decoded together)."""


class SpeculativeConfig(_Section):
    drafter: str = "none"
    """none | ngram | suffix | eagle:PATH | eagle:default | eagle:think | mtp:PATH | draft-model:PATH |
    hybrid:LEARNED (a learned drafter spec plus the sibling-suffix drafter, e.g. hybrid:eagle:think)"""
    num_draft_tokens: int | Literal["auto"] = 3
    verify: Literal["rejection", "seed_exact"] = "rejection"

    @field_validator("drafter")
    @classmethod
    def _drafter(cls, v: str) -> str:
        parse_drafter_spec(v)  # the one parser of drafter specs (specrl.rollout.drafter_spec)
        return v

    @field_validator("num_draft_tokens", mode="before")
    @classmethod
    def _k(cls, v: Any) -> int | str:
        if v == "auto":
            return v
        if isinstance(v, bool) or not isinstance(v, int) or v < 0:
            raise ValueError(f"must be an int >= 0 or 'auto', got {v!r}")
        return v

    @property
    def enabled(self) -> bool:
        return self.drafter != "none" and self.num_draft_tokens != 0


class DrafterConfig(_Section):
    online: bool = False
    """Train the drafter during RL on the policy's hidden states (captured in the logprob stage)."""
    online_mode: Literal["every_step", "on_stale"] = "every_step"
    """every_step: the drafter loss joins every policy update (hidden states captured every step). on_stale: no
    per-step drafter loss and no capture; the drafter trains only in the `refresh_steps` updates of a step the
    staleness loop finds stale (acceptance length below staleness_fraction x the reference)."""
    loss_weight: float = Field(0.1, ge=0.0)
    learning_rate: float | None = None
    """Drafter learning rate; None uses policy.learning_rate * 100 (drafters are small and start far off)."""
    staleness_fraction: float = 0.85
    """Refresh the drafter when a step's acceptance length falls below this fraction of the reference AL
    (the AL of the first speculative step after the run start or the last refresh); in (0, 1]."""
    refresh_steps: int = 4
    """Extra drafter-only updates on the step's rollouts when the drafter is stale (needs drafter.online;
    0 disables the refresh)."""
    collapse_threshold: float = 1.05
    """Warn that the drafter looks broken when AL stays <= this (>= 1.0: AL 1.0 means nothing accepted)."""
    collapse_patience: int = 2
    """Consecutive speculative steps at or below collapse_threshold before the warning (>= 1)."""

    @field_validator("learning_rate", mode="before")
    @classmethod
    def _lr(cls, v: Any) -> float | None:
        if v is None:
            return v
        if isinstance(v, str):  # YAML reads 1e-3 (no dot) as a string; accept it like every other float field
            try:
                v = float(v)
            except ValueError:
                pass
        if isinstance(v, bool) or not isinstance(v, int | float) or not v > 0:
            raise ValueError(f"must be a number > 0 or null, got {v!r}")
        return float(v)

    @field_validator("staleness_fraction")
    @classmethod
    def _fraction(cls, v: float) -> float:
        if not 0.0 < v <= 1.0:
            raise ValueError(f"must be in (0, 1] (refresh when AL < fraction x reference AL; e.g. 0.85), got {v}")
        return v

    @field_validator("refresh_steps")
    @classmethod
    def _refresh(cls, v: int) -> int:
        if v < 0:
            raise ValueError(f"must be >= 0 (extra drafter updates per refresh; 0 disables it), got {v}")
        return v

    @field_validator("collapse_threshold")
    @classmethod
    def _collapse(cls, v: float) -> float:
        if not 1.0 <= v < float("inf"):
            raise ValueError("must be a finite number >= 1.0 (acceptance length is at least 1 token per "
                             f"verify; e.g. 1.05), got {v}")
        return v

    @field_validator("collapse_patience")
    @classmethod
    def _patience(cls, v: int) -> int:
        if v < 1:
            raise ValueError(f"must be >= 1 (consecutive low-AL steps before the warning), got {v}")
        return v


class RolloutConfig(_Section):
    backend: str = "native"
    """A registered rollout backend (specrl.rl.backends): native, specrl's engine (the exact reference, seed_exact);
    vllm, vLLM's engine (`make venv-vllm`, run with .venv-vllm/bin/specrl), refit in-process every step."""
    vllm: VLLMConfig = Field(default_factory=VLLMConfig)
    """The vllm backend's settings."""

    @field_validator("backend")
    @classmethod
    def _backend(cls, v: str) -> str:
        return check_backend_name(v)


class RunConfig(_Section):
    name: str = "default"
    seed: int = Field(0, ge=0, le=2**63 - 1)
    steps: int = Field(20, ge=1)
    checkpoint_every: int = Field(5, ge=0)
    """Checkpoint every N steps (0 = only at the end)."""
    keep_checkpoints: int = Field(2, ge=1)
    out_dir: str = "runs"
    overwrite: bool = False
    """Start over in an existing run directory that holds a finished run (deletes its checkpoints/metrics); else
    it is an error. An unfinished run (checkpoints, no final/: killed or failed) is never deleted: the error
    offers `--resume DIR`."""
    tensorboard: bool = True
    loggers: list[Literal["wandb", "mlflow"]] = Field(default_factory=list)
    """Extra loggers with metrics.jsonl's names: wandb (offline unless WANDB_MODE is set; RUN/wandb) and mlflow
    (a local file store RUN/mlruns unless MLFLOW_TRACKING_URI is set)."""
    progress: bool = True
    """Live terminal display (rich); falls back to one plain line per step when not a TTY."""
    device: str = "auto"
    """auto | cpu | cuda | cuda:N: where the policy, its rollout copy, the reference model, the drafter and their
    training run; auto = cuda when a CUDA device is visible, else cpu (resolved once at start)."""
    threads: int | Literal["auto"] = "auto"
    """torch threads of the sync pipeline (rollouts and training in one process). auto: the cores other processes
    leave free, re-read before every step (a competing job then costs its share of the CPU instead of stalling
    torch's threads); an integer is used as given (at most the cores this process may run on) and keeps a run
    bitwise reproducible. The async pipeline sizes its actors with pipeline.worker_threads / learner_threads."""

    @field_validator("threads", mode="before")
    @classmethod
    def _threads(cls, v: Any) -> Any:
        if v == "auto" or (isinstance(v, int) and not isinstance(v, bool) and v >= 1):
            return v
        raise ValueError(f"must be an integer >= 1 or 'auto', got {v!r}")

    @field_validator("device")
    @classmethod
    def _device(cls, v: str) -> str:
        if not re.fullmatch(r"auto|cpu|cuda(:\d+)?", v):
            raise ValueError(f"must be auto, cpu, cuda or cuda:N (e.g. cuda:0), got {v!r}")
        return v

    @field_validator("name")
    @classmethod
    def _name(cls, v: str) -> str:
        if not re.fullmatch(r"[A-Za-z0-9_.-]+", v):
            raise ValueError(f"must be letters, digits, '_', '-', '.' only (it names a directory), got {v!r}")
        return v


class PipelineConfig(_Section):
    mode: Literal["sync", "async"] = "sync"
    """sync: one process alternates generation and training. async: rollout workers and one learner on Ray
    actors; generation for the next steps overlaps training, within `max_trajectory_age_steps`."""
    num_rollout_workers: int = Field(1, ge=1)
    """Rollout-worker actors (each owns a backend, a drafter and `worker_threads` torch threads)."""
    worker_threads: int = Field(1, ge=1)
    learner_threads: int = Field(1, ge=1)
    max_trajectory_age_steps: int = 1
    """Policy lag: step s trains only on groups generated by policy version >= s - 1 - this (0 = on-policy)."""
    ray_address: str | None = None
    """A Ray cluster to join (e.g. "ray://head:10001" or "auto"); None starts Ray locally with
    num_rollout_workers * worker_threads + learner_threads CPUs."""
    in_flight_updates: bool = False
    """async: a rollout worker also picks up a newer published policy between engine (decode) steps, inside a
    share, so one sequence may span two versions; each token records its version, and the IS correction uses
    each token's behaviour log-prob (false: new weights are loaded between shares only)."""

    @field_validator("max_trajectory_age_steps")
    @classmethod
    def _age(cls, v: int) -> int:
        if v < 0:
            raise ValueError(f"must be >= 0 (0 = on-policy, 1 = one step of lag, ...), got {v}")
        return v


class LearnerConfig(_Section):
    world_size: int = Field(1, ge=1)
    """Data-parallel learner ranks. 1: the learner runs in the trainer's process (sync) or in the learner actor
    (async). N > 1: N Ray actors in a placement group, one torch.distributed process group (gloo on CPU, nccl on
    CUDA), the policy and online drafter sharded with FSDP2; each rank trains num_prompts_per_step / N whole groups
    (specrl.rl.data_parallel, specrl.distributed.learner_group)."""
    threads: int = Field(1, ge=1)
    """torch threads of each learner rank when world_size > 1 (the ranks need world_size * threads CPUs)."""
    collective_timeout_s: float = Field(600.0, gt=0.0)
    """world_size > 1: a collective that waits longer than this (a dead or stuck rank) fails the step; the run
    stops with the last good checkpoint and the --resume command."""


class TrainConfig(_Section):
    model: ModelConfig = Field(default_factory=ModelConfig)
    task: TaskConfig = Field(default_factory=TaskConfig)
    grpo: GRPOConfig = Field(default_factory=GRPOConfig)
    policy: PolicyConfig = Field(default_factory=PolicyConfig)
    generation: GenerationConfig = Field(default_factory=GenerationConfig)
    speculative: SpeculativeConfig = Field(default_factory=SpeculativeConfig)
    drafter: DrafterConfig = Field(default_factory=DrafterConfig)
    reward: RewardConfig = Field(default_factory=RewardConfig)
    run: RunConfig = Field(default_factory=RunConfig)
    pipeline: PipelineConfig = Field(default_factory=PipelineConfig)
    rollout: RolloutConfig = Field(default_factory=RolloutConfig)
    learner: LearnerConfig = Field(default_factory=LearnerConfig)

    @model_validator(mode="after")
    def _cross(self) -> TrainConfig:
        batch = self.grpo.num_prompts_per_step * self.grpo.num_generations
        mb = self.policy.train_micro_batch_size
        if batch % mb != 0:
            divisors = [d for d in range(1, batch + 1) if batch % d == 0]
            raise ValueError(
                f"policy.train_micro_batch_size ({mb}) must divide grpo.num_prompts_per_step * "
                f"grpo.num_generations = {batch}; valid values: {divisors}"
            )
        mbs = self.grpo.mini_batches
        if batch % mbs != 0:
            divisors = [d for d in range(1, batch + 1) if batch % d == 0]
            raise ValueError(
                f"grpo.mini_batches ({mbs}) must divide grpo.num_prompts_per_step * grpo.num_generations = "
                f"{batch} (each optimizer step takes an equal share of the step's sequences); valid values: "
                f"{divisors}"
            )
        if self.generation.max_new_tokens >= self.model.max_seq_len:
            raise ValueError(
                f"generation.max_new_tokens ({self.generation.max_new_tokens}) leaves no room for the prompt "
                f"in model.max_seq_len ({self.model.max_seq_len}); lower it or raise model.max_seq_len"
            )
        if self.drafter.online and not parse_drafter_spec(self.speculative.drafter).info.trainable:
            raise ValueError(
                f"drafter.online trains a learned drafter, but speculative.drafter is "
                f"{self.speculative.drafter!r}; use eagle:PATH / eagle:default / mtp:PATH "
                "or drafter.online=false"
            )
        d = self.drafter
        if d.online_mode == "on_stale" and not (d.online and d.refresh_steps >= 1):
            raise ValueError(
                "drafter.online_mode=on_stale trains the online drafter only in its staleness refreshes, which needs "
                f"drafter.online=true (now {str(d.online).lower()}) and drafter.refresh_steps >= 1 (now "
                f"{d.refresh_steps}); set those, or drafter.online_mode=every_step"
            )
        ro = self.rollout
        if ro.backend == "vllm":
            if self.speculative.enabled and self.speculative.verify == "seed_exact":
                raise ValueError(
                    "speculative.verify=seed_exact is native-only (it replays the native engine's position-keyed "
                    "noise, which vLLM does not have); use rollout.backend=native or speculative.verify=rejection"
                )
            if self.speculative.enabled and self.speculative.num_draft_tokens == "auto":
                raise ValueError("speculative.num_draft_tokens=auto is native-only; the vLLM backend needs a fixed k")
            if ro.vllm.max_model_len is not None and ro.vllm.max_model_len < self.model.max_seq_len:
                raise ValueError(f"rollout.vllm.max_model_len ({ro.vllm.max_model_len}) is below model.max_seq_len "
                                 f"({self.model.max_seq_len}); raise it or leave it null")
        if self.task.name == "dataset" and not self.reward.functions:
            raise ValueError("task.name=dataset has no built-in scorer: give reward.functions (import paths of "
                             "fn(prompt, completion, row) -> float), e.g. examples/custom_task/reward.py:exact_match")
        if self.task.name == "dataset" and not self.task.path:
            raise ValueError("task.name=dataset needs task.path (a .jsonl / .parquet file or a save_to_disk dir)")
        rw = self.reward
        if rw.weights is not None and len(rw.weights) != len(rw.functions):
            raise ValueError(f"reward.weights has {len(rw.weights)} entries but reward.functions has "
                             f"{len(rw.functions)}; give one weight per function")
        ws = self.learner.world_size
        if ws > 1 and self.grpo.num_prompts_per_step % ws != 0:
            raise ValueError(f"learner.world_size ({ws}) must divide grpo.num_prompts_per_step "
                             f"({self.grpo.num_prompts_per_step}): each rank trains an equal share of whole groups")
        pl = self.pipeline
        if pl.mode == "async" and self.run.threads != "auto":
            raise ValueError(
                f"run.threads={self.run.threads} sets the sync pipeline's torch threads; the async pipeline's actors "
                "take pipeline.worker_threads and pipeline.learner_threads: set those and leave run.threads=auto"
            )
        if pl.mode == "async" and pl.max_trajectory_age_steps > 0 and not self.grpo.importance_sampling_correction:
            raise ValueError(
                f"pipeline.max_trajectory_age_steps={pl.max_trajectory_age_steps} trains on rollouts of older policy "
                "versions, which needs grpo.importance_sampling_correction=true (truncated importance sampling); "
                "set it, or pipeline.max_trajectory_age_steps=0"
            )
        if pl.in_flight_updates and pl.mode != "async":
            raise ValueError("pipeline.in_flight_updates=true loads weights published while a rollout worker "
                             "generates, which only the async pipeline does; set pipeline.mode=async or "
                             "pipeline.in_flight_updates=false")
        if pl.in_flight_updates and self.speculative.verify == "seed_exact":
            raise ValueError(
                "pipeline.in_flight_updates=true with speculative.verify=seed_exact: seed_exact promises the tokens "
                "of plain decoding, but an in-flight update lands between engine steps, which cover one token in "
                "plain decoding and up to k+1 in speculative decoding (and whose timing depends on the learner), so "
                "the switch point and the tokens cannot be reproduced; set speculative.verify=rejection (lossless "
                "in distribution) or pipeline.in_flight_updates=false")
        return self

    def to_yaml(self) -> str:
        return yaml.safe_dump(self.model_dump(mode="json"), sort_keys=False)


# ----------------------------------------------------------------------------- loading and errors


def _valid_keys(model: type[BaseModel], prefix: str = "") -> list[str]:
    out = []
    for name, field in model.model_fields.items():
        path = f"{prefix}{name}"
        out.append(path)
        ann = field.annotation
        if isinstance(ann, type) and issubclass(ann, BaseModel):
            out.extend(_valid_keys(ann, path + "."))
    return out


def _section_at(loc: tuple) -> type[BaseModel] | None:
    model: type[BaseModel] = TrainConfig
    for part in loc:
        field = model.model_fields.get(str(part))
        ann = field.annotation if field else None
        if not (isinstance(ann, type) and issubclass(ann, BaseModel)):
            return None
        model = ann
    return model


def closest_key(key: str, choices: list[str]) -> str | None:
    """The valid key a misspelling most likely meant: a known synonym, difflib similarity, or a prefix."""
    synonym = SYNONYMS.get(key)
    if synonym in choices:
        return synonym
    close = difflib.get_close_matches(key, choices, n=1, cutoff=0.6)
    if close:
        return close[0]
    prefixed = [c for c in choices if c.startswith(key) or key.startswith(c)]
    if len(prefixed) == 1:
        return prefixed[0]
    close = difflib.get_close_matches(key, choices, n=1, cutoff=0.4)
    return close[0] if close else None


def _format_error(err: dict) -> str:
    loc = tuple(p for p in err["loc"] if not (isinstance(p, str) and p.startswith("function-")))
    path = ".".join(str(p) for p in loc) or "config"
    msg = err["msg"]
    if msg.startswith("Value error, "):
        msg = msg[len("Value error, "):]
    if err["type"] == "extra_forbidden":
        parent = _section_at(loc[:-1])
        choices = list(parent.model_fields) if parent else []
        close = closest_key(str(loc[-1]), choices)
        if path in SECTION_KEYS:  # a backend's own setting outside its section
            new = SECTION_KEYS[path]
            return f"{path}: unknown key; did you mean '{new}'? ({new.rpartition('.')[0]} holds those settings)"
        hint = f"; did you mean '{'.'.join(str(p) for p in loc[:-1] + (close,))}'?" if close else "."
        return f"{path}: unknown key{hint} Valid keys here: {', '.join(choices)}"
    if err["type"] == "literal_error":
        return f"{path}: {msg}, got {err.get('input')!r}"
    if err["type"] in ("model_type", "dict_type"):
        return f"{path}: must be a mapping of keys, got {err.get('input')!r}"
    if err["type"] not in ("value_error", "assertion_error") and "input" in err:
        return f"{path}: {msg}, got {err['input']!r}"
    return f"{path}: {msg}"


def validate_config(data: dict[str, Any], source: str = "config") -> TrainConfig:
    """Validate a nested dict into a TrainConfig, or raise SpecRLError listing every problem."""
    if not isinstance(data, dict):
        raise SpecRLError(f"{source}: the top level must be a mapping of sections, got {type(data).__name__}")
    try:
        return TrainConfig.model_validate(data)
    except ValidationError as e:
        lines = [_format_error(err) for err in e.errors()]
        raise SpecRLError(f"invalid {source}:\n  " + "\n  ".join(lines)) from None


def apply_override(data: dict[str, Any], assignment: str) -> None:
    """Apply one `a.b.c=value` override in place; the value is parsed as YAML (so 1e-6, true, [1,2] work)."""
    if "=" not in assignment:
        raise SpecRLError(f"--set expects key=value (e.g. grpo.num_generations=4), got {assignment!r}")
    key, _, raw = assignment.partition("=")
    key = key.strip()
    parts = key.split(".")
    if not key or any(not p for p in parts):
        raise SpecRLError(f"--set key {key!r} must be a dotted path like policy.learning_rate")
    try:
        value = yaml.safe_load(raw) if raw.strip() else ""
    except yaml.YAMLError as e:
        raise SpecRLError(f"--set {key}: cannot parse value {raw!r}: {e}") from None
    if len(parts) == 1 and parts[0] in TrainConfig.model_fields:
        raise SpecRLError(f"--set {key}: '{key}' is a section; set one of its keys, e.g. {key}.<key>=value")
    node = data
    for i, part in enumerate(parts[:-1]):
        nxt = node.setdefault(part, {})
        if not isinstance(nxt, dict):
            raise SpecRLError(f"--set {key}: '{'.'.join(parts[:i + 1])}' is a value, not a section")
        node = nxt
    node[parts[-1]] = value


class _UniqueKeyLoader(yaml.SafeLoader):
    """SafeLoader that refuses a key given twice in one mapping (plain YAML silently keeps the last one)."""


def _unique_mapping(loader: _UniqueKeyLoader, node: yaml.MappingNode, deep: bool = False) -> dict:
    seen: dict[Any, int] = {}
    for key_node, _ in node.value:
        key = loader.construct_object(key_node, deep=deep)
        if key in seen:
            raise SpecRLError(f"{loader.name}: key {key!r} is given twice in one section (lines {seen[key] + 1} and "
                              f"{key_node.start_mark.line + 1}); YAML would silently keep the last one: remove one")
        seen[key] = key_node.start_mark.line
    return loader.construct_mapping(node, deep=deep)


_UniqueKeyLoader.add_constructor(yaml.resolver.BaseResolver.DEFAULT_MAPPING_TAG, _unique_mapping)


def read_text_file(p: Path, what: str) -> str:
    """A text file's contents; a SpecRLError naming the file when it is a directory or not UTF-8."""
    if p.is_dir():
        raise SpecRLError(f"{what} {p} is a directory; pass a file" + (
            f", e.g. one of {sorted(str(f) for f in p.glob('*.yaml'))[:3]}" if any(p.glob("*.yaml")) else ""))
    try:
        return p.read_text(encoding="utf-8-sig")  # a leading byte-order mark is not content
    except UnicodeDecodeError as e:
        raise SpecRLError(f"{what} {p} is not UTF-8 text (byte {e.object[e.start]:#04x} at offset {e.start}); "
                          "save it as UTF-8") from None
    except OSError as e:
        raise SpecRLError(f"cannot read {what} {p}: {e.strerror or e}") from None


def load_yaml(p: Path, what: str = "config file") -> Any:
    """Parse a YAML file strictly: UTF-8, no duplicated keys, clear errors naming the file."""
    text = read_text_file(p, what)
    try:
        loader = _UniqueKeyLoader(text)
        loader.name = str(p)
        try:
            return loader.get_single_data()
        finally:
            loader.dispose()
    except yaml.YAMLError as e:
        raise SpecRLError(f"{p}: not valid YAML: {e}") from None


def load_config(path: str | Path | None, sets: list[str] | None = None) -> TrainConfig:
    """Read a YAML config (or start from defaults when path is None), apply --set overrides, validate."""
    data: dict[str, Any] = {}
    source = "config"
    if path is not None:
        p = Path(path)
        if not p.exists():
            raise SpecRLError(f"config file {str(p)!r} does not exist; pass an existing YAML, e.g. "
                              "examples/default.yaml")
        source = str(p)
        loaded = load_yaml(p)
        if loaded is None:
            raise SpecRLError(f"{p} is empty (or only comments); an empty config would start a run with every "
                              "default. Give at least one section (e.g. `run: {steps: 5}`), or use "
                              "examples/default.yaml")
        if not isinstance(loaded, dict):
            raise SpecRLError(f"{p}: the top level must be a mapping of sections (model, task, grpo, ...)")
        data = loaded
    for s in sets or []:
        apply_override(data, s)
    if sets:
        source += " with --set " + " ".join(sets)
    return validate_config(data, source)


def valid_keys() -> list[str]:
    """Every dotted key the config accepts (for docs and error messages)."""
    return _valid_keys(TrainConfig)

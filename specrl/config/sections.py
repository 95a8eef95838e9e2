"""The sections of the training config: one pydantic model per YAML section (model, task, reward, grpo, policy,
generation, speculative, drafter, rollout, run, pipeline, learner), each with its keys, defaults, docstrings and
per-key checks. Every model forbids unknown keys and non-finite numbers. Names that registries own (a loss, a rollout
backend, a drafter spec) are plain strings here: the registries check them where they are looked up
(`specrl.trainer.config_check`, run right after loading). `specrl.config.schema` composes the sections into
`TrainConfig` (with the cross-field checks) and owns loading, `--set` overrides and the friendly errors.
"""

from __future__ import annotations

import re
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator

from specrl.config.certificate import CertificateConfig
from specrl.config.vllm import VLLMConfig

NO_DRAFTER = "none"  # the `speculative.drafter` value for plain decoding (the kinds table's one non-drafting row)


class _Section(BaseModel):
    model_config = ConfigDict(extra="forbid", validate_assignment=True, allow_inf_nan=False)


class ModelConfig(_Section):
    name: str = Field("smollm2-135m", min_length=1)
    """A preset name (smollm2-135m) or a path to an HF checkpoint directory."""
    dtype: Literal["float32", "bfloat16"] = "float32"
    """Trainer (policy) weights and optimizer dtype."""
    rollout_dtype: Literal["auto", "float32", "bfloat16"] = "auto"
    """Dtype of the rollout engine's copy of the policy. auto: bfloat16 where the device has bf16 matrix units
    (AVX512-BF16 / AMX CPUs, CUDA), float32 elsewhere (AVX2-only CPUs emulate bf16, slowly: docs/benchmarks.md);
    resolved once at start (specrl.device) and recorded as the resolved value in the run's config.yaml."""
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
    """How the answer is asked for and read back (specrl.data.tasks.ANSWER_FORMATS); auto: number for
    chain_sum/basic_arithmetic, tags otherwise."""
    format_weight: float = Field(0.0, ge=0.0)
    """Extra reward when an answer can be read back (see specrl.data.tasks.score_response)."""
    system_prompt: str | None = None
    """A system turn; None leaves the chat template's default."""
    path: str | None = None
    """name=dataset: a .jsonl / .parquet file or a `datasets` save_to_disk directory (see specrl.data.datasets)."""
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
    fn(prompt, completion, row) -> float (see specrl.data.rewards). Empty: the task's built-in scorer."""
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
    """The policy loss by name (specrl.algorithms.losses): dapo (token-level mean over the optimizer step's tokens),
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
    clip_low: float | None = Field(None, ge=0.0, lt=1.0)
    """Lower clip of the importance ratio (1 - clip_low). Unset: the loss_type's default (dapo 0.2, grpo and
    dr_grpo 0.2, gspo 3e-4: its sequence-level ratio moves far less than a token's; specrl.algorithms.losses)."""
    clip_high: float | None = Field(None, ge=0.0)
    """Upper clip (1 + clip_high). Unset: the loss_type's default (dapo 0.28: DAPO's clip-higher; grpo and
    dr_grpo 0.2; gspo 4e-4)."""
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
    per_sequence_k: bool = False
    """Native engine: each sequence keeps only k_i <= k of the step's drafts, from its own recent acceptance
    (specrl.rollout.spec_decode.seq_budget); off by default (docs/speculative_benchmarks.md has the side-by-side
    figures)."""

    confidence_cut: Literal["off", "row", "column"] = "off"
    """Native engine: after drafting, each row verifies only the drafts whose calibrated acceptance (from the
    drafter's own q) pays for their verify rows at the active batch size, priced by auto k's cost model
    (specrl.rollout.spec_decode.confidence). row: per row; column: per padded verify column; off by default."""

    @field_validator("confidence_cut", mode="before")
    @classmethod
    def _confidence_cut(cls, v: Any) -> str:
        if v not in ("off", "row", "column"):
            raise ValueError(f"must be one of off, row, column (drafts cut by the drafter's confidence: off; per row; "
                             f"per padded verify column), got {v!r}")
        return v

    @field_validator("per_sequence_k", mode="before")
    @classmethod
    def _per_sequence_k(cls, v: Any) -> bool:
        if not isinstance(v, bool):
            raise ValueError(f"must be true or false (per-sequence draft budgets on or off), got {v!r}")
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
        """Whether the run speculates: a drafter and k != 0. `NO_DRAFTER` is the one kind that means plain decoding
        (the kinds table's row for it is named by it and refuses another: `register_drafter_kind`)."""
        return self.drafter != NO_DRAFTER and self.num_draft_tokens != 0


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
    """A registered rollout backend (specrl.backends.registry): native, specrl's engine (the exact reference,
    seed_exact);
    vllm, vLLM's engine (`make venv-vllm`, run with .venv-vllm/bin/specrl), refit in-process every step."""
    vllm: VLLMConfig = Field(default_factory=VLLMConfig)
    """The vllm backend's settings."""


class RunConfig(_Section):
    name: str = "default"
    seed: int = Field(0, ge=0, le=2**63 - 1)
    steps: int = Field(20, ge=1)
    checkpoint_every: int = Field(5, ge=0)
    """Checkpoint every N steps (0 = only at the end)."""
    keep_checkpoints: int = Field(2, ge=1)
    time_budget_minutes: float | None = Field(None, gt=0)
    """Wall-clock budget of the run after its set-up: step 0's validation, the steps (with their validations and
    checkpoints) and the final validation. The run stops before a step (in a compare, a pair of the arms' steps)
    that would end past it, predicted from the slowest step so far plus as long as step 0's validation took, and
    ends normally at that step (validation, checkpoint, final policy, report), saying that it stopped at step N of
    `steps`. None: every step runs."""
    wall_budget_minutes: float | None = Field(None, gt=0)
    """The whole command's wall clock, set-up included, from SPECRL_WALL_START (epoch seconds; `make run` sets it
    before its set-up) or else from the run's start: the steps stop, as for time_budget_minutes, where the next
    would end past it less the certificate's reserve (twice run.certificate.budget_seconds) and 30 s for the report,
    and sizing plans with what is left of it when that is less (specrl.run.sizing.wall_deadline). None: no limit."""
    min_steps: int | None = Field(None, ge=1)
    """With run.time_budget_minutes: size the per-step work (generation.max_new_tokens, task.val_size) to the
    processor class measured at start so this many steps per arm fit the budget (specrl.run.sizing; what was sized
    and why goes to sizing.json and the report). None: the work as configured."""
    certify: bool = True
    """At the end of a speculative sync run, test the run's final policy and drafter with the losslessness probe on
    the run's own k policy, verify mode and sampling settings (`specrl.run.certificate`: certificate.json; a compare
    fails if it does)."""
    certificate: CertificateConfig = Field(default_factory=CertificateConfig)
    """The certificate's size: its target bias and time budget (`specrl.config.certificate`)."""
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
    (specrl.parallel.data_parallel, specrl.cluster.learner_group)."""
    threads: int = Field(1, ge=1)
    """torch threads of each learner rank when world_size > 1 (the ranks need world_size * threads CPUs)."""
    collective_timeout_s: float = Field(600.0, gt=0.0)
    """world_size > 1: a collective that waits longer than this (a dead or stuck rank) fails the step; the run
    stops with the last good checkpoint and the --resume command."""

"""The training config: `TrainConfig` (the sections of `specrl.config.sections` and the cross-field checks),
YAML loading, `--set key=value` overrides and friendly errors.

This module owns the vocabulary of `specrl train` (NeMo-RL / TRL names such as `grpo.num_prompts_per_step`,
`grpo.num_generations`, `policy.learning_rate`, `generation.temperature`, `speculative.num_draft_tokens`) and
its validation. Every model forbids unknown keys; `load_config` turns pydantic's errors into one
`SpecRLError` that names each bad key by its full dotted path, lists the allowed values, and for misspelled
keys suggests the closest valid one. Cross-field checks (groups of at least two, micro-batches that divide
the batch, prompt + response fitting the context) live on `TrainConfig`. Names owned by registries (loss, backend,
drafter spec) are checked by `specrl.trainer.config_check`, which every entry point calls right after loading.
"""

from __future__ import annotations

import difflib
from pathlib import Path
from typing import Any

import yaml
from pydantic import BaseModel, Field, ValidationError, model_validator

from specrl.config.sections import (  # noqa: F401  (the sections are part of this module's API)
    DrafterConfig,
    GenerationConfig,
    GRPOConfig,
    LearnerConfig,
    ModelConfig,
    PipelineConfig,
    PolicyConfig,
    RewardConfig,
    RolloutConfig,
    RunConfig,
    SpeculativeConfig,
    TaskConfig,
    _Section,
)
from specrl.config.vllm import SECTION_KEYS
from specrl.errors import SpecRLError

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


TOP_LEVEL_KEYS = ("plugins",)  # top-level keys that hold a value, not a section


class TrainConfig(_Section):
    plugins: list[str] = Field(default_factory=list)
    """Modules (dotted names) or .py files with users' extensions (losses, drafter kinds, backends, rewards),
    imported in every process before the config is validated (`specrl.plugins`)."""
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
        d = self.drafter
        if d.online and d.online_mode == "on_stale" and d.refresh_steps < 1:  # (without online it is moot)
            raise ValueError(
                "drafter.online_mode=on_stale trains the online drafter only in its staleness refreshes, which needs "
                f"drafter.refresh_steps >= 1 (now {d.refresh_steps}); set it, or drafter.online_mode=every_step"
            )
        r = self.run
        if r.wall_budget_minutes is not None and r.certify and self.speculative.enabled and not isinstance(
                r.certificate.budget_seconds, int | float):
            raise ValueError(
                "run.wall_budget_minutes keeps the certificate's time out of the steps' budget, which needs "
                f"run.certificate.budget_seconds in seconds, got {r.certificate.budget_seconds!r}: set it (e.g. 60), "
                "or run.certify=false, or run.wall_budget_minutes=null"
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
            if self.speculative.enabled and self.speculative.per_sequence_k:
                raise ValueError("speculative.per_sequence_k=true is native-only (vLLM drafts the same k for every "
                                 "sequence); set speculative.per_sequence_k=false or rollout.backend=native")
            if self.speculative.enabled and self.speculative.confidence_cut != "off":
                raise ValueError("speculative.confidence_cut is native-only (vLLM verifies every drafted token); set "
                                 "speculative.confidence_cut=off or rollout.backend=native")
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
    from specrl.plugins import load_plugins

    # users' registrations first, so the names they add are known when the sections are checked
    data = {**data, "plugins": load_plugins(data.get("plugins") or [])}
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
    if len(parts) == 1 and parts[0] in TrainConfig.model_fields and parts[0] not in TOP_LEVEL_KEYS:
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
    if path is not None:
        p = Path(path)
        if not p.exists():
            raise SpecRLError(f"config file {str(p)!r} does not exist; pass an existing YAML, e.g. "
                              "examples/default.yaml")
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
    return validate_config(data, describe_source(path, sets))


def describe_source(path: str | Path | None, sets: list[str] | None = None) -> str:
    """How the errors of `load_config(path, sets)` name the config: the file (or `config`) and its --set overrides."""
    source = "config" if path is None else str(Path(path))
    return source + (" with --set " + " ".join(sets) if sets else "")


def valid_keys() -> list[str]:
    """Every dotted key the config accepts (for docs and error messages)."""
    return _valid_keys(TrainConfig)

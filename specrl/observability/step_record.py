"""The step record: one typed line of `metrics.jsonl` per RL step.

`StepRecord` is built once per step by the learner (`Learner.learn`) with the fields every pipeline has; the
pipeline that owns a field adds it: the sync run loop sets `torch_threads`, the async pipeline sets its wall-clock
`step_seconds` / `gen_share` and its `async_fields` (`AsyncStepFields`), a data-parallel rank sets `rank_tokens`
(dropped when the ranks' records merge), and a validation step adds `accuracy` and `validation`. `to_json()` gives
the `metrics.jsonl` line: the same keys the loggers (TensorBoard, W&B, MLflow) log by name, plus `schema_version`.
`read_records(path)` loads a file into `StepRecord`s, including files written without a `schema_version`; keys
this version does not know are kept in `extra` and written back unchanged. `record["key"]` and `record.get(key)`
read a field by its `metrics.jsonl` name.
"""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from specrl.errors import SpecRLError

SCHEMA_VERSION = 1

# the keys every line of metrics.jsonl carries (a record given as a mapping must have them)
STEP_FIELDS = (
    "step", "reward_mean", "reward_std", "accuracy", "response_length_mean", "stage_seconds",
    "step_seconds", "gen_share", "acceptance_length", "acceptance_rate", "acceptance_rate_per_position",
    "num_draft_tokens_mean", "token_mult_prob_error", "draft_loss", "draft_updates", "generated_tokens",
    "gen_tokens_per_second",
)


@dataclass(kw_only=True)
class AsyncStepFields:
    """The async pipeline's per-step fields (`specrl.cluster.async_trainer`)."""

    exposed_gen_seconds: float | None = None
    gen_seconds_workers: float | None = None
    learner_idle_ratio: float | None = None
    trajectory_age_mean: float | None = None
    trajectory_age_max: int | None = None
    group_policy_versions: list[int] = field(default_factory=list)
    dropped_stale_groups: int | None = None
    max_trajectory_age_steps: int | None = None
    refit_seconds: float | None = None
    publish_seconds: float | None = None
    trained_samples: int | None = None
    trained_request_id_range: list[int] = field(default_factory=list)
    trained_prompt_indices: list[int] = field(default_factory=list)
    mixed_version_samples: int | None = None


_ASYNC_KEYS = tuple(f.name for f in dataclasses.fields(AsyncStepFields))
VALIDATION_KEYS = ("val_reward", "val_format_rate", "val_seconds", "val_questions")
# written only where the drafter keeps a history index (suffix, hybrid)
HISTORY_FIELDS = ("history_rows", "history_drafted", "history_accepted", "history_index_tokens")


@dataclass(kw_only=True)
class StepRecord:
    """One RL step's metrics; field names are the `metrics.jsonl` keys (see the module docstring for owners)."""

    step: int
    reward_mean: float | None = None
    reward_std: float | None = None
    accuracy: float | None = None  # held-out accuracy on validation steps, None otherwise
    response_length_mean: float | None = None
    response_lengths: list[int] = field(default_factory=list)
    batch_trace: list[Any] = field(default_factory=list)
    stage_seconds: dict[str, float] = field(default_factory=dict)
    step_seconds: float | None = None
    gen_share: float | None = None
    logprob_skipped: bool = False
    acceptance_length: float | None = None
    acceptance_rate: float | None = None
    acceptance_rate_per_position: list[float] = field(default_factory=list)
    num_draft_tokens_mean: float | None = None
    draft_tokens: int | None = None  # drafts verified this step (padding of ragged proposals not counted)
    accepted_tokens: int | None = None  # of those, accepted
    verify_steps: int | None = None  # row-steps that speculated (a row verified once)
    sequence_steps: int | None = None  # row-steps in all (speculative or plain)
    history_rows: int | None = None  # of verify_steps, the rows whose draft came from the prompt's history
    history_drafted: int | None = None  # of draft_tokens, those from history
    history_accepted: int | None = None  # of accepted_tokens, those from history
    history_index_tokens: int | None = None  # tokens the history index held after the step's rollouts
    prompt_indices: list[int] = field(default_factory=list)  # the step's train prompts, one per group (in order)
    token_mult_prob_error: float | None = None
    draft_loss: float | None = None
    draft_updates: int | None = None
    draft_refreshed: bool | None = None
    drafter_collapsed: bool | None = None
    acceptance_length_reference: float | None = None
    generated_tokens: int | None = None
    gen_tokens_per_second: float | None = None
    train_accuracy: float | None = None
    format_rate: float | None = None
    reward_components: dict[str, float] = field(default_factory=dict)
    truncated_fraction: float | None = None
    policy_version: int | None = None
    policy_lag: int | None = None
    device: str | None = None
    processor_class: str | None = None
    rollout_dtype: str | None = None
    precision: str | None = None
    groups: int | None = None  # groups generated this step
    groups_nonzero_advantage: int | None = None  # of those, groups whose rewards were not all equal
    groups_trained: int | None = None
    groups_filtered: int | None = None
    extra_prompts_drawn: int | None = None
    reward_mean_generated: float | None = None
    loss: float | None = None
    grad_norm: float | None = None
    lr: float | None = None
    clip_fraction: float | None = None
    kl: float | None = None
    ratio_mean: float | None = None
    optimizer_steps: int | None = None
    is_ratio_mean: float | None = None
    is_ratio_max: float | None = None
    is_clipped_fraction: float | None = None
    # added by the pipeline that owns them; written only when set
    torch_threads: int | None = None
    rank_tokens: float | None = None
    async_fields: AsyncStepFields | None = None
    validation: dict[str, Any] | None = None
    extra: dict[str, Any] = field(default_factory=dict)

    def add_validation(self, values: dict[str, Any]) -> None:
        """A validation step's results: `accuracy` into its field, the rest (`val_reward`, ...) into `validation`."""
        rest = dict(values)
        if "accuracy" in rest:
            self.accuracy = rest.pop("accuracy")
        self.validation = {**(self.validation or {}), **rest}

    def as_dict(self) -> dict[str, Any]:
        """The record as the `metrics.jsonl` mapping (without `schema_version`), values as they are."""
        out: dict[str, Any] = {}
        for f in dataclasses.fields(self):
            if f.name in _SECTIONS:
                continue
            out[f.name] = getattr(self, f.name)
        for name in ("torch_threads", "rank_tokens", *HISTORY_FIELDS):
            if out[name] is None:
                del out[name]
        if not out["prompt_indices"]:  # set by the learner for every step; absent from records built without it
            del out["prompt_indices"]
        if self.async_fields is not None:
            out.update(dataclasses.asdict(self.async_fields))
        if self.validation is not None:
            out.update(self.validation)
        out.update(self.extra)
        return out

    def to_json(self) -> dict[str, Any]:
        """The `metrics.jsonl` line: `schema_version` then the fields."""
        return {"schema_version": SCHEMA_VERSION, **self.as_dict()}

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> StepRecord:
        """A record from a `metrics.jsonl` mapping of any schema version (one without `schema_version` included).

        Missing fields take their defaults; keys this version does not know go to `extra`."""
        d = dict(data)
        d.pop("schema_version", None)
        kwargs: dict[str, Any] = {k: d.pop(k) for k in _PLAIN if k in d}
        kwargs.setdefault("step", 0)
        if "exposed_gen_seconds" in d:
            kwargs["async_fields"] = AsyncStepFields(**{k: d.pop(k) for k in _ASYNC_KEYS if k in d})
        val = {k: d.pop(k) for k in VALIDATION_KEYS if k in d}
        if val:
            kwargs["validation"] = val
        return cls(**kwargs, extra=d)

    # read access by metrics.jsonl name
    def __getitem__(self, key: str) -> Any:
        return self.as_dict()[key]

    def __contains__(self, key: object) -> bool:
        return key in self.as_dict()

    def get(self, key: str, default: Any = None) -> Any:
        return self.as_dict().get(key, default)

    def keys(self):
        return self.as_dict().keys()


_SECTIONS = ("async_fields", "validation", "extra")
_PLAIN = tuple(f.name for f in dataclasses.fields(StepRecord) if f.name not in _SECTIONS)


def to_record(record: StepRecord | dict[str, Any], require: bool = False) -> StepRecord:
    """`record` as a StepRecord; a mapping is read with `from_json` (with `require`, it must carry STEP_FIELDS:
    KeyError otherwise)."""
    if isinstance(record, StepRecord):
        return record
    if require:
        missing = [k for k in STEP_FIELDS if k not in record]
        if missing:
            raise KeyError(f"step record lacks required metrics.jsonl fields: {missing}")
    return StepRecord.from_json(record)


def parse_records(lines: list[str], strict: bool = False, where: str = "metrics.jsonl",
                  require: tuple[str, ...] = ()) -> list[StepRecord]:
    """Records from JSON lines; blank lines are skipped, and so is a torn line unless `strict` (then a SpecRLError
    naming the line). A line without every key of `require` is refused, naming the keys."""
    out = []
    for i, line in enumerate(lines, 1):
        if not line.strip():
            continue
        try:
            data = json.loads(line)
        except json.JSONDecodeError as exc:
            if strict:
                raise SpecRLError(f"{where}:{i}: not a JSON line ({exc}); a metrics.jsonl has one step record "
                                  "per line") from exc
            continue
        missing = [k for k in require if k not in data]
        if missing:
            raise SpecRLError(f"{where}:{i}: step record lacks {missing}; expected the metrics.jsonl of a specrl "
                              "training run")
        out.append(StepRecord.from_json(data))
    return out


def read_records(path: str | Path, strict: bool = False, require: tuple[str, ...] = ()) -> list[StepRecord]:
    """Every step record of a `metrics.jsonl` (any schema version). Lenient by default, for a live or killed run:
    [] when the file does not exist and a torn last line ignored. `strict` (a finished run given by a user):
    the file must exist, be UTF-8 JSON lines and hold at least one record; errors name the file and line."""
    p = Path(path)
    if not p.exists():
        if strict:
            raise SpecRLError(f"{p} does not exist; pass runs/NAME/metrics.jsonl of a specrl training run")
        return []
    try:
        text = p.read_text(encoding="utf-8")
    except UnicodeDecodeError as e:
        raise SpecRLError(f"{p} is not UTF-8 text (byte {e.object[e.start]:#04x} at offset {e.start}); pass the "
                          "files a specrl training run wrote") from None
    records = parse_records(text.splitlines(), strict=strict, where=str(p), require=require)
    if strict and not records:
        raise SpecRLError(f"{p} has no step records")
    return records

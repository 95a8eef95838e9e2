"""The typed step record: metrics.jsonl lines with a schema version, and files written without one still load."""

import json

from specrl.observability.metrics import MetricsWriter
from specrl.observability.run_report import async_summary, summarize
from specrl.observability.step_record import SCHEMA_VERSION, STEP_FIELDS, AsyncStepFields, StepRecord, read_records
from specrl.sim.calibration.fromrun import run_records as sim_read_metrics

# a sync-pipeline line as the learner + run loop write it (validation step: accuracy and val_* merged), without
# schema_version
SYNC_LINE = {
    "step": 2, "reward_mean": 0.375, "reward_std": 0.48, "accuracy": 0.5, "response_length_mean": 21.5,
    "response_lengths": [20, 23], "batch_trace": [[0.01, 2, 3], [0.02, 1, 0]],
    "stage_seconds": {"data": 0.001, "prepare": 0.01, "gen": 1.2, "logprob": 0.0, "train": 0.4},
    "step_seconds": 1.611, "gen_share": 0.745, "logprob_skipped": True, "acceptance_length": 2.1,
    "acceptance_rate": 0.55, "acceptance_rate_per_position": [0.7, 0.4], "num_draft_tokens_mean": 2.0,
    "draft_tokens": 40, "accepted_tokens": 22, "verify_steps": 20, "sequence_steps": 24,
    "token_mult_prob_error": 1.0001, "draft_loss": None, "draft_updates": 0, "draft_refreshed": False,
    "drafter_collapsed": False, "acceptance_length_reference": 2.0, "generated_tokens": 43,
    "gen_tokens_per_second": 35.8, "train_accuracy": 0.375, "format_rate": None,
    "reward_components": {"correct": 0.375}, "truncated_fraction": 0.0, "policy_version": 1, "policy_lag": 0,
    "device": "cpu", "processor_class": "x86_64", "rollout_dtype": "fp32", "precision": "fp32",
    "groups": 2, "groups_nonzero_advantage": 1,
    "groups_trained": 2, "groups_filtered": None, "extra_prompts_drawn": None, "reward_mean_generated": None,
    "loss": -0.01, "grad_norm": 0.3, "lr": 1e-05, "clip_fraction": 0.0, "kl": None, "ratio_mean": 1.0,
    "optimizer_steps": 1, "is_ratio_mean": None, "is_ratio_max": None, "is_clipped_fraction": None,
    "torch_threads": 2, "val_reward": 0.5, "val_format_rate": None, "val_seconds": 0.8,
}

ASYNC_EXTRA = {
    "exposed_gen_seconds": 0.9, "gen_seconds_workers": 1.4, "learner_idle_ratio": 0.2, "trajectory_age_mean": 0.5,
    "trajectory_age_max": 1, "group_policy_versions": [0, 1], "dropped_stale_groups": 0,
    "max_trajectory_age_steps": 1, "refit_seconds": 0.05, "publish_seconds": 0.02, "trained_samples": 4,
    "trained_request_id_range": [4, 7], "trained_prompt_indices": [3, 5], "mixed_version_samples": 0,
}


def _async_line() -> dict:
    line = {k: v for k, v in SYNC_LINE.items() if k not in ("torch_threads", "val_reward", "val_format_rate",
                                                           "val_seconds")}
    return {**line, "step": 3, **ASYNC_EXTRA}


def test_file_without_schema_version_loads(tmp_path):
    p = tmp_path / "metrics.jsonl"
    p.write_text(json.dumps(SYNC_LINE) + "\n" + json.dumps(_async_line()) + "\n" + '{"step": 4, "rew')  # torn
    sync, asy = read_records(p)
    assert isinstance(sync, StepRecord) and sync.step == 2 and sync.torch_threads == 2
    assert sync.stage_seconds["gen"] == 1.2 and sync.accuracy == 0.5 and sync.logprob_skipped is True
    assert sync.validation == {"val_reward": 0.5, "val_format_rate": None, "val_seconds": 0.8}
    assert sync.async_fields is None and sync.extra == {}
    assert isinstance(asy.async_fields, AsyncStepFields) and asy.async_fields.trajectory_age_max == 1
    assert asy.torch_threads is None
    # written back: the same keys and values, plus the schema version
    assert sync.to_json() == {"schema_version": SCHEMA_VERSION, **SYNC_LINE}
    assert asy.to_json() == {"schema_version": SCHEMA_VERSION, **_async_line()}
    # the readers of the report and the simulator take it too
    assert summarize([sync, asy])["steps"] == 2
    assert async_summary([asy])["trajectory_age_max"] == 1 and async_summary([sync]) is None
    whole = tmp_path / "run" / "metrics.jsonl"  # the simulator's reader rejects a torn line, so a whole file
    whole.parent.mkdir()
    whole.write_text(json.dumps(SYNC_LINE) + "\n" + json.dumps(_async_line()) + "\n")
    assert [r.torch_threads for r in sim_read_metrics(whole)] == [2, None]


def test_minimal_and_unknown_keys_round_trip(tmp_path):
    old = {k: None for k in STEP_FIELDS} | {"step": 1, "stage_seconds": {"gen": 1.0}, "future_field": 7}
    rec = StepRecord.from_json(old)
    assert rec.extra == {"future_field": 7} and rec["future_field"] == 7 and rec.get("reward_mean") is None
    assert rec.response_lengths == [] and rec.logprob_skipped is False  # fields the line did not carry
    assert json.loads(json.dumps(rec.to_json()))["future_field"] == 7


def test_writer_adds_schema_version(tmp_path):
    w = MetricsWriter(tmp_path, tensorboard=False)
    w.write(StepRecord.from_json(SYNC_LINE))
    w.write(_async_line())  # a mapping with the required fields is accepted too
    w.close()
    first, second = (json.loads(x) for x in (tmp_path / "metrics.jsonl").read_text().splitlines())
    assert [x["schema_version"] for x in (first, second)] == [SCHEMA_VERSION] * 2
    assert {k: v for k, v in first.items() if k != "schema_version"} == SYNC_LINE
    assert [r.step for r in read_records(tmp_path / "metrics.jsonl")] == [2, 3]

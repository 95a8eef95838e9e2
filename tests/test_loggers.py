"""Optional loggers: W&B offline and MLflow's local file store get metrics.jsonl's numbers under the same names."""

import json

from specrl.observability.metrics import STEP_FIELDS, MetricsWriter
from specrl.trainer.config_check import validate_config


def record(step: int) -> dict:
    rec = {k: None for k in STEP_FIELDS}
    rec.update(step=step, reward_mean=0.25 * step, stage_seconds={"gen": 1.5, "train": 2.0}, step_seconds=3.5,
               acceptance_rate_per_position=[0.5, 0.25])
    return rec


def test_wandb_offline_and_mlflow_file_store(tmp_path, monkeypatch):
    monkeypatch.delenv("WANDB_MODE", raising=False)
    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    w = MetricsWriter(tmp_path, tensorboard=False, loggers=["wandb", "mlflow"], name="t",
                      config={"grpo": {"num_generations": 8}})
    for s in (1, 2):
        w.write(record(s))
    w.close()
    runs = list((tmp_path / "wandb").glob("offline-run-*"))  # offline: nothing left the machine
    assert len(runs) == 1 and any(runs[0].glob("*.wandb"))
    import mlflow

    client = mlflow.tracking.MlflowClient((tmp_path / "mlruns").resolve().as_uri())
    run = client.search_runs([client.get_experiment_by_name("Default").experiment_id])[0]
    assert run.data.params["grpo.num_generations"] == "8"
    hist = client.get_metric_history(run.info.run_id, "reward_mean")
    assert [(m.step, m.value) for m in hist] == [(1, 0.25), (2, 0.5)]
    assert run.data.metrics["stage_seconds/gen"] == 1.5 and run.data.metrics["acceptance_rate_per_position/1"] == 0.25
    assert [json.loads(x)["step"] for x in (tmp_path / "metrics.jsonl").read_text().splitlines()] == [1, 2]


def test_logger_config_key():
    assert validate_config({"run": {"loggers": ["wandb", "mlflow"]}}).run.loggers == ["wandb", "mlflow"]
    import pytest

    from specrl.errors import SpecRLError

    with pytest.raises(SpecRLError, match="run.loggers"):
        validate_config({"run": {"loggers": ["neptune"]}})

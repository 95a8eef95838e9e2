"""CLI: the JSON contract, the table, sweep, advise, fit, profile-hardware and --from-run."""

import csv
import json

import pytest
from typer.testing import CliRunner

from specrl.sim.commands import app

runner = CliRunner()
CONTRACT_STAGES = {"data", "prepare", "gen", "logprob", "train"}


def _json(args):
    res = runner.invoke(app, args + ["--json"])
    assert res.exit_code == 0, res.output
    return json.loads(res.output)


def test_json_contract_fields():
    r = _json(["--preset", "paper-8b-rl-zero"])
    assert set(r["ar"]["stages"]) == CONTRACT_STAGES and set(r["spec"]["stages"]) == CONTRACT_STAGES
    for key in ("step_seconds",):
        assert r["ar"][key] > 0 and r["spec"][key] > 0
    assert r["spec"]["acceptance_length"] == pytest.approx(3.32, abs=0.02)
    assert r["spec"]["num_draft_tokens"] == 3
    for key in ("rollout_speedup", "step_speedup", "bound", "gen_share"):
        assert isinstance(r[key], float)
    assert set(r["exposed_gen_seconds"]) == {"ar", "spec"}
    assert r["step_speedup"] == pytest.approx(r["ar"]["step_seconds"] / r["spec"]["step_seconds"])


def test_flags_override_preset_and_k_keeps_per_position_rate():
    r = _json(["--preset", "paper-8b-rl-think", "--k", "1", "--prompts-per-step", "64", "--gpus", "8"])
    assert r["config"]["k"] == 1 and r["config"]["gpus"] == 8
    assert r["config"]["workload"]["prompts_per_step"] == 64
    assert 1.0 < r["spec"]["acceptance_length"] < 2.0  # re-expressed from AL 2.77 at k=3
    rates = _json(["--preset", "paper-8b-rl-think", "--acceptance-rates", "0.9,0.8", "--prompts-per-step", "64"])
    assert rates["config"]["k"] == 2
    assert rates["spec"]["acceptance_length"] == pytest.approx(1 + 0.9 + 0.72, rel=0.01)


def test_async_json_reports_effective_step_and_exposed_gen():
    r = _json(["--preset", "paper-235b", "--gpus", "256", "--prompts-per-step", "64"])
    assert r["mode"] == "async"
    ar = r["ar"]
    consumer = ar["stages"]["data"] + ar["stages"]["logprob"] + ar["stages"]["train"]
    assert ar["step_seconds"] == pytest.approx(consumer + r["exposed_gen_seconds"]["ar"])
    assert r["combined_speedup_vs_sync_ar"] > 0


def test_table_output_and_auto_k():
    res = runner.invoke(app, ["--preset", "paper-8b-rl-think", "--k", "auto", "--prompts-per-step", "64"])
    assert res.exit_code == 0, res.output
    assert "rollout speedup" in res.output and "gen" in res.output and "bound" in res.output


def test_sweep_writes_csv_and_png(tmp_path):
    res = runner.invoke(app, ["sweep", "--preset", "paper-8b-rl-think", "--prompts-per-step", "32",
                              "--ks", "1,3", "--als", "1.5,3", "--gpu-counts", "16,32", "--lags", "0,1",
                              "--out", str(tmp_path)])
    assert res.exit_code == 0, res.output
    for name in ("k_vs_acceptance.csv", "gpus_vs_lag.csv", "k_vs_acceptance.png", "gpus_vs_lag.png"):
        assert (tmp_path / name).stat().st_size > 0
    rows = list(csv.DictReader((tmp_path / "k_vs_acceptance.csv").open()))
    assert len(rows) == 4 and rows[1]["rollout_speedup"] == "nan"  # AL 3 > k+1 for k=1


def test_advise_prints_best_and_runner_up():
    res = runner.invoke(app, ["advise", "--preset", "paper-8b-rl-think", "--prompts-per-step", "32",
                              "--gpus", "8", "--candidates", "eagle3:2.77,ngram:1.5", "--sync-only", "--json"])
    assert res.exit_code == 0, res.output
    a = json.loads(res.output)
    assert a["best"]["step_seconds"] <= a["runner_up"]["step_seconds"]
    assert a["best"]["drafter"] in ("eagle3", "ngram")


def test_profile_hardware_quick(tmp_path):
    out = tmp_path / "cpu.json"
    res = runner.invoke(app, ["profile-hardware", "--quick", "--out", str(out)])
    assert res.exit_code == 0, res.output
    prof = json.loads(out.read_text())
    assert prof["peak_flops"]["bf16"] > 0 and prof["hbm_bandwidth"] > 0 and prof["hbm_bandwidth_1thread"] > 0


def test_fit_runs_and_reports_every_stage():
    res = runner.invoke(app, ["fit", "--max-evals", "1", "--json"])
    assert res.exit_code == 0, res.output
    fit = json.loads(res.output)
    stages = {(r["workload"], r["arm"], r["stage"]) for r in fit["rows"]}
    assert ("RL-Think", "spec", "gen") in stages and ("RL-Zero", "ar", "train") in stages
    assert 0 < fit["efficiency"]["mfu_train"] <= 1


def test_fit_bad_holdout_and_data(tmp_path):
    res = runner.invoke(app, ["fit", "--holdout", "RL-Zero:spec:decode"])
    assert res.exit_code == 2 and "WORKLOAD:ARM:STAGE" in res.output
    bad = tmp_path / "x.json"
    bad.write_text("{}")
    res = runner.invoke(app, ["fit", "--data", str(bad)])
    assert res.exit_code == 2 and "paper_8b.json-shaped" in res.output


def _fake_run(tmp_path, drafter="none"):
    run = tmp_path / "runs" / "r1"
    run.mkdir(parents=True)
    (run / "config.yaml").write_text(
        "model:\n  name: smollm2-135m\n  dtype: float32\n  rollout_dtype: bfloat16\n"
        "grpo:\n  num_prompts_per_step: 4\n  num_generations: 4\n"
        f"generation:\n  max_new_tokens: 64\n  max_batch_size: 16\nspeculative:\n  drafter: {drafter}\n"
        "  num_draft_tokens: 3\n")
    lines = []
    for step in range(3):
        lines.append(json.dumps({
            "step": step, "stage_seconds": {"data": 0.01, "prepare": 0.2, "gen": 4.0, "logprob": 1.0, "train": 3.0},
            "step_seconds": 8.21, "gen_share": 0.49, "acceptance_length": 2.0 if drafter != "none" else 1.0,
            "num_draft_tokens_mean": 3.0 if drafter != "none" else 0.0, "generated_tokens": 640,
            "response_length_mean": 40.0, "gen_tokens_per_second": 160.0}))
    (run / "metrics.jsonl").write_text("\n".join(lines) + "\n")
    prof = {"name": "cpu", "peak_flops": {"bf16": 2e12, "fp32": 1e12, "fp8": 2e12}, "hbm_bandwidth": 2e10,
            "hbm_bytes": 16e9, "nvlink_bandwidth": 2e10, "network_bandwidth": 1e9, "nvlink_domain": 1}
    (tmp_path / "cpu.json").write_text(json.dumps(prof))
    return run / "metrics.jsonl", tmp_path / "cpu.json"


@pytest.mark.parametrize("drafter", ["none", "ngram"])
def test_from_run_predicts_every_stage(tmp_path, drafter):
    metrics, prof = _fake_run(tmp_path, drafter)
    res = runner.invoke(app, ["--from-run", str(metrics), "--cpu-profile", str(prof), "--json"])
    assert res.exit_code == 0, res.output
    out = json.loads(res.output)
    by = {r["stage"]: r for r in out["rows"]}
    assert set(by) == CONTRACT_STAGES | {"exposed gen", "step"}
    assert by["gen"]["measured"] == 4.0 and by["gen"]["predicted"] > 0
    assert out["steps_used"] == 2
    table = runner.invoke(app, ["--from-run", str(metrics), "--cpu-profile", str(prof)])
    assert "predicted" in table.output and "gen" in table.output


def test_from_run_bad_inputs(tmp_path):
    res = runner.invoke(app, ["--from-run", str(tmp_path / "nope.jsonl")])
    assert res.exit_code == 2 and "does not exist" in res.output
    metrics, prof = _fake_run(tmp_path)
    metrics.write_text('{"step": 0}\n')
    res = runner.invoke(app, ["--from-run", str(metrics), "--cpu-profile", str(prof)])
    assert res.exit_code == 2 and "lacks" in res.output


def test_fit_cpu_from_run_reproduces_the_run(tmp_path):
    metrics, prof = _fake_run(tmp_path)
    res = runner.invoke(app, ["fit", "--from-run", str(metrics), "--cpu-profile", str(prof), "--json"])
    assert res.exit_code == 0, res.output
    out = json.loads(res.output)
    by = {r["stage"]: r for r in out["rows"]}
    for stage in ("data", "prepare", "gen", "logprob", "train"):
        assert by[stage]["error"] == pytest.approx(0.0, abs=0.02)
    assert 0 < out["efficiency"]["mfu_train"] <= 1 and out["efficiency"]["step_overhead_s"] > 0

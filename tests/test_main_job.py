"""`specrl run`, the main job, on a tiny random model: a side-by-side compare of the config's autoregressive and
speculative arms whose report.md and terminal output lead with the speed-ups and the identity evidence; arms that
part are reported (exit 0), while `specrl train --compare` exits non-zero after writing the same report."""

import json
import re
from pathlib import Path

import pytest
from typer.testing import CliRunner

from specrl import cli
from specrl.cli import app
from specrl.device import processor_class
from specrl.run.compare_report import ARMS
from specrl.trainer.sync_trainer import GRPOTrainer
from tests.faults import parting_step
from tests.test_rl_trainer import cfg_dict, write_cfg
from tests.tiny import make_tiny_checkpoint

runner = CliRunner()

LEADS = ["generation speed-up: ", "RL step speed-up: ", "losslessness certificate: ", "acceptance length AL: ",
         "generation share R: ", "lossless (seed_exact): ", "reward signal: step-0 success rate ",
         "learning: validation accuracy ", "hardware: ",
         "per-arm reports: "]


@pytest.fixture(scope="module")
def tiny(tmp_path_factory) -> Path:
    return make_tiny_checkpoint(tmp_path_factory.mktemp("tiny") / "ckpt", seed=0)


def _config(tiny: Path, tmp_path: Path) -> Path:
    d = cfg_dict(tiny, speculative__drafter="ngram", speculative__num_draft_tokens=2)
    d["run"].update(steps=2, checkpoint_every=0)
    return write_cfg(tmp_path / "tiny.yaml", d)


def _bullets(report: Path) -> list[str]:
    return [line[2:] for line in report.read_text().splitlines() if line.startswith("- ")]


def test_run_is_a_compare_that_leads_with_the_speedup_and_identity(tiny, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    r = runner.invoke(app, ["run", "--config", str(_config(tiny, tmp_path))])
    assert r.exit_code == 0, r.output
    run_dir = tmp_path / "runs" / "t"
    c = json.loads((run_dir / "compare.json").read_text())
    assert c["steps"] == 2 and c["verify"] == "seed_exact" and c["parted_at_step"] is None
    assert c["rollouts_identical_per_step"] == c["weights_identical_per_step"] == [True, True]
    text = (run_dir / "report.md").read_text().splitlines()
    assert text[0].startswith("# ") and "`t`" in text[0] and " 2 GRPO steps" in text[2]
    bullets = _bullets(run_dir / "report.md")
    assert [b[:len(lead)] for b, lead in zip(bullets, LEADS, strict=True)] == LEADS
    assert re.findall(r"\d+/\d+", bullets[5]) == ["2/2", "2/2"] and "parted" not in bullets[5]
    assert re.search(r"\(steps 0 → 2\), speculative arm; autoregressive arm \d\.\d{3} → \d\.\d{3}", bullets[7])
    assert re.search(r"value ± SE: speculative \d\.\d{3} ± \d\.\d{3} → \d\.\d{3} ± \d\.\d{3} \(4 "
                     r"questions\)", bullets[7])
    assert f"processor class {processor_class()}" in bullets[8] and "rollouts float32, training fp32" in bullets[8]
    assert "[speculative/report.md](speculative/report.md)" in bullets[9]
    # the terminal ends with the same lines (paths for links), then the report's path
    tail = r.output.splitlines()
    assert tail[-1] == f"[specrl] report: {Path('runs/t/report.md')}"
    assert tail[-12] == f"[specrl] {text[2]}"
    assert [line.removeprefix("  - ") for line in tail[-11:-2]] == bullets[:9]
    assert tail[-2].startswith("  - per-arm reports: ")
    shown = [str(Path("runs/t") / p) for p in ("speculative/report.md", "speculative/final",
                                               "autoregressive/report.md", "compare.md")]
    assert all(s in tail[-2] for s in shown)
    assert (run_dir / "speculative" / "final" / "model.safetensors").exists()
    assert (run_dir / "autoregressive" / "report.md").exists() and (run_dir / "compare.json").exists()
    assert "| hardware | " in (run_dir / "speculative" / "report.md").read_text()
    # the structured fields behind the reward-signal and learning lines
    sig = c["signal"]
    assert sig["step0_completions"] == 16 and 0.0 <= sig["step0_success_rate"] <= 1.0  # 2 arms x 2 prompts x 4
    assert sig["step0_prompts"] == 2 and "of 2 prompts" in bullets[6]
    assert sig["groups"] == 8 and sig["autoregressive"]["groups"] == 4  # 2 steps x 2 prompts per arm
    assert len(sig["speculative"]["nonzero_advantage_per_step"]) == 2
    assert sig["groups_nonzero_advantage"] == sum(s["nonzero"] for arm in ARMS for s in
                                                  sig[arm]["nonzero_advantage_per_step"])
    lrn = c["learning"]
    for arm in ARMS:
        assert lrn[arm]["first"]["step"] == 0 and lrn[arm]["last"]["step"] == 2 and lrn[arm]["last"]["n"] == 4
        assert lrn[arm]["first"]["se"] is not None
    assert lrn["equivalence"]["margin"] == 0.15 and lrn["equivalence"]["n1"] == 4
    assert len(c["reward_curve_se"]["speculative"]) == 2 and c["sizing"] is None
    assert (run_dir / "compare_learning.png").stat().st_size > 0


def test_run_reports_where_the_arms_parted_and_exits_0(tiny, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(GRPOTrainer, "step", parting_step(1))
    r = runner.invoke(app, ["run", "--config", str(_config(tiny, tmp_path))])
    assert r.exit_code == 0, r.output
    c = json.loads((tmp_path / "runs" / "t" / "compare.json").read_text())
    # one weight moved after step 1, whose rollouts were untouched
    assert c["parted_at_step"] == c["weights_parted_at_step"] == 1
    assert c["rollouts_identical_per_step"][0] is True and c["weights_identical_per_step"] == [False, False]
    bullets = _bullets(tmp_path / "runs" / "t" / "report.md")
    assert [b[:len(lead)] for b, lead in zip(bullets, LEADS, strict=True)] == LEADS
    ro = sum(c["rollouts_identical_per_step"])
    assert re.findall(r"\d+/\d+", bullets[5]) == [f"{ro}/2", "0/2"] and "step 1" in bullets[5]
    # the arms generated different tokens: the generation line adds the tokens-per-generation-second figure
    assert c["gen_throughput_speedup"] is not None and f"{c['gen_throughput_speedup']:.2f}×" in bullets[0]
    assert bullets[5] in r.output and "error" not in r.output


def test_train_compare_exits_nonzero_on_divergence_after_writing_the_report(tiny, tmp_path, monkeypatch):
    monkeypatch.setattr(GRPOTrainer, "step", parting_step(2))
    out = tmp_path / "cmp"
    r = runner.invoke(app, ["train", "--config", str(_config(tiny, tmp_path)), "--compare", "--out", str(out)])
    assert r.exit_code == 2
    c = json.loads((out / "compare.json").read_text())
    assert c["parted_at_step"] == c["weights_parted_at_step"] == 2
    assert c["rollouts_identical_per_step"] == [True, True] and c["weights_identical_per_step"] == [True, False]
    assert "step 2" in r.output and str(out / "report.md") in r.output
    bullets = _bullets(out / "report.md")
    identity = bullets[LEADS.index("lossless (seed_exact): ")]
    assert identity.startswith("lossless (seed_exact): ") and re.findall(r"\d+/\d+", identity) == ["2/2", "1/2"]


def test_run_with_a_missing_config_names_it(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    r = runner.invoke(app, ["run", "--config", "other.yaml"])
    assert r.exit_code == 2
    assert re.search(r"--config other\.yaml\b.*not a file.*examples/default\.yaml", r.output)


def test_run_demo_and_the_fallback_outside_a_checkout(tmp_path, monkeypatch):
    calls = []
    monkeypatch.setattr(cli.training, "_demo", lambda: calls.append("demo"))
    monkeypatch.chdir(tmp_path)  # no examples/default.yaml here: the installed package's `specrl run`
    r = runner.invoke(app, ["run"])
    assert r.exit_code == 0 and calls == ["demo"]
    assert "examples/default.yaml is not here" in r.output
    r = runner.invoke(app, ["run", "--demo", "--config", "whatever.yaml"])
    assert r.exit_code == 0 and calls == ["demo", "demo"]


def test_shared_tokens_counts_the_common_prefix_of_each_pair():
    from specrl.run.loop import shared_tokens

    assert shared_tokens([[1, 2, 3], [4, 5], [6]], [[1, 2, 9, 9], [4, 5], [7, 6]]) == \
        {"shared": 4, "autoregressive": 6, "speculative": 8}


def test_a_time_budget_ends_the_compare_early_as_a_finished_run(tiny, tmp_path, monkeypatch):
    """run.time_budget_minutes: the first pair of steps always runs; a budget it already overran stops the
    compare there, and both arms end like finished runs (validation, checkpoint, final policy) at that step."""
    monkeypatch.chdir(tmp_path)
    d = cfg_dict(tiny, speculative__drafter="ngram", speculative__num_draft_tokens=2)
    d["run"].update(steps=3, checkpoint_every=0, time_budget_minutes=1e-6)
    d["grpo"]["val_every"] = 0
    r = runner.invoke(app, ["run", "--config", str(write_cfg(tmp_path / "b.yaml", d))])
    assert r.exit_code == 0, r.output
    run_dir = tmp_path / "runs" / "t"
    note = "stopped by run.time_budget_minutes=1e-06 after step 1 of 3"
    assert note in (run_dir / "report.md").read_text()
    assert note in r.output
    for arm in ("speculative", "autoregressive"):
        a = run_dir / arm
        assert len((a / "metrics.jsonl").read_text().splitlines()) == 1
        assert [json.loads(x)["step"] for x in (a / "validation.jsonl").read_text().splitlines()] == [0, 1]
        assert (a / "checkpoints" / "step_000001").is_dir() and (a / "final" / "model.safetensors").exists()
        assert note in (a / "report.md").read_text()
    assert json.loads((run_dir / "compare.json").read_text())["stopped_early"].startswith(note)
    # step 0 (the same initial weights in both arms, greedy) was validated once and recorded for both arms
    first = {arm: json.loads((run_dir / arm / "validation.jsonl").read_text().splitlines()[0]) for arm in ARMS}
    assert first["speculative"].pop("shared_from") == "autoregressive"
    assert "shared_from" not in first["autoregressive"] and first["speculative"] == first["autoregressive"]


def test_a_time_budget_ends_a_training_run_early(tiny, tmp_path):
    from specrl.run.loop import train_main

    d = cfg_dict(tiny)
    d["run"].update(steps=3, checkpoint_every=0, time_budget_minutes=1e-6)
    run_dir = train_main(write_cfg(tmp_path / "b.yaml", d), [], None, str(tmp_path / "out"))
    assert len((run_dir / "metrics.jsonl").read_text().splitlines()) == 1
    assert (run_dir / "checkpoints" / "step_000001").is_dir()
    assert re.search(r"run\.time_budget_minutes=1e-06\b.*\bstep 1 of 3\b", (run_dir / "report.md").read_text())


def test_a_time_budget_must_be_positive(tiny):
    from specrl.errors import SpecRLError
    from specrl.trainer.config_check import validate_config

    d = cfg_dict(tiny)
    d["run"]["time_budget_minutes"] = 0
    with pytest.raises(SpecRLError, match="run.time_budget_minutes"):
        validate_config(d)


def test_a_compare_runs_without_a_thread_governor(tiny, tmp_path, monkeypatch):
    """On CUDA there is no CPU thread governor (`governor_for` returns None): the compare loop must not need one."""
    from specrl.run import compare

    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(compare, "governor_for", lambda cfg: None)
    d = cfg_dict(tiny, speculative__drafter="ngram", speculative__num_draft_tokens=2)
    d["run"].update(steps=2, checkpoint_every=0, time_budget_minutes=1e-6)
    r = runner.invoke(app, ["run", "--config", str(write_cfg(tmp_path / "g.yaml", d))])
    assert r.exit_code == 0, r.output
    assert all(json.loads(x).get("torch_threads") is None
               for x in (tmp_path / "runs" / "t" / "speculative" / "metrics.jsonl").read_text().splitlines())


def test_a_compare_over_repeated_prompts_reports_cold_and_warm_steps_and_history_drafts(tiny, tmp_path, monkeypatch):
    """train_size 2 with 1 prompt per step: steps 1-2 see each prompt first (cold), 3-4 see them again (warm); with
    the suffix drafter the speculative arm's records carry the history counters and the index size, and the
    headline gives the two kinds of step apart."""
    monkeypatch.chdir(tmp_path)
    d = cfg_dict(tiny, speculative__drafter="suffix", speculative__num_draft_tokens=2)
    d["task"]["train_size"] = 2
    d["grpo"].update(num_prompts_per_step=1, val_every=0)
    d["run"].update(steps=4, checkpoint_every=0)
    r = runner.invoke(app, ["run", "--config", str(write_cfg(tmp_path / "e.yaml", d))])
    assert r.exit_code == 0, r.output
    run_dir = tmp_path / "runs" / "t"
    recs = [json.loads(x) for x in (run_dir / "speculative" / "metrics.jsonl").read_text().splitlines()]
    assert [len(x["prompt_indices"]) for x in recs] == [1, 1, 1, 1]
    assert sorted(x["prompt_indices"][0] for x in recs[:2]) == [0, 1]
    assert all(x["history_index_tokens"] > 0 for x in recs)
    assert recs[-1]["history_index_tokens"] > recs[0]["history_index_tokens"]  # the index holds earlier epochs
    split = json.loads((run_dir / "compare.json").read_text())["cold_warm"]
    assert split["cold"]["steps"] == [1, 2] and split["warm"]["steps"] == [3, 4]
    bullets = _bullets(run_dir / "report.md")
    cold_warm = [b for b in bullets if b.startswith("cold steps ")]  # the line shows the split's steps
    assert len(cold_warm) == 1 and "1, 2" in cold_warm[0] and "3, 4" in cold_warm[0]
    # the autoregressive arm keeps no history: none of its records carries the counters
    ar = [json.loads(x) for x in (run_dir / "autoregressive" / "metrics.jsonl").read_text().splitlines()]
    assert not any("history_index_tokens" in x for x in ar)


def test_a_compare_without_repeated_prompts_has_no_cold_warm_line(tiny):
    from specrl.observability.step_record import StepRecord
    from specrl.run.cold_warm import cold_warm_split, step_kinds

    recs = [StepRecord(step=i + 1, prompt_indices=[i]) for i in range(3)]
    assert step_kinds(recs) == ["cold", "cold", "cold"] and cold_warm_split(recs, recs) is None
    assert step_kinds([StepRecord(step=1)]) is None  # records written without prompt indices
    again = [*recs, StepRecord(step=4, prompt_indices=[0, 5])]  # a new prompt beside a repeated one: cold
    assert step_kinds(again)[-1] == "cold"


def test_a_killed_compare_resumes_from_its_checkpoints(tiny, tmp_path, monkeypatch):
    """The overlay run's resume: a compare killed after step 2 (both arms checkpointed every step) and with the
    speculative arm one checkpoint behind (killed between the arms' checkpoints) continues with `specrl train
    --compare --resume DIR`: the lagging arm catches up, then the pairs go on to run.steps; no step is missing or
    repeated in either arm's metrics, and step 0's validation is not run again."""
    import shutil

    monkeypatch.chdir(tmp_path)
    d = cfg_dict(tiny, speculative__drafter="ngram", speculative__num_draft_tokens=2)
    d["run"].update(steps=4, checkpoint_every=1, keep_checkpoints=5)
    d["grpo"]["val_every"] = 2
    cfg_path = write_cfg(tmp_path / "o.yaml", d)
    out = tmp_path / "ov"
    first = runner.invoke(app, ["train", "--config", str(cfg_path), "--compare", "--out", str(out),
                                "--set", "run.steps=2"])
    assert first.exit_code == 0, first.output
    # what a kill leaves: no final policy, and the speculative arm's last checkpoint (and record) not written
    for arm in ARMS:
        shutil.rmtree(out / arm / "final")
    shutil.rmtree(out / "speculative" / "checkpoints" / "step_000002")
    again = runner.invoke(app, ["train", "--compare", "--resume", str(out), "--set", "run.steps=4"])
    assert again.exit_code == 0, again.output
    for arm in ARMS:
        steps = [json.loads(x)["step"] for x in (out / arm / "metrics.jsonl").read_text().splitlines()]
        assert steps == [1, 2, 3, 4], (arm, steps)
        val = [json.loads(x)["step"] for x in (out / arm / "validation.jsonl").read_text().splitlines()]
        assert val == [0, 2, 4], (arm, val)
        assert (out / arm / "final" / "model.safetensors").exists()
    c = json.loads((out / "compare.json").read_text())
    assert c["steps"] == 4 and c["learning"]["speculative"]["last"]["step"] == 4
    assert len(c["shared_tokens_per_step"]) == 2  # pairs run after the resume (steps 3, 4)


def test_a_compare_resume_needs_a_run_directory(tmp_path):
    r = runner.invoke(app, ["train", "--compare", "--resume", str(tmp_path / "nothing")])
    assert r.exit_code == 2 and "no config.yaml there" in r.output


def test_specrl_run_continues_a_killed_compare_of_a_config_that_keeps_its_runs(tiny, tmp_path, monkeypatch):
    """`specrl run --config C` where C has run.overwrite false (the overlay run) and its run directory holds a killed
    compare: it continues that compare instead of refusing; with run.overwrite true (make run) it starts over."""
    import shutil

    from specrl.run.run_dir import unfinished_compare

    monkeypatch.chdir(tmp_path)
    d = cfg_dict(tiny, speculative__drafter="ngram", speculative__num_draft_tokens=2)
    d["run"].update(steps=2, checkpoint_every=1, keep_checkpoints=3, overwrite=False)
    cfg_path = write_cfg(tmp_path / "k.yaml", d)
    assert runner.invoke(app, ["run", "--config", str(cfg_path)]).exit_code == 0
    run_dir = tmp_path / "runs" / "t"
    assert unfinished_compare(cfg_path) is None  # finished
    for arm in ARMS:
        shutil.rmtree(run_dir / arm / "final")
    shutil.rmtree(run_dir / "speculative" / "checkpoints" / "step_000002")
    assert unfinished_compare(cfg_path) == str(Path("runs") / "t")
    r = runner.invoke(app, ["run", "--config", str(cfg_path)])
    assert r.exit_code == 0, r.output
    assert re.search(r"\bt holds\b.*unfinished compare.*continuing", r.output)
    steps = [json.loads(x)["step"] for x in (run_dir / "speculative" / "metrics.jsonl").read_text().splitlines()]
    assert steps == [1, 2] and (run_dir / "speculative" / "final").is_dir()
    d["run"]["overwrite"] = True
    assert unfinished_compare(write_cfg(tmp_path / "k2.yaml", d)) is None


def test_specrl_run_takes_set_overrides_and_continues_the_overridden_compare(tiny, tmp_path, monkeypatch):
    """`specrl run --config C --set run.seed=3 --set run.name=N` (a seed of the overlay run) runs into runs/N with
    seed 3; killed, the same command continues runs/N. --set with the generation demo is refused."""
    import shutil

    import yaml

    from specrl.run.run_dir import unfinished_compare

    monkeypatch.chdir(tmp_path)
    d = cfg_dict(tiny, speculative__drafter="ngram", speculative__num_draft_tokens=2)
    d["run"].update(steps=2, checkpoint_every=1, keep_checkpoints=3, overwrite=False)
    cfg_path = write_cfg(tmp_path / "k.yaml", d)
    sets = ["--set", "run.seed=3", "--set", "run.name=t_s3"]
    r = runner.invoke(app, ["run", "--config", str(cfg_path), *sets])
    assert r.exit_code == 0, r.output
    run_dir = tmp_path / "runs" / "t_s3"
    for arm in ARMS:
        assert yaml.safe_load((run_dir / arm / "config.yaml").read_text())["run"]["seed"] == 3
    assert not (tmp_path / "runs" / "t").exists()
    for arm in ARMS:
        shutil.rmtree(run_dir / arm / "final")
    shutil.rmtree(run_dir / "speculative" / "checkpoints" / "step_000002")
    assert unfinished_compare(cfg_path) is None  # without the overrides the config names another run
    assert unfinished_compare(cfg_path, ["run.seed=3", "run.name=t_s3"]) == str(Path("runs") / "t_s3")
    r = runner.invoke(app, ["run", "--config", str(cfg_path), *sets])
    assert r.exit_code == 0, r.output
    steps = [json.loads(x)["step"] for x in (run_dir / "speculative" / "metrics.jsonl").read_text().splitlines()]
    assert steps == [1, 2] and (run_dir / "speculative" / "final").is_dir()
    r = runner.invoke(app, ["run", "--demo", "--set", "run.seed=1"])
    assert r.exit_code == 2 and "--set run.seed=1" in r.output

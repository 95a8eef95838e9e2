"""`run.min_steps`: the per-step work sized to this machine from measured units and a start-up probe (no timing in the
tests: the probe is an input)."""

import json
import re

import pytest

from specrl.errors import SpecRLError
from specrl.run import sizing
from specrl.run.sizing import COSTS, LADDER, REFERENCE, apply_sizing, predict_seconds, size_run
from specrl.trainer.config_check import validate_config

AMX = COSTS["AMX"]


def _step_for(rung_fits: int, steps: int = 6, minutes: float = 10, base: float = 1.0) -> float:
    """A probe step (seconds) at which rung `rung_fits` is the first that fits: just under its plan."""
    ft, fv = LADDER[rung_fits]
    return minutes * 60 * sizing.MARGIN / predict_seconds(AMX, 1.0, base * ft, base * fv, steps) * 0.99


def test_a_slower_machine_gets_less_work_and_the_rung_is_the_largest_that_fits():
    fast, slow = _step_for(0), _step_for(4)
    d_fast = size_run("AMX", 10, 6, 256, 16, fast)
    d_slow = size_run("AMX", 10, 6, 256, 16, slow)
    assert not d_fast["sized"] and d_fast["rung"] == 0 and d_fast["max_new_tokens"] == 256 and d_fast["fits"]
    assert d_slow["sized"] and d_slow["rung"] == 4 and d_slow["fits"] and d_slow["step_seconds"] == slow
    ft, fv = LADDER[4]
    assert (d_slow["max_new_tokens"], d_slow["val_size"]) == (round(256 * ft), round(16 * fv))
    for f, v in LADDER[:4]:
        assert predict_seconds(AMX, slow, f, v, 6) > 600 * sizing.MARGIN
    assert d_slow["predicted_seconds"] == pytest.approx(predict_seconds(AMX, slow, ft, fv, 6))
    assert d_slow["predicted_seconds"] <= 600 * sizing.MARGIN
    rungs = [size_run("AMX", 10, 6, 256, 16, _step_for(0) * m)["rung"] for m in (1, 1.5, 2, 3, 4)]
    assert rungs == sorted(rungs) and rungs[0] == 0 and rungs[-1] > 0


def test_units_follow_the_configured_work_relative_to_the_reference():
    s = _step_for(0)
    a = size_run("AMX", 10, 6, REFERENCE["max_new_tokens"], REFERENCE["val_size"], s)
    b = size_run("AMX", 10, 6, 2 * REFERENCE["max_new_tokens"], 2 * REFERENCE["val_size"], s)
    assert a["rung"] == 0 and b["rung"] > 0  # twice the work does not fit where the reference just did


def test_prediction_scales_generation_but_not_training_with_the_cap():
    c = sizing.ClassCost(100.0, 0.5, 40.0, "x")  # validation of both arms: 40; three single-arm ones: 60
    assert predict_seconds(c, 1.0, 1.0, 1.0, 1) == pytest.approx(60 + 100)
    assert predict_seconds(c, 1.0, 0.5, 1.0, 1) == pytest.approx(30 + 75)
    assert predict_seconds(c, 1.0, 1.0, 0.5, 2) == pytest.approx(30 + 200)
    assert predict_seconds(c, 0.1, 1.0, 1.0, 1) == pytest.approx(0.1 * (60 + 100))


def test_a_class_without_units_plans_with_the_most_demanding_units_and_cuda_is_not_sized():
    d = size_run("aarch64", 10, 6, 256, 16, 0.05)
    heaviest = max(COSTS, key=lambda c: predict_seconds(COSTS[c], 1.0, 1.0, 1.0, 6))
    assert d["cost_class"] == sizing.FALLBACK == heaviest and d["cost"] == sizing.asdict(COSTS[heaviest])
    assert re.search(r"no units\b.*\baarch64\b", d["reason"])
    for cls in ("AMX", "AVX512-BF16", "AVX512", "AVX2"):
        e = size_run(cls, 10, 6, 256, 16, 0.05)
        assert e["cost_class"] == cls and "no units" not in e["reason"]
        # the fallback never plans more work than the class's own units would
        assert size_run("aarch64", 10, 6, 256, 16, 0.1)["rung"] >= size_run(cls, 10, 6, 256, 16, 0.1)["rung"]
    g = size_run("AMX", 10, 6, 256, 16, None, device="cuda")
    assert g["sized"] is False and g["max_new_tokens"] == 256 and g["val_size"] == 16


def test_a_budget_too_small_for_any_rung_says_so():
    d = size_run("AMX", 1, 6, 256, 16, _step_for(0))
    assert d["fits"] is False and d["rung"] == len(LADDER) - 1 and "fewer steps will run" in d["reason"]


def test_bad_inputs_are_clear_errors():
    with pytest.raises(SpecRLError, match="min_steps >= 1"):
        size_run("AMX", 10, 0, 256, 16, 0.1)
    with pytest.raises(SpecRLError, match="positive budget"):
        size_run("AMX", 0, 6, 256, 16, 0.1)
    for bad in (None, 0.0, -1.0):
        with pytest.raises(SpecRLError, match=r"plain decode step.*> 0.*" + repr(bad).replace(".", r"\.")):
            size_run("AMX", 10, 6, 256, 16, bad)


def _cfg(**run):
    return validate_config({"run": {"time_budget_minutes": 10, **run}, "generation": {"max_new_tokens": 256},
                            "task": {"val_size": 16}})


def test_apply_sizing_probes_once_changes_only_the_sized_fields_and_needs_a_budget():
    cfg = _cfg(min_steps=6)
    calls = []
    sized, d = apply_sizing(cfg, "AMX", probe=lambda c: calls.append(c) or _step_for(3))
    assert calls == [cfg] and d["rung"] == 3 and d["sized"]
    assert (sized.generation.max_new_tokens, sized.task.val_size) == (d["max_new_tokens"], d["val_size"])
    assert sized.grpo == cfg.grpo and sized.run == cfg.run and sized.speculative == cfg.speculative
    assert apply_sizing(_cfg(), "AMX", probe=lambda c: calls.append(c) or 1.0) == (_cfg(), None)
    assert len(calls) == 1  # no min_steps: no probe
    with pytest.raises(SpecRLError, match=r"min_steps.*time_budget_minutes.*not set"):
        apply_sizing(validate_config({"run": {"min_steps": 6}}), "AMX", probe=lambda c: 1.0)


def test_sizing_json_round_trip_and_report_line(tmp_path):
    d = size_run("AMX", 10, 6, 256, 16, _step_for(4))
    sizing.write_sizing(tmp_path, d)
    assert sizing.read_sizing(tmp_path) == json.loads(json.dumps(d))
    text = sizing.line(d)
    c = d["configured"]
    assert d["sized"] and text.startswith("sizing: ") and "both arms" in text and text.endswith(d["reason"])
    assert re.search(rf"\b{d['max_new_tokens']} new tokens \(configured {c['max_new_tokens']}\)", text)
    assert re.search(rf"\b{d['val_size']} validation questions \(configured {c['val_size']}\)", text)
    sizing.write_sizing(tmp_path, None)
    assert sizing.read_sizing(tmp_path) is None


def test_the_main_job_config_asks_for_sizing():
    from specrl.trainer.config_check import load_config

    cfg = load_config("examples/default.yaml")
    assert cfg.run.min_steps >= 6 and cfg.run.time_budget_minutes is not None


def test_the_overlay_config_is_the_main_job_for_sixty_resumable_steps():
    from specrl.trainer.config_check import load_config

    main, ov = load_config("examples/default.yaml"), load_config("examples/overlay.yaml")
    assert ov.run.steps >= 60 and ov.run.time_budget_minutes is None and ov.run.min_steps is None
    assert ov.run.checkpoint_every > 0 and not ov.run.overwrite  # `specrl run` continues it after a kill
    assert 0 < ov.grpo.val_every < ov.run.steps and ov.task.val_size >= 64
    for section in ("model", "grpo", "policy", "generation", "speculative", "drafter"):
        a, b = getattr(main, section).model_dump(), getattr(ov, section).model_dump()
        if section == "grpo":
            a.pop("val_every"), b.pop("val_every")
        assert a == b, section
    t_main, t_ov = main.task.model_dump(), ov.task.model_dump()
    t_main.pop("val_size"), t_ov.pop("val_size")
    assert t_main == t_ov


def test_a_sized_compare_says_what_was_sized_in_its_report(tmp_path, monkeypatch):
    """run.min_steps end to end on a tiny model: sizing.json beside the config, compare.json's `sizing`, the report's
    `sizing:` line, and the arms' config.yaml carrying the sized values (the same in both arms)."""
    import yaml
    from typer.testing import CliRunner

    from specrl.cli import app
    from specrl.run import run_dir as run_dir_mod
    from tests.test_rl_trainer import cfg_dict, write_cfg
    from tests.tiny import make_tiny_checkpoint

    monkeypatch.chdir(tmp_path)
    from specrl.run import speed_probe

    monkeypatch.setattr(run_dir_mod, "hardware_fields", lambda cfg: {"processor_class": "AMX"})
    tiny = make_tiny_checkpoint(tmp_path / "ckpt", seed=0)
    d = cfg_dict(tiny, speculative__drafter="ngram", speculative__num_draft_tokens=2)
    d["generation"]["max_new_tokens"] = 16
    d["task"]["val_size"] = 4
    d["run"].update(steps=1, checkpoint_every=0, time_budget_minutes=3.7, min_steps=6)
    step = _step_for(2, minutes=3.7, base=16 / REFERENCE["max_new_tokens"])  # ~ rung 2 fits (val_size differs)
    monkeypatch.setattr(speed_probe, "decode_step_seconds", lambda cfg: step)
    r = CliRunner().invoke(app, ["run", "--config", str(write_cfg(tmp_path / "s.yaml", d))])
    assert r.exit_code == 0, r.output
    out = tmp_path / "runs" / "t"
    expect = size_run("AMX", 3.7, 6, 16, 4, step)
    assert expect["sized"] and expect["fits"]
    assert json.loads((out / "sizing.json").read_text()) == json.loads(json.dumps(expect))
    assert json.loads((out / "compare.json").read_text())["sizing"]["max_new_tokens"] == expect["max_new_tokens"]
    for arm in ("autoregressive", "speculative"):
        c = yaml.safe_load((out / arm / "config.yaml").read_text())
        assert c["generation"]["max_new_tokens"] == expect["max_new_tokens"] < 16
        assert c["task"]["val_size"] == expect["val_size"]
    assert any(line.startswith("- sizing: per-step work sized to this machine: ")
               for line in (out / "report.md").read_text().splitlines())


def test_the_probe_times_plain_decode_steps_of_the_runs_policy_and_restores_threads(tmp_path):
    import torch

    from specrl.run.speed_probe import decode_step_seconds
    from tests.tiny import make_tiny_checkpoint

    tiny = make_tiny_checkpoint(tmp_path / "ckpt", seed=0)
    cfg = validate_config({"model": {"name": str(tiny), "rollout_dtype": "float32", "max_seq_len": 256},
                           "generation": {"max_batch_size": 4}, "run": {"threads": 1, "device": "cpu"}})
    before = torch.get_num_threads()
    s = decode_step_seconds(cfg, steps=4, warmup=2, readings=2)
    assert isinstance(s, float) and 0 < s < 60
    assert torch.get_num_threads() == before
    for bad in ({"readings": 0}, {"steps": 0}, {"warmup": -1}):
        with pytest.raises(ValueError, match=r"\breadings\b.*\bsteps\b.*\bwarmup\b"):
            decode_step_seconds(cfg, **bad)
    with pytest.raises(SpecRLError, match="run.threads"):
        decode_step_seconds(validate_config({"model": {"name": str(tiny), "rollout_dtype": "float32"},
                                             "run": {"threads": 4096, "device": "cpu"}}))

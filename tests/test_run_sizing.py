"""`run.min_steps`: the per-step work sized to the processor class from measured costs (no timing in the tests)."""

import json

import pytest

from specrl.errors import SpecRLError
from specrl.run import sizing
from specrl.run.sizing import COSTS, LADDER, apply_sizing, predict_seconds, size_run
from specrl.trainer.config_check import validate_config


def test_each_measured_class_fits_six_steps_in_ten_minutes_and_the_slowest_is_cut_most():
    got = {c: size_run(c, 10, 6, 512, 16) for c in COSTS}
    for c, d in got.items():
        assert d["fits"] and d["predicted_seconds"] <= 600 * sizing.MARGIN, c
        assert d["cost_class"] == c
    assert not got["AMX"]["sized"] and got["AMX"]["max_new_tokens"] == 512 and got["AMX"]["val_size"] == 16
    assert got["AVX512-BF16"]["sized"] and got["AVX512-BF16"]["max_new_tokens"] < 512
    assert got["AVX2"]["rung"] > got["AVX512-BF16"]["rung"] > got["AMX"]["rung"] == 0
    assert got["AVX2"]["max_new_tokens"] >= 256  # still long reasoning on the slowest class


def test_the_chosen_rung_is_the_largest_that_fits():
    d = size_run("AVX2", 10, 6, 512, 16)
    cost = COSTS["AVX2"]
    for ft, fv in LADDER[: d["rung"]]:
        assert predict_seconds(cost, ft, fv, 6) > 600 * sizing.MARGIN
    ft, fv = LADDER[d["rung"]]
    assert d["predicted_seconds"] == pytest.approx(predict_seconds(cost, ft, fv, 6))


def test_prediction_scales_generation_but_not_training_with_the_cap():
    c = sizing.ClassCost(100.0, 0.5, 40.0, "x")
    assert predict_seconds(c, 1.0, 1.0, 1) == pytest.approx(2 * 40 + 100)
    assert predict_seconds(c, 0.5, 1.0, 1) == pytest.approx(2 * 20 + 75)
    assert predict_seconds(c, 1.0, 0.5, 2) == pytest.approx(2 * 20 + 200)


def test_unknown_class_uses_the_slowest_and_cuda_is_not_sized():
    d = size_run("aarch64", 10, 6, 512, 16)
    assert d["cost_class"] == sizing.SLOWEST and "no costs measured for aarch64" in d["reason"]
    g = size_run("AMX", 10, 6, 512, 16, device="cuda")
    assert g["sized"] is False and g["max_new_tokens"] == 512 and g["val_size"] == 16


def test_a_budget_too_small_for_any_rung_says_so():
    d = size_run("AVX2", 1, 6, 512, 16)
    assert d["fits"] is False and d["rung"] == len(LADDER) - 1 and "fewer steps will run" in d["reason"]


def test_bad_inputs_are_clear_errors():
    with pytest.raises(SpecRLError, match="min_steps >= 1"):
        size_run("AMX", 10, 0, 512, 16)
    with pytest.raises(SpecRLError, match="positive budget"):
        size_run("AMX", 0, 6, 512, 16)


def _cfg(**run):
    return validate_config({"run": {"time_budget_minutes": 10, **run}, "generation": {"max_new_tokens": 512},
                            "task": {"val_size": 16}})


def test_apply_sizing_changes_only_the_sized_fields_and_needs_a_budget():
    cfg = _cfg(min_steps=6)
    sized, d = apply_sizing(cfg, "AVX2")
    assert (sized.generation.max_new_tokens, sized.task.val_size) == (d["max_new_tokens"], d["val_size"])
    assert sized.grpo == cfg.grpo and sized.run == cfg.run and sized.speculative == cfg.speculative
    assert apply_sizing(_cfg(), "AVX2") == (_cfg(), None)
    with pytest.raises(SpecRLError, match="run.min_steps sizes the per-step work"):
        apply_sizing(validate_config({"run": {"min_steps": 6}}), "AVX2")


def test_sizing_json_round_trip_and_report_line(tmp_path):
    d = size_run("AVX2", 10, 6, 512, 16)
    sizing.write_sizing(tmp_path, d)
    assert sizing.read_sizing(tmp_path) == json.loads(json.dumps(d))
    text = sizing.line(d)
    assert text.startswith("sizing: per-step work sized to the processor: ") and "the same in both arms" in text
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
    monkeypatch.setattr(run_dir_mod, "hardware_fields", lambda cfg: {"processor_class": "AVX2"})
    tiny = make_tiny_checkpoint(tmp_path / "ckpt", seed=0)
    d = cfg_dict(tiny, speculative__drafter="ngram", speculative__num_draft_tokens=2)
    d["generation"]["max_new_tokens"] = 16
    d["task"]["val_size"] = 4
    d["run"].update(steps=1, checkpoint_every=0, time_budget_minutes=3.7, min_steps=6)  # rung 0 does not fit
    r = CliRunner().invoke(app, ["run", "--config", str(write_cfg(tmp_path / "s.yaml", d))])
    assert r.exit_code == 0, r.output
    out = tmp_path / "runs" / "t"
    expect = size_run("AVX2", 3.7, 6, 16, 4)
    assert expect["sized"] and expect["fits"]
    assert json.loads((out / "sizing.json").read_text()) == json.loads(json.dumps(expect))
    assert json.loads((out / "compare.json").read_text())["sizing"]["max_new_tokens"] == expect["max_new_tokens"]
    for arm in ("autoregressive", "speculative"):
        c = yaml.safe_load((out / arm / "config.yaml").read_text())
        assert c["generation"]["max_new_tokens"] == expect["max_new_tokens"] < 16
        assert c["task"]["val_size"] == expect["val_size"]
    assert any(line.startswith("- sizing: per-step work sized to the processor: ")
               for line in (out / "report.md").read_text().splitlines())

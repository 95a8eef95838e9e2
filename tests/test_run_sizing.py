"""`run.min_steps`: the per-step work sized to the processor class from measured costs (no timing in the tests)."""

import json

import pytest

from specrl.config.schema import validate_config
from specrl.errors import SpecRLError
from specrl.run import sizing
from specrl.run.sizing import COSTS, LADDER, apply_sizing, predict_seconds, size_run


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
    from specrl.config.schema import load_config

    cfg = load_config("examples/default.yaml")
    assert cfg.run.min_steps >= 6 and cfg.run.time_budget_minutes is not None


def test_the_overlay_config_is_the_main_job_for_sixty_resumable_steps():
    from specrl.config.schema import load_config

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

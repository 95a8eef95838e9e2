"""tools/overlay_seeds.py: several compares (one per run.seed) read together, and its refusals of bad input."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
import yaml

from specrl.errors import SpecRLError
from specrl.observability.learning import tost_runs
from tests.bench import load_tool


@pytest.fixture(scope="module")
def os_tool():
    return load_tool("overlay_seeds")


def _compare(root: Path, name: str, seed: int, acc: dict[str, dict[int, float]], seeds: dict | None = None,
             cls: str = "AVX512-BF16") -> Path:
    run = root / name
    for arm, points in acc.items():
        d = run / arm
        d.mkdir(parents=True)
        (d / "config.yaml").write_text(yaml.safe_dump({"run": {"seed": (seeds or {}).get(arm, seed)}}))
        (d / "validation.jsonl").write_text("".join(
            json.dumps({"step": s, "accuracy": a, "val_questions": 100}) + "\n" for s, a in points.items()))
        (d / "metrics.jsonl").write_text("".join(
            json.dumps({"step": s, "reward_mean": a, "reward_std": 0.4, "response_lengths": [9] * 8,
                        "processor_class": cls}) + "\n"
            for s, a in points.items() if s > 0))
    return run


def _three(tmp_path: Path) -> list[Path]:
    finals = {0: (0.64, 0.91), 1: (0.85, 0.80), 2: (0.75, 0.70)}
    return [_compare(tmp_path, f"s{s}", s, {"speculative": {0: 0.18, 30: 0.5, 60: sp},
                                              "autoregressive": {0: 0.18, 30: 0.6, 60: ar}})
            for s, (sp, ar) in finals.items()]


def test_table_is_each_runs_final_accuracies_and_welch_tost_over_runs(os_tool, tmp_path, capsys):
    runs = _three(tmp_path)
    png = tmp_path / "seeds.png"
    assert os_tool.main([*map(str, runs), "--plot", str(png)]) == 0
    out = capsys.readouterr().out
    rows = [[c.strip() for c in x.strip().strip("|").split("|")] for x in out.splitlines() if x.startswith("| ")]
    assert rows[0] == ["run", "seed", "speculative", "autoregressive", "difference"]
    assert [r[1:] for r in rows[1:]] == [["0", "0.640 ± 0.048", "0.910 ± 0.029", "-0.270"],
                                         ["1", "0.850 ± 0.036", "0.800 ± 0.040", "+0.050"],
                                         ["2", "0.750 ± 0.043", "0.700 ± 0.046", "+0.050"]]
    t = tost_runs([0.64, 0.85, 0.75], [0.91, 0.80, 0.70])
    assert f"p = {t['p_value']:.3f}" in out and f"p = {t['difference_p_value']:.3f}" in out
    assert png.stat().st_size > 10_000
    assert os_tool.pick_step([os_tool.read_run(r) for r in runs], None) == 60
    # an earlier evaluation, chosen
    os_tool.main([*map(str, runs), "--step", "30"])
    assert "0.500 ± 0.050" in capsys.readouterr().out


def test_refuses_repeated_seeds_unfinished_runs_and_unknown_steps(os_tool, tmp_path):
    runs = _three(tmp_path)
    again = _compare(tmp_path / "b", "again", 1, {"speculative": {0: 0.2, 60: 0.5},
                                                  "autoregressive": {0: 0.2, 60: 0.5}})
    with pytest.raises(SpecRLError, match=r"share a run\.seed"):
        os_tool.main([*map(str, runs), str(again)])
    short = _compare(tmp_path / "c", "short", 7, {"speculative": {0: 0.2, 30: 0.5},
                                                   "autoregressive": {0: 0.2, 30: 0.5}})
    with pytest.raises(SpecRLError, match=r"one of \[0, 30\]"):
        os_tool.main([*map(str, runs), str(short)])
    os_tool.main([*map(str, runs), str(short), "--step", "30"])  # the step all of them reached
    with pytest.raises(SpecRLError, match=r"steps: \[0, 30, 60\]"):
        os_tool.main([*map(str, runs), "--step", "45"])
    with pytest.raises(SpecRLError, match="at least 2 runs"):
        os_tool.main([str(runs[0])])


def test_refuses_a_directory_that_is_not_one_compare(os_tool, tmp_path):
    with pytest.raises(SpecRLError, match=r"no validation\.jsonl"):
        os_tool.main([str(tmp_path / "missing"), str(tmp_path / "missing2")])
    mixed = _compare(tmp_path, "mixed", 3, {"speculative": {0: 0.2, 60: 0.5}, "autoregressive": {0: 0.2, 60: 0.5}},
                     seeds={"autoregressive": 4})
    with pytest.raises(SpecRLError, match=r"seed \(3 and 4\)"):
        os_tool.main([str(mixed), str(mixed)])


def _plan(tmp_path: Path, **change) -> Path:
    plan = {"config": "examples/overlay.yaml", "seeds": [0, 1, 2], "step": 60, "margin": 0.15, "alpha": 0.025,
            "processor_class": "AVX512-BF16", **change}
    p = tmp_path / "plan.yaml"
    p.write_text(yaml.safe_dump(plan))
    return p


def test_plan_reports_its_fixed_test_only_on_exactly_its_runs(os_tool, tmp_path, capsys):
    runs = _three(tmp_path)
    assert os_tool.main(["--plan", str(_plan(tmp_path)), *map(str, runs)]) == 0
    out = capsys.readouterr().out
    t = tost_runs([0.64, 0.85, 0.75], [0.91, 0.80, 0.70], alpha=0.025)
    lo, hi = t["ci"]
    assert "alpha 0.025" in out and "95% CI" in out and f"[{lo:+.3f}, {hi:+.3f}]" in out
    assert f"p = {t['p_value']:.3f}" in out
    # a planned seed missing, or a compare the plan does not hold
    with pytest.raises(SpecRLError, match=r"missing \[2\], not planned \[\]"):
        os_tool.main(["--plan", str(_plan(tmp_path)), *map(str, runs[:2])])
    more = _compare(tmp_path / "m", "s7", 7, {"speculative": {0: 0.2, 60: 0.5}, "autoregressive": {0: 0.2, 60: 0.5}})
    with pytest.raises(SpecRLError, match=r"missing \[\], not planned \[7\]"):
        os_tool.main(["--plan", str(_plan(tmp_path)), *map(str, runs), str(more)])
    # a run of another processor class
    avx2 = _compare(tmp_path / "a", "s2", 2, {"speculative": {0: 0.2, 60: 0.5}, "autoregressive": {0: 0.2, 60: 0.5}},
                    cls="AVX2")
    with pytest.raises(SpecRLError, match=r"processor class \['AVX2'\]"):
        os_tool.main(["--plan", str(_plan(tmp_path)), *map(str, runs[:2]), str(avx2)])
    # the plan's step not reached by every run
    with pytest.raises(SpecRLError, match=r"--step 45"):
        os_tool.main(["--plan", str(_plan(tmp_path, step=45)), *map(str, runs)])
    # the plan fixes step, margin and alpha
    with pytest.raises(SpecRLError, match="drop --step"):
        os_tool.main(["--plan", str(_plan(tmp_path)), "--alpha", "0.05", *map(str, runs)])


def test_refuses_a_bad_plan(os_tool, tmp_path):
    runs = list(map(str, _three(tmp_path)))
    with pytest.raises(SpecRLError, match="not a file"):
        os_tool.main(["--plan", str(tmp_path / "none.yaml"), *runs])
    with pytest.raises(SpecRLError, match=r"exactly the keys"):
        os_tool.main(["--plan", str(_plan(tmp_path, extra=1)), *runs])
    with pytest.raises(SpecRLError, match=r"alpha is 'x'"):
        os_tool.main(["--plan", str(_plan(tmp_path, alpha="x")), *runs])
    with pytest.raises(SpecRLError, match=r"seeds \[1, 1\]"):
        os_tool.main(["--plan", str(_plan(tmp_path, seeds=[1, 1])), *runs])
    with pytest.raises(SpecRLError, match="margin 2"):
        os_tool.main(["--plan", str(_plan(tmp_path, margin=2)), *runs])


def test_the_shipped_plan_is_a_valid_plan(os_tool):
    plan = os_tool.read_plan(os_tool.ROOT / "docs" / "plans" / "overlay_seeds.yaml")
    assert (os_tool.ROOT / plan["config"]).is_file() and len(plan["seeds"]) >= 2


def test_status_shows_where_each_planned_seed_stands_without_the_test(os_tool, tmp_path, capsys):
    runs = _three(tmp_path)[:2]
    short = _compare(tmp_path / "b", "s2", 2, {"speculative": {0: 0.2, 30: 0.5},
                                               "autoregressive": {0: 0.2, 30: 0.6}})
    plan = _plan(tmp_path, seeds=[0, 1, 2, 3, 4])
    fresh = tmp_path / "s3"  # set up, not yet validated: config.yaml only
    for arm in ("speculative", "autoregressive"):
        (fresh / arm).mkdir(parents=True)
        (fresh / arm / "config.yaml").write_text(yaml.safe_dump({"run": {"seed": 3}}))
    assert os_tool.main(["--plan", str(plan), "--status", *map(str, runs), str(short), str(fresh)]) == 0
    out = capsys.readouterr().out
    rows = {r[0]: r for r in ([c.strip() for c in x.strip().strip("|").split("|")] for x in out.splitlines()
                              if x.startswith("| ") and not x.startswith("| seed"))}
    assert [rows[s][-1] for s in "01234"] == ["finished", "finished", "running or stopped", "starting", "not started"]
    assert rows["2"][2:4] == ["1, 1", "30"] and "p = " not in out
    assert re.search(r"\b2 of 5\b", out)
    with pytest.raises(SpecRLError, match=r"no validation\.jsonl"):  # without --status the test needs every file
        os_tool.main(["--plan", str(plan), *map(str, runs), str(short), str(fresh)])
    with pytest.raises(SpecRLError, match="--plan"):
        os_tool.main(["--status", *map(str, runs)])


def _signal_metrics(run: Path, arm: str, firsts: float, nonzero: list[int]) -> None:
    """One arm's metrics.jsonl: the first step's train accuracy over 8 completions, then one group a step."""
    (run / arm / "metrics.jsonl").write_text("".join(
        json.dumps({"step": i + 1, "reward_mean": 0.5, "reward_std": 0.4, "response_lengths": [9] * 8,
                    "processor_class": "AVX512-BF16", "groups": 1, "groups_nonzero_advantage": nz,
                    **({"train_accuracy": firsts} if i == 0 else {})}) + "\n" for i, nz in enumerate(nonzero)))


def test_the_reward_signal_over_runs_is_step0_success_per_run_and_groups_with_an_advantage(os_tool, tmp_path,
                                                                                          capsys):
    runs = _three(tmp_path)
    # per run, both arms' first 8 completions pooled: 0.25, 0.5 and 0.375
    for run, (sp, ar) in zip(runs, [(0.25, 0.25), (0.5, 0.5), (0.25, 0.5)], strict=True):
        _signal_metrics(run, "speculative", sp, [1, 1, 0])
        _signal_metrics(run, "autoregressive", ar, [1, 0, 0])
    sig = os_tool.signal_summary([os_tool.read_run(r) for r in runs])
    sd = (((0.25 - 0.375) ** 2 + (0.5 - 0.375) ** 2) / 2) ** 0.5
    assert sig["step0_success_rate"] == pytest.approx(0.375)
    assert sig["step0_success_rate_se"] == pytest.approx(sd / 3 ** 0.5)
    assert (sig["step0_runs"], sig["step0_completions"]) == (3, 48)
    assert sig["groups_nonzero_advantage"] == {"speculative": 6, "autoregressive": 3}
    assert sig["groups"] == {"speculative": 9, "autoregressive": 9}
    assert os_tool.main([*map(str, runs)]) == 0
    assert os_tool.signal_line(sig) in capsys.readouterr().out
    # runs whose step records hold no signal: no rate, no groups (not zeros reported as a rate)
    empty = os_tool.signal_summary([os_tool.read_run(r) for r in _three(tmp_path / "e")])
    assert empty["step0_success_rate"] is None and sum(empty["groups"].values()) == 0
    assert "step-0" not in os_tool.signal_line(empty)

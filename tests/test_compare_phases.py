"""tools/compare_phases.py: a compare's speed-ups over ranges of steps, and its refusals of bad input."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from specrl.errors import SpecRLError
from tests.bench import load_tool


@pytest.fixture(scope="module")
def cp():
    return load_tool("compare_phases")


def _rec(step: int, gen: float, train: float, lengths: list[int], al: float | None, nonzero: int) -> dict:
    return {"step": step, "reward_mean": 0.5, "reward_std": 0.5, "accuracy": None, "train_accuracy": 0.5,
            "response_length_mean": sum(lengths) / len(lengths), "response_lengths": lengths,
            "stage_seconds": {"gen": gen, "train": train}, "step_seconds": gen + train,
            "gen_share": gen / (gen + train), "acceptance_length": al, "generated_tokens": sum(lengths),
            "gen_tokens_per_second": sum(lengths) / gen, "groups": 1, "groups_nonzero_advantage": nonzero}


def _run(tmp_path: Path, ar: list[dict], sd: list[dict]) -> Path:
    for arm, recs in (("autoregressive", ar), ("speculative", sd)):
        (tmp_path / arm).mkdir(parents=True)
        (tmp_path / arm / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in recs))
    return tmp_path


def rows(out: str) -> dict[str, list[str]]:
    """The printed table's rows by their first cell (the range), each as its other cells."""
    cells = [[c.strip() for c in x.strip().strip("|").split("|")] for x in out.splitlines() if x.startswith("| ")]
    assert cells[0][:3] == ["steps", "gen ×/step", "gen ×/token"] and len(cells[0]) == 11
    return {c[0]: c[1:] for c in cells[1:]}


def test_rows_are_compare_summary_over_each_range(cp, tmp_path, capsys):
    # steps 1-2: both arms 100-token replies, speculative generation 2x faster; steps 3-4: AR replies shrink to 10
    ar = [_rec(1, 8.0, 4.0, [100, 100], None, 1), _rec(2, 8.0, 4.0, [100, 100], None, 1),
          _rec(3, 1.0, 3.0, [10, 10], None, 0), _rec(4, 1.0, 3.0, [10, 10], None, 0)]
    sd = [_rec(1, 4.0, 4.0, [100, 100], 2.0, 1), _rec(2, 4.0, 4.0, [100, 100], 3.0, 0),
          _rec(3, 4.0, 4.0, [100, 100], 2.0, 1), _rec(4, 4.0, 4.0, [100, 100], 3.0, 1)]
    run = _run(tmp_path, ar, sd)
    cp.main([str(run), "--ranges", "1-2,3-4,1-4"])
    got = rows(capsys.readouterr().out)
    assert list(got) == ["1–2", "3–4", "1–4"]
    # no batch traces in these records: no estimate on the autoregressive arm's work (the last two cells)
    assert got["1–2"] == ["2.00", "2.00", "1.50", "1.50", "2.50", "0.67", "100; 100 tokens", "3 of 4", "n/a", "n/a"]
    # AR 2 s of gen for 40 tokens (20 tok/s) vs spec 8 s for 400 (50 tok/s): 2.5x per token, 0.25x per step
    assert got["3–4"] == ["0.25", "2.50", "0.50", "5.00", "2.50", "0.25", "10; 100 tokens", "2 of 4", "n/a", "n/a"]
    assert got["1–4"][0] == "1.12" and got["1–4"][6:8] == ["55; 100 tokens", "5 of 8"]
    cp.main([str(run)])  # default: every step both arms completed
    assert list(rows(capsys.readouterr().out)) == ["1–4"]


def test_the_last_columns_are_the_estimate_on_the_autoregressive_arms_work(cp, tmp_path, capsys):
    from specrl.run.compare_report import compare_summary

    ar = [{**_rec(1, 3.0, 1.0, [4, 4], None, 1), "batch_trace": [[0.5 * (i + 1), 2, 0, 2] for i in range(6)]}]
    sd = [{**_rec(1, 3.0, 1.0, [12, 12], 3.0, 1), "batch_trace": [[0.25 * (i + 1), 2, 3, 2] for i in range(12)]}]
    run = _run(tmp_path, ar, sd)
    s = compare_summary(ar, sd)
    assert s["gen_speedup_ar_work"] == pytest.approx(3.0 / 1.5) and s["step_speedup_ar_work"] == pytest.approx(4 / 2.5)
    cp.main([str(run)])
    assert rows(capsys.readouterr().out)["1"][-2:] == ["2.00", "1.60"]


@pytest.mark.parametrize("ranges", ["5-x", "0-3", "4-2", "3", ""])
def test_a_bad_range_is_refused_with_an_example(cp, ranges):
    with pytest.raises(SpecRLError, match=r"FIRST-LAST.*--ranges 1-60") as e:
        cp.parse_ranges(ranges)
    assert repr(ranges.split(",")[0].strip()) in str(e.value)


def test_a_range_past_the_arms_last_step_or_a_missing_arm_is_refused(cp, tmp_path):
    ar = [_rec(s, 8.0, 4.0, [100], None, 1) for s in (1, 2, 3)]
    sd = [_rec(s, 4.0, 4.0, [100], 2.0, 1) for s in (1, 2)]  # killed one step behind
    run = _run(tmp_path / "run", ar, sd)
    with pytest.raises(SystemExit, match=r"up to 3 \(autoregressive\)") as e:
        cp.main([str(run), "--ranges", "1-3"])
    assert "and 2 (speculative)" in str(e.value)
    (run / "speculative" / "metrics.jsonl").unlink()
    with pytest.raises(SystemExit, match=r"speculative/metrics\.jsonl") as e:
        cp.main([str(run)])
    assert "does not exist" in str(e.value) and "compare" in str(e.value)

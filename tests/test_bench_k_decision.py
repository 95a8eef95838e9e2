"""benchmarks/k_decision.py: the best fixed k per batch size and whether auto k is within 5% of it."""

import json

from tests.bench import load_benchmark


def _row(b, k, speedup, k_mean=None):
    return {"drafter": "eagle:think", "batch_size": b, "k": k, "speedup": speedup,
            "k_mean": k if k_mean is None else k_mean}


def test_summary_finds_the_best_fixed_k_and_judges_auto(tmp_path):
    kd = load_benchmark("k_decision")
    rows = [_row(1, 1, 1.3), _row(1, 3, 1.8), _row(1, 5, 1.7), _row(1, "auto", 1.75, 3.4),
            _row(8, 1, 0.97), _row(8, 3, 0.9), _row(8, "auto", 0.99, 0.2)]
    s = {x["batch_size"]: x for x in kd.summarize(rows)}
    assert (s[1]["best_k"], s[1]["best_speedup"]) == (3, 1.8) and s[1]["within_tolerance"]
    assert s[8]["best_k"] == 0 and s[8]["best_speedup"] == 1.0  # plain decoding beats every fixed k there
    assert s[8]["within_tolerance"] and s[8]["not_below_plain"]
    path = tmp_path / "sweep.json"
    path.write_text(json.dumps({"hardware": {"processor_class": "AMX", "threads": 2}, "rows": rows}))
    assert kd.main([str(path), "--out", str(tmp_path / "k.png")]) == 0
    assert (tmp_path / "k.png").stat().st_size > 0


def test_auto_below_the_tolerance_fails():
    kd = load_benchmark("k_decision")
    s = kd.summarize([_row(1, 3, 1.8), _row(1, "auto", 1.6, 2.0)])[0]
    assert not s["within_tolerance"] and abs(s["auto_over_best"] - 1.6 / 1.8) < 1e-12


def test_an_earlier_sweeps_auto_is_shown_beside(tmp_path, capsys):
    kd = load_benchmark("k_decision")
    rows = [_row(1, 1, 1.3), _row(1, 3, 1.8), _row(1, "auto", 1.75, 3.4)]
    now, before = tmp_path / "now.json", tmp_path / "before.json"
    now.write_text(json.dumps({"hardware": {"processor_class": "AMX", "threads": 2}, "rows": rows}))
    before.write_text(json.dumps({"hardware": {"processor_class": "AMX", "threads": 2},
                                  "rows": [_row(1, "auto", 1.44, 2.1)]}))
    assert kd.main([str(now), "--before", str(before), "--out", str(tmp_path / "k.png")]) == 0
    assert "0.800 (k 2.1)" in capsys.readouterr().out  # 1.44 / 1.8
    assert (tmp_path / "k.png").stat().st_size > 0

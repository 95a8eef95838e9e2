"""benchmarks/spec_vs_ar.py's decode-bound plot: the measured decode speed-up beside AL/(v + k·c) per batch size,
drawn from a run's rows or redrawn from its --json; bad input is refused with what was expected."""

import json
import sys

import pytest

from tests.bench import load_benchmark


@pytest.fixture(scope="module")
def sva():
    return load_benchmark("spec_vs_ar", "bench_spec_vs_ar")


def _row(spec, b, dec, bound, k=4):
    return dict(drafter=spec, batch_size=b, k=k, confidence_cut="off", decode_speedup=dec, hw_ideal=bound)


def test_plot_bound_draws_one_figure_per_run(sva, tmp_path):
    rows = [_row("eagle:think", b, 1.2, 1.5) for b in (1, 2, 8)] + [_row("parallel:X", b, 1.1, 1.3) for b in (1, 8)]
    out = tmp_path / "bound.png"
    sva.plot_bound(rows, {"processor_class": "AMX", "threads": 1}, str(out))
    assert out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and out.stat().st_size > 5000


def test_plot_bound_refuses_no_rows(sva, tmp_path):
    with pytest.raises(SystemExit) as e:
        sva.plot_bound([], {}, str(tmp_path / "x.png"))
    assert "--plot" in str(e.value)


def test_from_json_redraws_and_checks_its_input(sva, tmp_path, monkeypatch):
    doc = {"hardware": {"processor_class": "AVX2", "threads": 2}, "rows": [_row("ngram", 4, 1.0, 1.1)]}
    src = tmp_path / "run.json"
    src.write_text(json.dumps(doc))
    out = tmp_path / "again.png"
    monkeypatch.setattr(sys, "argv", ["spec_vs_ar.py", "--from-json", str(src), "--plot", str(out)])
    sva.main()
    assert out.exists()
    monkeypatch.setattr(sys, "argv", ["spec_vs_ar.py", "--from-json", str(src)])
    with pytest.raises(SystemExit) as e:
        sva.main()
    assert "--plot" in str(e.value)
    bad = tmp_path / "bad.json"
    bad.write_text(json.dumps({"rows": []}))
    monkeypatch.setattr(sys, "argv", ["spec_vs_ar.py", "--from-json", str(bad), "--plot", str(out)])
    with pytest.raises(SystemExit) as e:
        sva.main()
    assert "hardware" in str(e.value)

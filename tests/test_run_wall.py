"""`run.wall_budget_minutes`: the whole command's wall clock from SPECRL_WALL_START (`make run` sets it before its
set-up). Its deadline keeps the certificate and the report out of the steps' time, sizing plans with what is left,
the budget check stops a compare there, and a bad clock or an unsizable certificate is refused. No test depends on
timing: the clocks given are hours or seconds away from any step's length."""

from __future__ import annotations

import json
import time

import pytest
from typer.testing import CliRunner

from specrl.cli import app
from specrl.errors import SpecRLError
from specrl.run import sizing as wall
from specrl.run.session import Budget
from specrl.run.sizing import LADDER, apply_sizing
from specrl.trainer.config_check import validate_config
from tests.test_rl_trainer import cfg_dict, write_cfg
from tests.tiny import make_tiny_checkpoint


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return make_tiny_checkpoint(tmp_path_factory.mktemp("tiny") / "ckpt", seed=0)


def _cfg(**run):
    return validate_config({"run": {"time_budget_minutes": 10, "wall_budget_minutes": 15, **run},
                            "generation": {"max_new_tokens": 256}, "task": {"val_size": 16},
                            "speculative": {"drafter": "ngram", "num_draft_tokens": 2}})


def test_the_deadline_keeps_the_certificate_and_the_report_out_of_the_steps():
    cfg = _cfg(certificate={"budget_seconds": 60})
    assert wall.wall_deadline(cfg, 1000.0) == 1000.0 + 15 * 60 - wall.CERTIFICATE_OVERRUN * 60 - wall.TAIL_SECONDS
    assert wall.wall_deadline(_cfg(certify=False), 1000.0) == 1000.0 + 15 * 60 - wall.TAIL_SECONDS
    assert wall.wall_deadline(_cfg(wall_budget_minutes=None), 1000.0) is None
    plain = validate_config({"run": {"wall_budget_minutes": 2, "certificate": {"budget_seconds": "auto"}}})
    assert wall.wall_deadline(plain, 0.0) == 120 - wall.TAIL_SECONDS  # no drafter: no certificate to keep out
    with pytest.raises(SpecRLError, match=r"budget_seconds.*'auto'"):  # refused when the config is read
        _cfg(certificate={"budget_seconds": "auto"})


def test_the_clock_reads_specrl_wall_start_and_refuses_a_bad_one(monkeypatch):
    monkeypatch.delenv(wall.WALL_START_ENV, raising=False)
    assert wall.wall_start(now=5000.0) == 5000.0
    now = float(int(time.time()))
    monkeypatch.setenv(wall.WALL_START_ENV, str(int(now) - 240))
    assert wall.wall_start(now=now) == now - 240
    for bad, match in (("soon", "not a time"), (str(int(now) + 3600), r"\+3600 s from now"),
                       (str(int(now) - 2 * 86400), "s from now")):
        monkeypatch.setenv(wall.WALL_START_ENV, bad)
        with pytest.raises(SpecRLError, match=match):
            wall.wall_start(now=now)


def test_the_budget_check_stops_at_the_deadline_and_says_which_budget():
    past = Budget(None, deadline=time.time() - 3600, wall_minutes=15)
    assert past.fits_another()  # the first step always runs
    past.begin()
    past.end()
    assert not past.fits_another() and past.stopped_by == "wall"
    assert "run.wall_budget_minutes=15" in past.note(1, 12) and "step 1 of 12" in past.note(1, 12)
    ahead = Budget(None, deadline=time.time() + 3600, wall_minutes=90)
    ahead.begin()
    ahead.end()
    assert ahead.fits_another() and ahead.stopped_by is None
    both = Budget(1e-9, deadline=time.time() + 3600, wall_minutes=90)
    both.begin()
    both.end()
    assert not both.fits_another() and "run.time_budget_minutes=1e-09" in both.note(1, 3)


def test_sizing_plans_with_what_the_wall_leaves():
    probe = 0.05  # a plain decode step of 50 ms: the configured 10 minutes fit the full work on AMX units
    cfg = _cfg(min_steps=6, certificate={"budget_seconds": 60})
    _, roomy = apply_sizing(cfg, "AMX", probe=lambda c: probe, started=time.time())
    assert roomy["rung"] == 0 and roomy["budget_seconds"] == 600 and roomy["wall"]["wall_budget_minutes"] == 15
    assert "left of run.wall_budget_minutes" not in roomy["reason"]
    # set-up took 11 of the 15 minutes: 4 - 2.5 (certificate, report) = 1.5 minutes are left for the steps
    sized, tight = apply_sizing(cfg, "AMX", probe=lambda c: probe, started=time.time() - 11 * 60)
    assert tight["budget_seconds"] == pytest.approx(90, abs=5) and tight["rung"] > roomy["rung"]
    assert "left of run.wall_budget_minutes=15" in tight["reason"]
    assert sized.generation.max_new_tokens == tight["max_new_tokens"] < 256
    # spent before the steps: the smallest rung, and the reason says it does not fit
    _, spent = apply_sizing(cfg, "AMX", probe=lambda c: probe, started=time.time() - 20 * 60)
    assert spent["rung"] == len(LADDER) - 1 and not spent["fits"] and spent["wall"]["left_minutes"] < 0


def test_a_spent_wall_budget_ends_the_compare_after_its_first_pair(tiny, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv(wall.WALL_START_ENV, str(int(time.time()) - 3600))  # the command "started" an hour ago
    d = cfg_dict(tiny, speculative__drafter="ngram", speculative__num_draft_tokens=2)
    d["run"].update(steps=3, checkpoint_every=0, wall_budget_minutes=30, certify=False)
    d["grpo"]["val_every"] = 0
    r = CliRunner().invoke(app, ["run", "--config", str(write_cfg(tmp_path / "w.yaml", d))])
    assert r.exit_code == 0, r.output
    run_dir = tmp_path / "runs" / "t"
    note = json.loads((run_dir / "compare.json").read_text())["stopped_early"]
    assert note.startswith("stopped by run.wall_budget_minutes=30") and "step 1 of 3" in note
    assert note in (run_dir / "report.md").read_text()
    for arm in ("speculative", "autoregressive"):
        assert len((run_dir / arm / "metrics.jsonl").read_text().splitlines()) == 1

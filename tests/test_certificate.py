"""A speculative run certifies its own losslessness: the probe on its final policy and drafter passes for the real
verifier and fails (a compare exits with an error) for a lossy one that accepts every draft."""

from __future__ import annotations

import json

import pytest
import yaml

from specrl.backends.probe import tokens_needed
from specrl.errors import SpecRLError
from specrl.run.certificate import UNUSED
from tests.test_rl_trainer import cfg_dict
from tests.tiny import make_tiny_checkpoint


def _config(tmp_path, name, **over):
    tiny = make_tiny_checkpoint(tmp_path / "ckpt", seed=0)
    draft = make_tiny_checkpoint(tmp_path / "draft", seed=1)  # another model: its drafts are often rejected
    d = cfg_dict(tiny, speculative__drafter=f"draft-model:{draft}", speculative__num_draft_tokens=2,
                 speculative__verify="rejection", grpo__val_every=0, run__steps=1, run__checkpoint_every=0,
                 run__name=name, run__certificate={"budget_seconds": None}, **over)  # sized by target_w alone
    path = tmp_path / f"{name}.yaml"
    path.write_text(yaml.safe_dump(d))
    return path


def test_a_speculative_run_writes_a_passing_certificate(tmp_path, capsys):
    from specrl.run.loop import train_main

    run = train_main(str(_config(tmp_path, "ok")), [], None, str(tmp_path / "ok"), compare=True)
    cert = json.loads((run / "speculative" / "certificate.json").read_text())
    assert cert["passed"] and cert["k"] == 2 and cert["k_max"] == 7 and cert["p_value"] >= cert["pooled_alpha"]
    # the plan, stated before sampling: sized from the target bias (w <= 0.10 at power 0.99), no budget
    p = cert["plan"]
    assert p["limited_by"] == "target_w" and p["reaches_target"] and p["budget_seconds"] is None
    assert p["tokens"] == cert["num_tokens"] == p["continuations"] * p["tokens_each"] and p["tokens_each"] == 8
    assert p["tokens"] >= tokens_needed(0.10, 9, cert["alpha"] / 2, 0.99) and p["tokens_per_second"] > 0
    assert cert["target_w"] == 0.10 and cert["power_target"] == 0.99 and 0 < cert["detectable_w"] <= 0.10
    # the run's own k policy (fixed k = 2 on an engine with k_max = 7): every verify step drafted 2
    assert set(cert["draft_lengths"]) == {"2"} and set(cert["k_histogram"]) <= {"0", "2"}
    status = {q["position"]: q["status"] for q in cert["positions"]}
    assert [status[f"draft {j}"] for j in range(3, 8)] == [UNUSED] * 5
    assert status["no draft"] == UNUSED
    tokens = {q["position"]: q["tokens"] for q in cert["positions"]}
    assert [tokens[f"draft {j}"] for j in range(3, 8)] == [0] * 5 and tokens["no draft"] == 0
    assert tokens["plain"] == p["continuations"]  # fixed k: no plain steps, only each prefill's first token
    assert sum(q["tokens"] for q in cert["positions"]) == cert["num_tokens"] and cert["run_depths"] == [1, 2]
    for q in cert["positions"]:
        assert q["tested"] == (q["detectable_w"] <= 0.10) and not q["rejected"]
        assert q["status"] != "tested" or q["tokens"] >= 50
    out = capsys.readouterr().out  # the plan is printed before the test runs, the verdict after
    assert -1 < out.find("[specrl] losslessness certificate: ") < out.find("losslessness certificate: PASS")
    summary = json.loads((run / "compare.json").read_text())
    assert summary["certificate"]["passed"]
    assert "losslessness certificate: PASS" in (run / "report.md").read_text()


def test_a_lossy_verifier_fails_the_certificate_and_the_compare(tmp_path, monkeypatch):
    import specrl.rollout.engine as engine
    from specrl.run.loop import train_main

    real = engine.verify

    def accept_everything(mode, target_probs, draft_tokens, *a, **k):  # "lenient" acceptance: lossy
        r = real(mode, target_probs, draft_tokens, *a, **k)
        n, kk = draft_tokens.shape
        r.tokens[:, :kk] = draft_tokens
        r.num_accepted[:] = kk
        r.num_emitted[:] = kk + 1
        return r

    monkeypatch.setattr(engine, "verify", accept_everything)
    with pytest.raises(SpecRLError, match="losslessness certificate failed: FAIL"):
        train_main(str(_config(tmp_path, "lossy")), [], None, str(tmp_path / "lossy"), compare=True)
    cert = json.loads((tmp_path / "lossy" / "speculative" / "certificate.json").read_text())
    assert not cert["passed"] and cert["p_value"] < cert["alpha"]


def test_the_certificate_at_its_default_size_catches_planted_verifier_bugs_by_their_exact_effect():
    """tools/certificate_mutants.py: on its Markov setting each mutant's exact PIT-bin law is computed (the real
    verifier's is uniform, which checks the computation); the real verifier passes the certificate at its default
    size, a mutant that draws replacements from p (pooled w 0.17) fails, and one that draws the bonus token from
    the wrong position (pooled w below 0.10, but w above 1 on the bonus tokens) fails the bonus position's own
    test; the measured bins fit the exact ones."""
    import sys
    from pathlib import Path

    from specrl.run.certificate import plan

    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tools"))
    from certificate_mutants import run

    rows = {r["mutant"]: r for r in run(["unmutated", "residual-from-p", "bonus-wrong-position"])}
    p = plan(2, 4)
    real, resid, bonus = rows["unmutated"], rows["residual-from-p"], rows["bonus-wrong-position"]
    assert real["w"] < 1e-9 and max(real["w_per_position"].values()) < 1e-9 and not real["caught"]
    assert resid["w"] > 0.10 and resid["caught"] and resid["p_value"] < 1e-10
    assert bonus["w"] < 0.10 < 1.0 < bonus["w_per_position"]["bonus"] and bonus["caught"]
    assert bonus["rejected_positions"] == ["bonus"] and bonus["position_p"] < 1e-20  # the bonus tokens' own test
    for r in rows.values():
        assert r["num_tokens"] == p["tokens"] and r["detectable_w"] <= 0.10 and r["fit_p"] > 1e-3
        assert len(r["accepted_per_position"]) == 2 and r["bonus_tokens"] == r["accepted_per_position"][1] > 0
    with pytest.raises(SystemExit, match="no mutant"):
        run(["no-such-mutant"])


def test_the_plan_grows_as_one_over_w_squared_and_a_budget_caps_it():
    """`plan`: tokens ~ 1 / w^2 with no budget; a budget too small for the target is spent, and the bias the
    certificate then detects (> the target) is what it states; the estimate is tokens / the run's tokens/s."""
    from specrl.backends.probe import detectable_w
    from specrl.run.certificate import plan

    a, b = plan(7, 4, 0.10), plan(7, 4, 0.05)
    assert a["tokens_each"] == 16 and a["tokens"] % 16 == 0 and a["limited_by"] == "target_w"
    assert b["tokens"] / a["tokens"] == pytest.approx(4, rel=0.01) and b["reaches_target"]
    assert a["estimated_seconds"] is None and a["budget_seconds"] is None
    cheap = plan(7, 4, 0.10, budget_seconds=10, tokens_per_second=100)  # 1,000 tokens: short of the 5,084 needed
    assert cheap["limited_by"] == "budget" and not cheap["reaches_target"] and cheap["tokens"] == 1008
    assert cheap["detectable_w"] == pytest.approx(detectable_w(1008, 9, 5e-4, 0.99)) and cheap["detectable_w"] > 0.2
    assert cheap["estimated_seconds"] == pytest.approx(10.08)
    rich = plan(7, 4, 0.10, budget_seconds=100, tokens_per_second=100)
    assert rich["limited_by"] == "target_w" and rich["tokens"] == a["tokens"] and rich["reaches_target"]
    assert plan(2, 4, 0.10, budget_seconds=0.01, tokens_per_second=100)["tokens"] >= 200  # the smallest size
    assert plan(2, 500, 0.5)["continuations"] == 500  # one continuation per prompt at least
    with pytest.raises(SpecRLError, match=r"budget.*> 0 seconds.*\b0$"):
        plan(7, 4, 0.10, budget_seconds=0, tokens_per_second=100)
    with pytest.raises(SpecRLError, match=r"tokens/s > 0, got 0"):
        plan(7, 4, 0.10, budget_seconds=10, tokens_per_second=0)
    with pytest.raises(SpecRLError, match=r"bias.*\(0, 1\]") as e:
        plan(7, 4, 0.0)
    assert str(e.value).endswith("got 0.0")


def test_the_budget_comes_from_the_run_and_each_position_says_what_it_tested():
    """run_usage reads the run's step seconds, generated tokens, generation tokens/s and the depths its steps drafted
    at; auto budget = AUTO_MULTIPLE x the generated tokens (no timing in it); a depth with no tokens is "not used
    by the run" unless the run's steps used it."""
    from specrl.config.certificate import AUTO_MULTIPLE
    from specrl.observability.step_record import StepRecord
    from specrl.run.certificate import budget_for, mark_usage, plan, run_usage

    recs = [StepRecord(step=1, step_seconds=4.0, stage_seconds={"gen": 2.0}, generated_tokens=300,
                       acceptance_rate_per_position=[0.6, None, None]),
            StepRecord(step=2, step_seconds=5.0, stage_seconds={"gen": 1.0}, generated_tokens=300,
                       acceptance_rate_per_position=[0.5, 0.4, None])]
    u = run_usage(recs)
    assert u == {"step_seconds": 9.0, "generated_tokens": 600, "tokens_per_second": 200.0, "depths": [1, 2]}
    assert budget_for("auto", u) == (None, AUTO_MULTIPLE * 600)
    assert budget_for(30.0, u) == (30.0, None) and budget_for(None, u) == (None, None)
    assert budget_for("auto", run_usage([])) == (None, None) and run_usage([])["tokens_per_second"] is None
    # a token budget caps the plan like a time budget, with no clock in it
    capped = plan(7, 4, 0.10, budget_tokens=1000)
    assert capped["limited_by"] == "budget" and capped["budget_tokens"] == 1000 and not capped["reaches_target"]
    assert capped["tokens"] == plan(7, 4, 0.10, budget_seconds=10, tokens_per_second=100)["tokens"]
    with pytest.raises(SpecRLError, match=r"token budget.*> 0"):
        plan(7, 4, 0.10, budget_tokens=0)
    rows = [{"position": "plain", "tokens": 900, "tested": True}, {"position": "draft 1", "tokens": 80,
                                                                  "tested": False},
            {"position": "draft 2", "tokens": 0, "tested": False}, {"position": "draft 3", "tokens": 0,
                                                                   "tested": False},
            {"position": "bonus", "tokens": 0, "tested": False}, {"position": "no draft", "tokens": 0,
                                                                 "tested": False}]
    status = [r["status"] for r in mark_usage(rows, u["depths"])]
    assert status == ["tested", "not tested", "not tested", UNUSED, "not tested",
                      UNUSED]


def test_the_certificate_budget_is_a_config_setting():
    from specrl.trainer.config_check import load_config

    assert load_config(None, []).run.certificate.budget_seconds == "auto"
    c = load_config(None, ["run.certificate.budget_seconds=45", "run.certificate.target_w=0.2"]).run.certificate
    assert (c.budget_seconds, c.target_w) == (45.0, 0.2)
    with pytest.raises(SpecRLError, match=r"budget_seconds:.*seconds > 0"):
        load_config(None, ["run.certificate.budget_seconds=-1"])
    with pytest.raises(SpecRLError, match=r"run\.certificate\.target_w"):
        load_config(None, ["run.certificate.target_w=1.5"])

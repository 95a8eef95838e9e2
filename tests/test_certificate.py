"""A speculative run certifies its own losslessness: the probe on its final policy and drafter passes for the real
verifier and fails (a compare exits with an error) for a lossy one that accepts every draft."""

from __future__ import annotations

import json

import pytest
import yaml

from specrl.backends.probe import tokens_needed
from specrl.errors import SpecRLError
from tests.test_rl_trainer import cfg_dict
from tests.tiny import make_tiny_checkpoint


def _config(tmp_path, name):
    tiny = make_tiny_checkpoint(tmp_path / "ckpt", seed=0)
    draft = make_tiny_checkpoint(tmp_path / "draft", seed=1)  # another model: its drafts are often rejected
    d = cfg_dict(tiny, speculative__drafter=f"draft-model:{draft}", speculative__num_draft_tokens=2,
                 speculative__verify="rejection", grpo__val_every=0, run__steps=1, run__checkpoint_every=0,
                 run__name=name)
    path = tmp_path / f"{name}.yaml"
    path.write_text(yaml.safe_dump(d))
    return path


def test_a_speculative_run_writes_a_passing_certificate(tmp_path, capsys):
    from specrl.run.loop import train_main

    run = train_main(str(_config(tmp_path, "ok")), [], None, str(tmp_path / "ok"), compare=True)
    cert = json.loads((run / "speculative" / "certificate.json").read_text())
    assert cert["passed"] and cert["k"] == 2 and cert["p_value"] >= cert["alpha"]
    # sized from the target bias: w <= 0.10 at power 0.99, pooled over every tested token
    assert cert["target_w"] == 0.10 and cert["power_target"] == 0.99 and 0 < cert["detectable_w"] <= 0.10
    assert cert["num_tokens"] >= tokens_needed(0.10, 9, cert["alpha"], 0.99)
    # what was tested: accepted drafts at depths 1 and 2 and the bonus tokens, each with its own power
    assert len(cert["accepted_per_position"]) == 2 and cert["bonus_tokens"] == cert["accepted_per_position"][1]
    assert [p["position"] for p in cert["positions"]] == ["draft 1", "draft 2", "bonus"]
    for p in cert["positions"]:
        assert p["tested"] == (p["detectable_w"] <= 0.10) and p["tokens"] >= 0
    out = capsys.readouterr().out  # the cost is said before the test runs, the verdict after
    assert -1 < out.find("tokens at k=2, sized to detect a bias of Cohen's w >= 0.1") < out.find(
        "losslessness certificate: PASS")
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


def test_the_certificate_at_its_default_size_catches_a_planted_verifier_bug():
    """tools/certificate_mutants.py: the real verifier passes and a mutant that draws replacements from p fails,
    each over the default sample (sized for w <= 0.10), with its tokens per draft depth recorded."""
    import sys
    from pathlib import Path

    from specrl.run.certificate import sample_size

    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tools"))
    from certificate_mutants import run

    rows = {r["mutant"]: r for r in run(["unmutated", "residual-from-p"])}
    samples, tokens = sample_size(2)
    assert not rows["unmutated"]["caught"] and rows["residual-from-p"]["caught"]
    for r in rows.values():
        assert r["num_tokens"] == samples * tokens and r["detectable_w"] <= 0.10
        assert len(r["accepted_per_position"]) == 2 and r["bonus_tokens"] == r["accepted_per_position"][1] > 0
    with pytest.raises(SystemExit, match="no mutant"):
        run(["no-such-mutant"])

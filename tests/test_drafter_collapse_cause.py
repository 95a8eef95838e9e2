"""The drafter-collapse warning names the refit that preceded it when acceptance fell to ~1 right after a drafter
refit from a clearly higher level; a drafter that was never good (or a frozen one) gets no such cause."""

from __future__ import annotations

import re

import pytest

from specrl.drafters.training.online import DrafterCollapseWarning, DrafterHealth
from tests.test_rl_trainer import fake_acceptance, online_trainer
from tests.tiny import make_tiny_checkpoint


def _health():
    return DrafterHealth(fraction=0.5, collapse_threshold=1.05, collapse_patience=2)


def test_cause_names_the_refit_before_the_first_collapsed_step():
    h = _health()
    assert h.observe(2.1, 1, refit=True) == (False, False)
    h.observe(1.0, 2, refit=True)
    assert h.observe(1.01, 3, refit=True)[1]
    assert h.cause == {"step": 2, "version": 1, "before": pytest.approx(2.1), "refresh": False}
    c = h.collapse_cause()
    assert re.search(r"step 2\b.*version 1\b", c) and re.search(r"step 1\b.*\b2\.10\b", c)
    assert "refresh" not in c
    back = _health()
    back.load_state_dict(h.state_dict())  # survives a checkpoint
    assert back.collapse_cause() == c
    h.observe(1.6, 4, refit=True)  # recovered: the cause is forgotten
    assert h.collapse_cause() == ""


def test_a_refresh_before_the_collapse_is_named_too():
    h = _health()
    h.observe(2.5, 1, refit=True)
    h.refreshed(1)
    h.observe(1.0, 2, refit=True)
    assert h.cause == {"step": 2, "version": 1, "before": pytest.approx(2.5), "refresh": True}
    assert re.search(r"version 1\b.*refresh", h.collapse_cause())


@pytest.mark.parametrize("values,refit", [([1.2, 1.0, 1.0], True),  # never clearly higher
                                          ([2.0, 1.0, 1.0], False)])  # no refit (a frozen drafter)
def test_no_cause_without_a_refit_from_a_clearly_higher_level(values, refit):
    h = _health()
    for i, al in enumerate(values, 1):
        h.observe(al, i, refit=refit)
    assert h.streak == 2 and h.collapse_cause() == ""


def test_the_run_warning_says_which_refit_preceded_the_collapse(tmp_path, monkeypatch):
    tiny = make_tiny_checkpoint(tmp_path / "ck")
    t = online_trainer(tiny, monkeypatch, drafter__collapse_patience=2, drafter__staleness_fraction=0.1)
    fake_acceptance(t, [2.2, 1.0, 1.0])
    lines: list[str] = []
    t.log = lines.append
    t.step()
    t.step()
    with pytest.warns(DrafterCollapseWarning, match=r"version 1\b.*\b2\.20") as w:
        t.step()
    assert t.learner.drafter_trainer.health.cause == {"step": 2, "version": 1, "before": pytest.approx(2.2),
                                                      "refresh": False}
    (msg,) = [str(x.message) for x in w if issubclass(x.category, DrafterCollapseWarning)]
    assert re.search(r"step 3\b", msg) and re.search(r"step 2\b.*version 1\b", msg)
    assert any(re.search(r"step 2\b.*version 1\b", x) for x in lines)

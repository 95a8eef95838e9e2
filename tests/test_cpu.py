"""run.threads / ThreadGovernor: explicit counts, auto from the cores other processes leave free, clear errors."""

import re

import pytest
import torch

from specrl import cpu as th
from specrl.errors import SpecRLError
from specrl.trainer.config_check import validate_config


@pytest.fixture(autouse=True)
def _restore_threads():
    n = torch.get_num_threads()
    yield
    torch.set_num_threads(n)


class _Clock:
    """Fake /proc/stat and process CPU readings: others use `others` cores' worth while wall time passes."""

    def __init__(self, monkeypatch, cores=4):
        self.wall = self.busy = self.own = 0.0
        self.others = 0.0
        monkeypatch.setattr(th, "allowed_cores", lambda: cores)
        monkeypatch.setattr(th, "_busy_seconds", lambda: self.busy)
        monkeypatch.setattr(th, "_own_seconds", lambda: self.own)
        monkeypatch.setattr(th.time, "monotonic", lambda: self.wall)
        monkeypatch.setattr(th.time, "sleep", self.advance)

    def advance(self, seconds, ours=0.0):
        self.wall += seconds
        self.own += ours * seconds
        self.busy += (self.others + ours) * seconds


@pytest.mark.parametrize("bad", [0, -1, "two", True, 1.5, None])
def test_bad_settings_name_the_key(bad):
    with pytest.raises(SpecRLError, match=r"threads.*>= 1 or 'auto'"):
        th.ThreadGovernor(bad, "run.threads")


def test_more_threads_than_cores_is_an_error(monkeypatch):
    monkeypatch.setattr(th, "allowed_cores", lambda: 2)
    with pytest.raises(SpecRLError, match=r"threads=3\b.*2 cores.*\b2\b"):
        th.ThreadGovernor(3, "run.threads")


def test_an_integer_is_used_as_given_and_never_moves(monkeypatch):
    clock = _Clock(monkeypatch, cores=4)
    g = th.ThreadGovernor(2)
    assert g.threads == 2 and torch.get_num_threads() == 2
    clock.others = 3.5
    clock.advance(1.0, ours=2)
    assert g.update() == 2 and torch.get_num_threads() == 2


def test_auto_takes_the_free_cores_and_follows_other_jobs(monkeypatch):
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    clock = _Clock(monkeypatch, cores=4)
    clock.others = 1.0  # one core busy elsewhere at start
    g = th.ThreadGovernor("auto")
    assert g.threads == 3 and torch.get_num_threads() == 3
    assert g.others == pytest.approx(1.0) and g.cores == 4
    assert re.search(r"\b1\.0 of 4 cores", g.describe())
    clock.others = 3.0  # a heavy job starts: our own CPU time is not counted as someone else's
    clock.advance(2.0, ours=3)
    assert g.update() == 1 and torch.get_num_threads() == 1
    clock.others = 0.1  # it ends (a core 10 % busy still counts as free)
    clock.advance(2.0, ours=1)
    assert g.update() == 4
    clock.others = 0.5  # half a core busy: not free
    clock.advance(2.0, ours=4)
    assert g.update() == 3


def test_auto_never_goes_below_one_or_above_omp_num_threads(monkeypatch):
    clock = _Clock(monkeypatch, cores=4)
    clock.others = 4.0
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    assert th.ThreadGovernor("auto").threads == 1
    clock.others = 0.0
    monkeypatch.setenv("OMP_NUM_THREADS", "2")
    assert th.ThreadGovernor("auto").threads == 2
    monkeypatch.setenv("OMP_NUM_THREADS", "junk")
    assert th.ThreadGovernor("auto").threads == 4


def test_the_real_machine_is_readable():
    assert th._busy_seconds() is not None and th._busy_seconds() > 0
    g = th.ThreadGovernor("auto", sample_seconds=0.05)
    assert 1 <= g.threads <= th.allowed_cores()


def test_config_checks_run_threads():
    assert validate_config({"run": {"threads": 2}}, "t").run.threads == 2
    assert validate_config({}, "t").run.threads == "auto"
    with pytest.raises(SpecRLError, match=r"threads.*>= 1.*got 0"):
        validate_config({"run": {"threads": 0}}, "t")
    with pytest.raises(SpecRLError, match=r"threads=2 sets.*worker_threads"):
        validate_config({"run": {"threads": 2}, "pipeline": {"mode": "async"},
                         "grpo": {"importance_sampling_correction": True}}, "t")


def test_large_allocations_stay_in_the_heap():
    """A T=1 sampling step at B=32 over a 49,152-token vocabulary allocates several [32, V] temporaries (12 MiB
    for the float64 CDF). With glibc's default they are mapped and unmapped every step (measured: ~12,000 minor
    page faults per step); kept in the heap, a step faults a small fraction of one temporary's pages."""
    import resource

    from specrl.rollout.sampling import (
        behaviour_logprobs,
        probs_from_scaled,
        sample_inverse_cdf,
        scaled_logits,
        uniform,
    )

    assert th.keep_large_allocations() is True  # this machine runs glibc
    assert th.keep_large_allocations() is True  # idempotent
    n, v = 32, 49152
    g = torch.Generator().manual_seed(0)

    def step():
        logits = torch.randn(n, v, generator=g)
        t = torch.ones(n)
        sc = scaled_logits(logits, t, torch.ones(n), torch.zeros(n, dtype=torch.long))
        tok = sample_inverse_cdf(probs_from_scaled(logits, sc, t),
                                 uniform(torch.zeros(n, dtype=torch.long), torch.arange(n), torch.full((n,), 5), 0))
        return behaviour_logprobs(logits, sc, tok, t)

    step()
    before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    for _ in range(10):
        step()
    per_step = (resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before) / 10
    pages = n * v * 8 // 4096
    assert per_step < pages / 4, f"{per_step:.0f} minor page faults per sampling step ({pages} pages per temporary)"


def test_an_active_governor_rereads_during_long_work(monkeypatch):
    """A long job's governor is not fixed by its first reading: tick() re-reads at most every REREAD_SECONDS."""
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    clock = _Clock(monkeypatch, cores=2)
    clock.others = 1.0  # a CI job holds one core while the long job starts
    g = th.ThreadGovernor("auto", sample_seconds=0.2).activate()
    try:
        assert g.threads == 1
        clock.others = 0.0  # the other job ends
        clock.advance(1.0, ours=1.0)
        th.tick()
        assert g.threads == 1, "re-read sooner than REREAD_SECONDS"
        clock.advance(th.REREAD_SECONDS + 0.1, ours=1.0)
        th.tick()
        assert g.threads == 2 and torch.get_num_threads() == 2
        clock.others = 1.0  # and a new one starts
        clock.advance(th.REREAD_SECONDS + 0.1, ours=1.0)
        th.tick()
        assert g.threads == 1
    finally:
        th.deactivate()
    clock.others = 0.0
    clock.advance(th.REREAD_SECONDS * 2, ours=1.0)
    th.tick()  # no active governor: nothing changes
    assert g.threads == 1


def test_the_engine_and_drafter_training_tick(monkeypatch):
    """The long loops call tick(): a generation's decode loop and drafter training's batches."""
    from specrl import RolloutEngine
    from specrl.model.transformer import tiny_model
    from specrl.rollout import engine as eng
    from specrl.rollout.sampling import SamplingParams

    calls = []
    monkeypatch.setattr(eng, "tick", lambda: calls.append(1))
    e = RolloutEngine(tiny_model(), max_batch_size=2, max_seq_len=32)
    e.generate([[1, 2, 3]], SamplingParams(max_new_tokens=5, temperature=1.0, seed=0))
    assert len(calls) >= 4  # prefill emits the first token; each later token is one decode step
    import specrl.drafters.training.offline as tr
    assert tr.tick is th.tick

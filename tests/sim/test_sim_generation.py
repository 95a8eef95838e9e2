"""The event-driven continuous-batching simulation: conservation, KV limits, preemption, auto k."""

import numpy as np
import pytest

from specrl.sim.costs.accelerators import get_hardware
from specrl.sim.costs.models import get_model
from specrl.sim.costs.roofline import Efficiency, ForwardCost
from specrl.sim.costs.speculation import Acceptance, StepModel
from specrl.sim.generation import simulate_engine, simulate_generation
from specrl.sim.workload import Workload, read_histogram


def _costs(k=3, drafter="none", al=None):
    m, hw, eff = get_model("qwen3-8b"), get_hardware("h100"), Efficiency()
    target = ForwardCost(m, hw, eff, "bf16", 1, eff.step_overhead_s)
    acc = Acceptance.from_length(al, 3) if al else None
    draft = ForwardCost(get_model("qwen3-0.6b"), hw, eff, "bf16", 1, eff.draft_overhead_s) if al else None
    return StepModel(target, drafter, draft, acc, k, eff.ngram_overhead_s), target


def test_single_sequence_time_is_steps_times_step_cost():
    step, prefill = _costs()
    st = simulate_engine(np.array([16.0]), np.array([100.0]), step, prefill, kv_capacity=1e6, max_seqs=8)
    assert st.steps == 100 and st.tokens == 100
    mid = step.ar_seconds(1, 16 + 49.5)
    assert st.seconds - st.prefill_seconds == pytest.approx(100 * mid, rel=1e-6)


def test_batch_drains_and_all_tokens_are_generated():
    step, prefill = _costs()
    resp = np.array([10.0, 50.0, 200.0, 1000.0])
    st = simulate_engine(np.full(4, 8.0), resp, step, prefill, kv_capacity=1e6, max_seqs=8)
    assert st.tokens == resp.sum()
    assert st.steps == 1000
    assert st.batch_steps == pytest.approx(resp.sum())


def test_max_seqs_and_kv_capacity_limit_concurrency():
    step, prefill = _costs()
    prompts, resp = np.full(8, 10.0), np.full(8, 100.0)
    free = simulate_engine(prompts, resp, step, prefill, kv_capacity=1e6, max_seqs=8)
    slots = simulate_engine(prompts, resp, step, prefill, kv_capacity=1e6, max_seqs=2)
    assert slots.steps == 4 * free.steps
    tight = simulate_engine(prompts, resp, step, prefill, kv_capacity=450.0, max_seqs=8)
    assert tight.preemptions > 0 and tight.tokens >= resp.sum()


def test_speculative_engine_takes_fewer_steps():
    step, prefill = _costs(k=3, drafter="eagle3", al=3.0)
    st = simulate_engine(np.array([16.0]), np.array([300.0]), step, prefill, kv_capacity=1e6, max_seqs=8)
    assert st.steps == 100


def test_auto_k_picks_plain_decoding_when_drafts_are_useless_and_k_when_good():
    auto_bad, _ = _costs(k="auto", drafter="eagle3", al=1.0)
    assert auto_bad.choose(4, 1000)[0] == 0
    auto_good, _ = _costs(k="auto", drafter="eagle3", al=3.9)
    assert auto_good.choose(4, 1000)[0] >= 3


def test_streams_amortise_the_drain():
    step, prefill = _costs()
    resp = Workload(prompts_per_step=16, generations_per_prompt=4, response_mean=300, response_sigma=1.0,
                    max_response_tokens=2000).response_lengths()
    one = simulate_generation(np.full((1, 64), 16.0), resp[None], 2, step, prefill, 1e6, 64, 4)
    two = simulate_generation(np.full((2, 64), 16.0), np.stack([resp, resp[::-1]]), 2, step, prefill, 1e6, 64, 4)
    assert two.seconds < one.seconds
    assert two.generated_tokens == pytest.approx(one.generated_tokens)


def test_workload_lengths_and_histogram(tmp_path):
    wl = Workload(prompts_per_step=64, generations_per_prompt=8, response_mean=1000, response_sigma=1.0,
                  max_response_tokens=4000)
    r = wl.response_lengths()
    assert len(r) == 512 and r.max() == 4000 and r.min() >= 1
    assert np.array_equal(r, wl.response_lengths())  # deterministic
    h = tmp_path / "h.csv"
    h.write_text("length,count\n100,3\n1000,1\n")
    vals, counts = read_histogram(h)
    assert list(vals) == [100, 1000] and list(counts) == [3, 1]
    r2 = Workload(prompts_per_step=8, generations_per_prompt=1, length_histogram=str(h)).response_lengths()
    assert sorted(r2) == [100] * 6 + [1000] * 2


@pytest.mark.parametrize("drafter", ["ngram", "eagle3"])
def test_host_overhead_per_sequence_scales_with_batch(drafter):
    m, hw = get_model("qwen3-8b"), get_hardware("h100")
    eff = Efficiency(ngram_overhead_s=0.0)
    target = ForwardCost(m, hw, eff, "bf16", 1, eff.step_overhead_s)
    draft = ForwardCost(get_model("qwen3-0.6b"), hw, eff, "bf16", 1, eff.draft_overhead_s)
    acc = Acceptance.from_length(2.0, 3)
    plain = StepModel(target, drafter, draft, acc, 3, 0.0, seq_overhead_s=0.0)
    host = StepModel(target, drafter, draft, acc, 3, 0.0, seq_overhead_s=1e-3)
    for b in (1, 8, 64):
        extra = host.spec_seconds(b, 100.0, 3) - plain.spec_seconds(b, 100.0, 3)
        assert extra == pytest.approx(b * 1e-3, rel=1e-9)
        assert host.ar_seconds(b, 100.0) == plain.ar_seconds(b, 100.0)  # plain decoding pays no drafting cost


def test_per_sequence_decode_cost_is_paid_once_per_step_not_per_verified_token():
    """A decode step's host work per sequence (sampling, bookkeeping) is paid by AR and verify steps alike, so it
    makes extra sequences dearer than extra verified rows (the engine's k-grid: v = 1.84 at B=16, k=7)."""
    from specrl.sim.costs.accelerators import get_hardware
    from specrl.sim.costs.models import eagle3_head, get_model
    from specrl.sim.costs.roofline import Efficiency, ForwardCost
    from specrl.sim.costs.speculation import Acceptance, StepModel

    m, hw = get_model("qwen3-8b"), get_hardware("h100")
    eff = Efficiency(step_overhead_s=0.0, draft_overhead_s=0.0)
    t, d = ForwardCost(m, hw, eff, "bf16", 1, 0.0), ForwardCost(eagle3_head(m), hw, eff, "bf16", 1, 0.0)
    acc = Acceptance.from_length(2.5, 3)
    plain = StepModel(t, "eagle3", d, acc, 3, 0.0)
    host = StepModel(t, "eagle3", d, acc, 3, 0.0, decode_seq_overhead_s=1e-3)
    b, kv = 16, 16 * 1000.0
    assert host.ar_seconds(b, kv) - plain.ar_seconds(b, kv) == pytest.approx(b * 1e-3)
    assert host.spec_seconds(b, kv, 3) - plain.spec_seconds(b, kv, 3) == pytest.approx(b * 1e-3)  # not b*(k+1)

"""Sanity laws the simulator must obey."""

from dataclasses import replace

import pytest

from specrl.sim.costs.accelerators import get_hardware
from specrl.sim.costs.models import ModelSpec, get_model
from specrl.sim.costs.roofline import Efficiency, ForwardCost
from specrl.sim.pipeline import SimConfig, simulate
from specrl.sim.scenarios import get_preset
from specrl.sim.workload import Workload

NO_OVERHEAD = Efficiency(bw_eff=0.8, flops_eff=0.6, step_overhead_s=0.0, draft_overhead_s=0.0,
                         ngram_overhead_s=0.0)


def _single(**kw) -> SimConfig:
    wl = Workload(prompts_per_step=1, generations_per_prompt=1, max_response_tokens=256, prompt_tokens=32,
                  response_mean=256, response_sigma=0.0)
    base = SimConfig(model="qwen3-8b", hardware="h100", gpus=8, drafter="eagle3", k=3, acceptance_length=3.0,
                     workload=wl, efficiency=NO_OVERHEAD)
    return replace(base, **kw)


@pytest.mark.parametrize("k,al", [(1, 1.8), (3, 3.0), (5, 4.0)])
def test_memory_bound_limit_is_al_over_one_plus_kc(k, al):
    r = simulate(_single(k=k, acceptance_length=al))
    c = r["spec"]["draft_cost_ratio"]
    assert r["rollout_speedup"] == pytest.approx(al / (1 + k * c), rel=0.05)


def test_compute_bound_limit_is_below_one():
    # short sequences: the KV read (not multiplied by k+1) stays small next to the compute-bound GEMMs
    wl = Workload(prompts_per_step=4096, generations_per_prompt=1, max_response_tokens=16, prompt_tokens=16,
                  response_mean=16, response_sigma=0.0)
    r = simulate(SimConfig(model="qwen3-8b", hardware="h100", gpus=4, drafter="eagle3", k=3, acceptance_length=2.5,
                           max_num_seqs=1024, workload=wl, efficiency=NO_OVERHEAD))
    assert r["rollout_speedup"] < 1.0
    # verify over B(k+1) tokens costs ~(k+1)x a decode step when compute-bound
    assert r["rollout_speedup"] == pytest.approx(2.5 / 4, rel=0.25)


def test_moe_stays_memory_bound_to_larger_batches_than_dense_of_same_active_size():
    moe = get_model("qwen3-235b-a22b")
    dense = ModelSpec(name="dense-a22b", hidden=moe.hidden, layers=moe.layers, heads=moe.heads,
                      kv_heads=moe.kv_heads, head_dim=moe.head_dim,
                      intermediate=moe.experts_per_token * moe.moe_intermediate, vocab=moe.vocab)
    assert dense.active_params() == pytest.approx(moe.active_params(), rel=0.01)
    hw, eff = get_hardware("h100"), Efficiency()
    ridge_moe = ForwardCost(moe, hw, eff, "bf16", 8, 0.0).ridge_tokens()
    ridge_dense = ForwardCost(dense, hw, eff, "bf16", 8, 0.0).ridge_tokens()
    assert ridge_moe > 3 * ridge_dense


def test_speedup_grows_with_acceptance_and_al_one_is_a_loss():
    speedups = [simulate(_single(acceptance_length=al))["rollout_speedup"] for al in (1.0, 2.0, 3.0, 4.0)]
    assert speedups == sorted(speedups)
    assert speedups[0] < 1.0


def test_bound_formula_and_step_speedup_below_bound_when_memory_bound():
    r = simulate(get_preset("paper-8b-rl-think"))
    R, al = r["gen_share"], r["spec"]["acceptance_length"]
    assert r["bound"] == pytest.approx(1 / (R / al + 1 - R))
    assert 1.0 < r["step_speedup"] < r["bound"]


def _small_think() -> SimConfig:
    """The RL-Think preset at a quarter of the rollouts and GPUs (keeps the test fast)."""
    return get_preset("paper-8b-rl-think").with_(prompts_per_step=128, gpus=8)


def test_async_not_slower_than_sync_when_generation_dominates():
    cfg = _small_think()
    sync = simulate(cfg)
    assert sync["gen_share"] > 0.5
    for drafter in ("none", "eagle3"):
        sync_s = simulate(replace(cfg, drafter=drafter))["spec"]["step_seconds"]
        for lag in (1, 2):
            best = min(simulate(replace(cfg, drafter=drafter, mode="async", policy_lag=lag,
                                        gen_gpu_fraction=f))["spec"]["step_seconds"] for f in (0.5, 0.75))
            assert best <= sync_s


def test_more_lag_never_hurts():
    cfg = replace(_small_think(), mode="async", gen_gpu_fraction=0.75)
    steps = [simulate(replace(cfg, policy_lag=lag))["spec"]["step_seconds"] for lag in (0, 1, 2)]
    assert steps[0] >= steps[1] >= steps[2]


def test_kv_read_does_not_hide_the_gemm_flops_of_a_verify():
    """GEMMs and attention are separate kernels: a long-context verify over B*(k+1) tokens pays its GEMM FLOPs
    on top of the KV read (one max over all FLOPs and all bytes let the KV read hide them: verify looked free)."""
    fc = ForwardCost(get_model("qwen3-8b"), get_hardware("gb200"), NO_OVERHEAD, "bf16", 1, 0.0)
    b, k = 256, 7
    kv = b * 4000.0  # 256 sequences with 4k cached tokens each: the KV read alone outweighs the weights ~5x
    assert fc.attn_byte_seconds(kv) > 4 * fc.gemm_byte_seconds(b)
    ar, verify = fc(b, kv), fc(b * (k + 1), kv, attn_pairs=(k + 1) * kv)
    extra_gemm = fc.gemm_flop_seconds(b * (k + 1)) - max(fc.gemm_flop_seconds(b), fc.gemm_byte_seconds(b))
    assert extra_gemm > 0.5 * ar  # the verify's GEMMs are compute-bound
    assert verify - ar >= extra_gemm * (1 - 1e-9)  # ... and all of that extra GEMM time is paid
    assert verify > 1.5 * ar

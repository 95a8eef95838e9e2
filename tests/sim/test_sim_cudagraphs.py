"""CUDA-graph coverage: forwards above vLLM's largest captured size launch every kernel from the host.

The mechanism is real and priced, and these tests pin both halves of what it does: a forward that falls out of
the graphs costs max(roofline time, kernel launches) — a small model's verify above the capture size becomes
launch-bound — while an 8B verify on GB200 above the capture size is long enough to hide its launches, which is
why CUDA-graph coverage does not produce the paper's k >= 5 slowdown. On a CPU there are no graphs: off by
construction.
"""

import json
import math
from dataclasses import replace

import pytest
from typer.testing import CliRunner

from specrl.errors import SpecRLError
from specrl.sim.commands import app
from specrl.sim.costs.accelerators import get_hardware, save_profile
from specrl.sim.costs.models import get_model
from specrl.sim.costs.roofline import KERNELS_PER_LAYER, Efficiency, ForwardCost, eager_launch_seconds
from specrl.sim.pipeline import SimConfig, cudagraph_max_tokens, simulate
from specrl.sim.scenarios import get_preset
from specrl.sim.workload import Workload

runner = CliRunner()
CPU_PROFILE = {"name": "cpu", "peak_flops": {"bf16": 1e11, "fp32": 5e10, "fp8": 1e11}, "hbm_bandwidth": 2e10,
               "hbm_bytes": 16e9, "nvlink_bandwidth": 2e10, "network_bandwidth": 1e9, "nvlink_domain": 1,
               "threads": 2}


def test_capture_size_follows_vllms_default_rule():
    # min(max_num_seqs * (1 + k) * 2, 512 on Hopper | 1024 on data-center Blackwell)
    h100, gb200 = get_hardware("h100"), get_hardware("gb200")
    cfg = SimConfig()
    assert cudagraph_max_tokens(cfg, gb200, 3) == 1024
    assert cudagraph_max_tokens(cfg, gb200, 0) == 512  # the autoregressive engine: decode query length 1
    assert cudagraph_max_tokens(cfg, h100, 7) == 512
    assert cudagraph_max_tokens(replace(cfg, max_num_seqs=16), h100, 3) == 128
    assert cudagraph_max_tokens(replace(cfg, cudagraph_max_tokens=0), h100, 3) == 0
    assert cudagraph_max_tokens(replace(cfg, cudagraph_max_tokens=96), h100, 3) == 96


def test_a_forward_above_the_capture_size_pays_its_kernel_launches():
    """Removing the mechanism makes a 600-token forward of a 135M model as cheap as a 512-token one."""
    hw, eff, m = get_hardware("h100"), Efficiency(), get_model("smollm2-135m")
    fwd = ForwardCost(m, hw, eff, "bf16", 1, 0.0, graph_max_tokens=512)
    launch = m.layers * KERNELS_PER_LAYER * hw.kernel_launch_s
    assert eager_launch_seconds(m, hw) == pytest.approx(launch) and launch > 5e-3
    assert fwd.graphed(512) and not fwd.graphed(513)
    graphed, eager = fwd(512, 512 * 300), fwd(600, 600 * 300)
    assert graphed < launch / 4  # the roofline time of the graphed forward: well under its launches
    assert eager == pytest.approx(launch)  # launch-bound: the kernels are shorter than their launches


def test_an_8b_verify_above_the_capture_size_hides_its_launches():
    """Why CUDA-graph coverage is not the k >= 5 slowdown: at B*(k+1) > 1024 tokens an 8B forward on GB200 runs
    for far longer than the 9.5 ms it takes to launch, so leaving the graphs costs nothing."""
    hw, eff, m = get_hardware("gb200"), Efficiency(), get_model("qwen3-8b")
    graphs = ForwardCost(m, hw, eff, "bf16", 1, 0.0)
    eager = ForwardCost(m, hw, eff, "bf16", 1, 0.0, graph_max_tokens=1024)
    b, k, ctx = 256, 7, 1000
    assert not eager.graphed(b * (k + 1))
    assert eager(b * (k + 1), b * ctx) == graphs(b * (k + 1), b * ctx) > 2 * eager.eager_launch_s


def test_no_cuda_graph_mechanism_on_a_cpu(tmp_path):
    hw = get_hardware("cpu", save_profile(CPU_PROFILE, tmp_path / "cpu.json"))
    assert not hw.cuda_graphs and eager_launch_seconds(get_model("smollm2-135m"), hw) == 0.0
    assert cudagraph_max_tokens(SimConfig(), hw, 7) == math.inf
    fwd = ForwardCost(get_model("smollm2-135m"), hw, Efficiency(), "bf16", 1, 1e-3, graph_max_tokens=0)
    assert fwd.graphed(10_000)
    assert fwd(4096, 0) == ForwardCost(get_model("smollm2-135m"), hw, Efficiency(), "bf16", 1, 1e-3)(4096, 0)


def test_enforce_eager_slows_a_launch_bound_engine_and_the_share_is_reported():
    base = SimConfig(model="qwen3-0.6b", hardware="h100", gpus=1, k=3, acceptance_length=2.5,
                     workload=Workload(prompts_per_step=16, generations_per_prompt=4, max_response_tokens=512,
                                       response_mean=300.0))
    graphs, eager = simulate(base), simulate(replace(base, cudagraph_max_tokens=0))
    assert eager["ar"]["stages"]["gen"] > 1.5 * graphs["ar"]["stages"]["gen"]
    assert eager["ar"]["generation"]["eager_step_share"] == 1.0
    assert graphs["ar"]["generation"]["eager_step_share"] == 0.0  # 64 sequences: always graphed
    assert graphs["spec"]["cudagraph_max_tokens"] == min(256 * 4 * 2, 512)
    # the 8B preset at k=7: the full early batches (256 x 8 tokens) run outside the graphs, the tail inside
    r = simulate(get_preset("paper-8b-rl-think").with_(k=7, acceptance_length=3.48))
    assert 0.0 < r["spec"]["generation"]["eager_step_share"] < 0.5
    assert r["ar"]["generation"]["eager_step_share"] == 0.0


def test_bad_cudagraph_settings_are_refused(tmp_path):
    with pytest.raises(SpecRLError, match="integer >= 0"):
        simulate(replace(SimConfig(), cudagraph_max_tokens=-1))
    with pytest.raises(SpecRLError, match="integer >= 0"):
        simulate(replace(SimConfig(), cudagraph_max_tokens=1.5))
    with pytest.raises(SpecRLError, match="graph_max_tokens=-1"):
        ForwardCost(get_model("qwen3-8b"), get_hardware("h100"), Efficiency(), "bf16", 1, 0.0, graph_max_tokens=-1)
    res = runner.invoke(app, ["--cudagraph-max-tokens", "-1"])
    assert res.exit_code == 2 and "must be >= 0" in res.output
    prof = save_profile(CPU_PROFILE, tmp_path / "cpu.json")
    res = runner.invoke(app, ["--hardware", "cpu", "--cpu-profile", str(prof), "--model", "smollm2-135m",
                              "--gpus", "1", "--cudagraph-max-tokens", "8"])
    assert res.exit_code == 2 and "has no CUDA graphs" in res.output, res.output
    res = runner.invoke(app, ["--cudagraph-max-tokens", "many"])
    assert res.exit_code == 2


def test_json_carries_the_capture_size():
    res = runner.invoke(app, ["--preset", "paper-8b-rl-think", "--cudagraph-max-tokens", "512", "--json"])
    assert res.exit_code == 0, res.output
    out = json.loads(res.output)
    assert out["ar"]["cudagraph_max_tokens"] == 512 and out["spec"]["cudagraph_max_tokens"] == 512
    assert out["config"]["cudagraph_max_tokens"] == 512


def test_the_trace_accounts_for_the_slowest_engines_decode_time():
    from specrl.sim.pipeline import prepare, run_generation

    ctx = prepare(SimConfig(model="qwen3-0.6b", hardware="h100", gpus=2, k=3, acceptance_length=2.5,
                            workload=Workload(prompts_per_step=8, generations_per_prompt=4, max_response_tokens=256,
                                              response_mean=150.0)))
    trace: list = []
    res, _ = run_generation(ctx, True, trace)
    decode = sum(n * dt for _, _, n, dt, _ in trace)
    assert trace and all(k == 3 for _, k, _, _, _ in trace)
    assert decode == pytest.approx(res.seconds - res.prefill_seconds)

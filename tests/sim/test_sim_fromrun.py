"""--from-run on sync and async specrl runs: the async pipeline model, per-side cores, trainer padding, the
online drafter's training cost and the two-run CPU fit."""

import json
import re
from dataclasses import replace

import numpy as np
import pytest
from typer.testing import CliRunner

from specrl.errors import SpecRLError
from specrl.sim.calibration.calibrate import fit_cpu_efficiency
from specrl.sim.calibration.fromrun import config_for_run, predict_run, read_run_config, run_records
from specrl.sim.commands import app
from specrl.sim.costs.accelerators import get_hardware, with_threads
from specrl.sim.costs.models import get_model
from specrl.sim.costs.roofline import Efficiency
from specrl.sim.pipeline import combine, other_stages, prepare, simulate, trainer_forward_flops
from specrl.sim.workload import Workload

runner = CliRunner()
PROFILE = {"name": "cpu", "peak_flops": {"bf16": 4e11, "fp32": 2e11, "fp8": 4e11}, "hbm_bandwidth": 2e10,
           "hbm_bytes": 16e9, "nvlink_bandwidth": 2e10, "network_bandwidth": 1e9, "nvlink_domain": 1, "threads": 2}


def _run(tmp_path, name="r", mode="sync", new_tokens=32, lengths=None, stages=None, wt=1, lt=1, drafter="none",
         online=False, extra=None):
    run = tmp_path / name
    run.mkdir(parents=True)
    (run / "config.yaml").write_text(
        "model:\n  name: smollm2-135m\n  dtype: float32\n  rollout_dtype: bfloat16\n"
        "grpo:\n  num_prompts_per_step: 1\n  num_generations: 8\npolicy:\n  precision: bf16-mixed\n"
        f"  train_micro_batch_size: 8\ngeneration:\n  max_new_tokens: {new_tokens}\n  max_batch_size: 8\n"
        f"speculative:\n  drafter: {drafter}\n  num_draft_tokens: 2\ndrafter:\n  online: {str(online).lower()}\n"
        f"pipeline:\n  mode: {mode}\n  num_rollout_workers: 1\n  worker_threads: {wt}\n  learner_threads: {lt}\n"
        "  max_trajectory_age_steps: 1\n")
    lengths = lengths or [20] * 8
    st = stages or {"data": 0.001, "prepare": 0.03, "gen": 1.5, "logprob": 1.0, "train": 4.0}
    rec = []
    for step in range(3):
        r = {"step": step, "stage_seconds": dict(st), "step_seconds": sum(st.values()),
             "response_length_mean": float(np.mean(lengths)), "response_lengths": list(lengths),
             "acceptance_length": 1.5 if drafter != "none" else None, "num_draft_tokens_mean": 2.0,
             "draft_updates": 1 if online else 0}
        r.update(extra or {})
        rec.append(json.dumps(r))
    (run / "metrics.jsonl").write_text("\n".join(rec) + "\n")
    prof = tmp_path / "cpu.json"
    prof.write_text(json.dumps(PROFILE))
    return run, str(prof)


def test_async_run_is_simulated_with_the_async_pipeline_on_per_side_cores(tmp_path):
    extra = {"gen_seconds_workers": 2.5, "exposed_gen_seconds": 0.0, "refit_seconds": 0.2}
    arun, prof = _run(tmp_path, "async", mode="async",
                      stages={"data": 0.001, "prepare": 0.1, "gen": 0.0, "logprob": 2.0, "train": 8.0}, extra=extra)
    srun, _ = _run(tmp_path, "sync")
    a = predict_run(arun, cpu_profile=prof, prompt_tokens=57)
    s = predict_run(srun, cpu_profile=prof, prompt_tokens=57)
    cfg = a["config"]
    assert cfg["mode"] == "async" and cfg["gpus"] == 2 and cfg["cpu_threads"] == 1 and cfg["policy_lag"] == 1
    assert not cfg["async_run_ahead"]  # specrl's worker generates one batch at a time
    by, sby = ({r["stage"]: r for r in x["rows"]} for x in (a, s))
    assert by["gen"]["measured"] == 2.5 and by["prepare"]["measured"] == 0.2  # the worker's, not the learner's
    assert by["exposed gen"]["measured"] == 0.0
    st = a["simulation"]["ar"]["stages"]
    assert by["step"]["predicted"] == pytest.approx(combine(st, "async", 1)[0])
    # one core per side: the learner's stages take twice the sync run's two-core time
    assert by["train"]["predicted"] == pytest.approx(2 * sby["train"]["predicted"], rel=1e-6)
    assert by["gen"]["predicted"] > sby["gen"]["predicted"]


def test_async_run_with_unequal_sides_gives_each_actor_its_cores(tmp_path):
    """worker_threads and learner_threads from config.yaml: the learner trains on its own cores, the worker
    generates on its own (before: unequal sides were refused)."""
    extra = {"gen_seconds_workers": 2.5, "exposed_gen_seconds": 0.0, "refit_seconds": 0.2}
    st = {"data": 0.001, "prepare": 0.1, "gen": 0.0, "logprob": 2.0, "train": 8.0}
    one, prof = _run(tmp_path, "one", mode="async", wt=1, lt=1, stages=st, extra=extra)
    uneq, _ = _run(tmp_path, "uneq", mode="async", wt=1, lt=2, stages=st, extra=extra)
    a, b = predict_run(one, cpu_profile=prof), predict_run(uneq, cpu_profile=prof)
    assert b["config"]["cpu_threads"] == 1 and b["config"]["learner_cpu_threads"] == 2
    assert b["threads"] == {"generation": 1, "learner": 2} and a["threads"] == {"generation": 1, "learner": 1}
    pa, pb = ({r["stage"]: r["predicted"] for r in x["rows"]} for x in (a, b))
    assert pb["train"] == pytest.approx(pa["train"] / 2, rel=1e-6)  # two learner cores: GEMMs at twice the rate
    assert pb["gen"] == pytest.approx(pa["gen"])  # the worker is the same one-core device
    with pytest.raises(SpecRLError, match=r"learner_cpu_threads=2\b.*async pipeline"):
        simulate(replace(config_for_run(read_run_config(one), run_records(one), prof), mode="sync",
                         learner_cpu_threads=2))


def test_fit_on_async_run_is_refused(tmp_path):
    run, prof = _run(tmp_path, "as", mode="async")
    res = runner.invoke(app, ["fit", "--from-run", str(run), "--cpu-profile", prof])
    assert res.exit_code == 2 and "needs a sync run" in res.output


def test_with_threads_scales_peaks_and_needs_a_thread_count(tmp_path):
    (tmp_path / "p.json").write_text(json.dumps(PROFILE))
    hw = get_hardware("cpu", tmp_path / "p.json")
    one = with_threads(hw, 1)
    assert one.flops("bf16") == pytest.approx(hw.flops("bf16") / 2) and one.hbm_bandwidth == hw.hbm_bandwidth / 2
    with pytest.raises(SpecRLError, match="no measured thread count"):
        with_threads(get_hardware("h100"), 1)


def test_trainer_pads_micro_batches_to_their_longest_sequence_and_heads_only_responses():
    m = get_model("smollm2-135m")
    prompts, responses = np.array([10.0, 10.0]), np.array([10.0, 190.0])
    g_packed, a_packed = trainer_forward_flops(m, prompts, responses, 0)
    g_pad, a_pad = trainer_forward_flops(m, prompts, responses, 2)
    lm, body = m.lm_head_params(), m.active_params() - m.lm_head_params()
    assert g_packed == pytest.approx(2 * m.active_params() * 220)
    assert g_pad == pytest.approx(2 * body * 400 + 2 * lm * 200)  # 2 x 200 padded; head on 200 response tokens
    assert a_pad == pytest.approx(m.attn_flops_per_pair() * 2 * 200 * 200 / 2) and a_pad > a_packed
    g_split, _ = trainer_forward_flops(m, prompts, responses, 1)  # one sequence per micro-batch: no padding
    assert g_split == pytest.approx(2 * body * 220 + 2 * lm * 200)


def test_online_drafter_training_is_priced_in_the_train_stage(tmp_path):
    run, prof = _run(tmp_path, "spec", drafter="eagle:default", online=True)
    cfg = config_for_run(read_run_config(run), run_records(run),
                         prof, prompt_tokens=57)
    assert cfg.drafter_trained_online and cfg.drafter_train_passes == 3.0
    ctx = prepare(cfg)
    on, off = other_stages(ctx, True), other_stages(replace(ctx, cfg=replace(cfg, drafter_trained_online=False)), True)
    assert on["train"] > off["train"] and on["logprob"] == off["logprob"]


def test_two_run_cpu_fit_recovers_known_factors(tmp_path):
    """Stage times made by the simulator with known factors are fitted back: per-forward vs per-sequence decode
    overhead from two generation regimes, GEMM vs attention MFU from a short and a long run."""
    truth = Efficiency(bw_eff=1.0, flops_eff=1.0, step_overhead_s=0.02, draft_overhead_s=0.02 / 30,
                       ngram_overhead_s=0.0, decode_seq_overhead_s=0.002, spec_seq_overhead_s=0.0, mfu_logprob=0.7,
                       mfu_train=0.5, mfu_attention=0.05, prepare_fixed_s=0.03, data_s=0.001)
    made = []
    for name, new, lens in (("short", 32, [10, 14, 20, 32, 12, 18, 25, 32]),
                            ("long", 512, [150, 220, 300, 410, 180, 260, 350, 480])):
        run, prof = _run(tmp_path / "tmp", name, new_tokens=new, lengths=lens)
        st = simulate(config_for_run(read_run_config(run), run_records(run), prof, truth,
                                     prompt_tokens=60))["ar"]["stages"]
        made.append(_run(tmp_path, name, new_tokens=new, lengths=lens, stages=st)[0])
    out = fit_cpu_efficiency(made, cpu_profile=prof, prompt_tokens=60)
    eff = out["efficiency"]
    assert eff.step_overhead_s == pytest.approx(0.02, rel=0.02)
    assert eff.decode_seq_overhead_s == pytest.approx(0.002, rel=0.02)
    assert eff.mfu_train == pytest.approx(0.5, rel=0.02) and eff.mfu_attention == pytest.approx(0.05, rel=0.02)
    assert eff.mfu_logprob == pytest.approx(0.7, rel=0.02)
    for rows in (out["rows"], out["rows_long"]):
        assert all(abs(r["error"]) < 0.02 for r in rows if r["measured"] > 0.01)


def test_threads_flag_is_for_sync_runs_and_scales_the_device(tmp_path):
    run, prof = _run(tmp_path, "s")
    two, one = predict_run(run, cpu_profile=prof, prompt_tokens=57), predict_run(run, cpu_profile=prof,
                                                                                  prompt_tokens=57, threads=1)
    t2, t1 = ({r["stage"]: r["predicted"] for r in x["rows"]} for x in (two, one))
    assert t1["train"] == pytest.approx(2 * t2["train"], rel=1e-6) and t1["gen"] > t2["gen"]
    arun, _ = _run(tmp_path, "a", mode="async")
    with pytest.raises(SpecRLError, match=r"--threads applies.*sync run"):
        predict_run(arun, cpu_profile=prof, threads=1)


def test_cpu_fit_prices_a_drafter_forward_by_its_share_of_layers(tmp_path):
    """Eager PyTorch pays its host cost per layer: a 1-layer EAGLE head's forward overhead is 1/L of the
    target's (the engine measures c ~ 0.06-0.1 on SmolLM2, not the ~0.7 of equal per-forward overheads)."""
    run, prof = _run(tmp_path, "s")
    eff = fit_cpu_efficiency(run, cpu_profile=prof, prompt_tokens=57)["efficiency"]
    assert eff.step_overhead_s > 0
    assert eff.draft_overhead_s == pytest.approx(eff.step_overhead_s / get_model("smollm2-135m").layers)


def test_a_run_without_logprob_forward_is_simulated_and_fitted_without_one(tmp_path):
    """A run whose learner folded the logprob forward into train (`logprob_skipped`) is simulated with a free
    logprob stage, and the fit prices a logprob forward (for other configs) at the train MFU, not at 0."""
    st = {"data": 0.001, "prepare": 0.03, "gen": 1.5, "logprob": 0.0005, "train": 4.0}
    run, prof = _run(tmp_path, "lean", stages=st, extra={"logprob_skipped": True})
    old, _ = _run(tmp_path, "old")
    assert predict_run(run, cpu_profile=prof)["simulation"]["ar"]["stages"]["logprob"] == 0.0
    assert predict_run(old, cpu_profile=prof)["simulation"]["ar"]["stages"]["logprob"] > 0.0
    eff = fit_cpu_efficiency(run, cpu_profile=prof, prompt_tokens=57)["efficiency"]
    assert 0 < eff.mfu_logprob == eff.mfu_train <= 1.0


def test_one_core_gets_its_measured_bandwidth_and_bandwidth_bound_attention_follows_it(tmp_path):
    """With the profile's one-thread bandwidth, a 1-core device streams that (not half of the 2-thread figure),
    and the trainer's separately priced attention (bandwidth-bound) slows by the bandwidth ratio, its GEMMs by
    the core ratio."""
    prof = dict(PROFILE, hbm_bandwidth_1thread=1.5e10)  # one of two cores streams 75 % of the bandwidth
    (tmp_path / "p.json").write_text(json.dumps(prof))
    hw = get_hardware("cpu", tmp_path / "p.json")
    one = with_threads(hw, 1)
    assert one.hbm_bandwidth == pytest.approx(1.5e10) and one.flops("bf16") == pytest.approx(2e11)
    assert with_threads(hw, 2).hbm_bandwidth == pytest.approx(2e10)  # never above what all threads measured
    run, _ = _run(tmp_path, "s", new_tokens=512, lengths=[300, 420, 380, 500, 260, 350, 450, 480])
    eff = Efficiency(mfu_logprob=0.5, mfu_train=0.5, mfu_attention=0.05)
    rec = run_records(run)
    cfg2 = config_for_run(read_run_config(run), rec, str(tmp_path / "p.json"), eff, prompt_tokens=60)
    cfg1 = replace(cfg2, cpu_threads=1)
    only_attn = replace(eff, mfu_logprob=1.0, mfu_attention=0.05)
    no_attn_cost = replace(eff, mfu_logprob=1.0, mfu_attention=1.0)
    lp = {}
    for name, c in (("2", cfg2), ("1", cfg1)):
        ctx = prepare(c)
        a = other_stages(replace(ctx, cfg=replace(c, efficiency=only_attn)), False)["logprob"]
        b = other_stages(replace(ctx, cfg=replace(c, efficiency=no_attn_cost)), False)["logprob"]
        lp[name] = (a - b) / (1 / 0.05 - 1)  # attention seconds at mfu_attention 1
    assert lp["1"] / lp["2"] == pytest.approx(2e10 / 1.5e10, rel=1e-6)  # bandwidth ratio, not the 2x core ratio


def _steps_run(tmp_path, name, per_step_lengths, mode="sync", threads=None, st=None, extra=None):
    """A run whose steps have their own response lengths (and torch_threads when given)."""
    run, prof = _run(tmp_path, name, mode=mode, new_tokens=512, stages=st, extra=extra)
    st = st or {"data": 0.001, "prepare": 0.03, "gen": 10.0, "logprob": 3.0, "train": 10.0}
    rows = []
    for i, lens in enumerate(per_step_lengths):
        r = {"step": i + 1, "stage_seconds": dict(st), "step_seconds": sum(st.values()),
             "response_length_mean": float(np.mean(lens)), "response_lengths": list(lens)}
        if threads is not None:
            r["torch_threads"] = threads[i]
        r.update(extra or {})
        rows.append(json.dumps(r))
    (run / "metrics.jsonl").write_text("\n".join(rows) + "\n")
    return run, prof


STEP_LENGTHS = [[100] * 8,  # warm-up step, not used
                [60, 80, 100, 120, 140, 160, 180, 400], [60, 80, 100, 120, 140, 160, 180, 512],
                [60, 80, 100, 120, 140, 160, 180, 300], [60, 80, 100, 120, 140, 160, 180, 296]]


def test_each_recorded_step_is_simulated_on_its_own_rollouts_and_the_median_compared(tmp_path):
    """Padding to a micro-batch's longest response and L² attention make a step's cost nonlinear in its lengths:
    the prediction is the median of per-step predictions, not one step of the pooled lengths' quantiles (whose
    longest is the pooled 15/16 quantile, here one of the 512s)."""
    run, prof = _steps_run(tmp_path, "steps", STEP_LENGTHS)
    out = predict_run(run, cpu_profile=prof, prompt_tokens=72)
    assert out["lengths"] == "per step" and len(out["per_step"]) == 4
    cfg = config_for_run(read_run_config(run), run_records(run), prof, prompt_tokens=72)
    each = []
    for lens in STEP_LENGTHS[1:]:
        wl = replace(cfg.workload, length_sample=tuple(float(x) for x in lens), length_in_order=True)
        each.append(simulate(replace(cfg, workload=wl))["ar"]["stages"]["train"])
    by = {r["stage"]: r for r in out["rows"]}
    assert by["train"]["predicted"] == pytest.approx(float(np.median(each)))
    pooled = simulate(cfg)["ar"]["stages"]["train"]  # the old way: one step of the pooled quantiles (max 300)
    assert abs(pooled / by["train"]["predicted"] - 1) > 0.1
    # a step without its lengths: back to the pooled workload
    rows = [r.to_json() for r in run_records(run)]
    rows[2].pop("response_lengths")
    (run / "metrics.jsonl").write_text("\n".join(json.dumps(r) for r in rows) + "\n")
    assert predict_run(run, cpu_profile=prof, prompt_tokens=72)["lengths"] == "pooled"


def test_in_order_lengths_need_exactly_the_steps_rollouts():
    wl = Workload(prompts_per_step=1, generations_per_prompt=4, max_response_tokens=100,
                  length_sample=(5.0, 300.0, 7.0, 9.0), length_in_order=True)
    assert list(wl.response_lengths()) == [5.0, 100.0, 7.0, 9.0]  # rollout order kept, cut at the cap
    with pytest.raises(SpecRLError, match=r"length_in_order.*exactly.*\b4 rollouts"):
        Workload(prompts_per_step=1, generations_per_prompt=4, length_sample=(5.0, 6.0), length_in_order=True)
    with pytest.raises(SpecRLError, match="got none"):
        Workload(prompts_per_step=1, generations_per_prompt=4, length_in_order=True)


def test_sync_run_is_simulated_on_its_recorded_torch_threads_per_step(tmp_path):
    two, prof = _steps_run(tmp_path, "two", [[50] * 8] * 4, threads=[2, 2, 2, 2])
    one, _ = _steps_run(tmp_path, "one", [[50] * 8] * 4, threads=[1, 1, 1, 1])
    mixed, _ = _steps_run(tmp_path, "mixed", [[50] * 8] * 4, threads=[2, 1, 1, 1])
    p = {n: predict_run(r, cpu_profile=prof, prompt_tokens=60) for n, r in (("2", two), ("1", one), ("m", mixed))}
    train = {n: {r["stage"]: r["predicted"] for r in x["rows"]}["train"] for n, x in p.items()}
    assert train["1"] == pytest.approx(2 * train["2"], rel=1e-6)  # the profile has no one-thread bandwidth
    assert train["m"] == pytest.approx(train["1"])  # steps 2-4 ran on one core (step 1 is warm-up)
    assert p["1"]["threads"]["generation"] == 1 and p["2"]["threads"]["generation"] == 2
    assert any("hbm_bandwidth_1thread" in n for n in p["1"]["notes"])
    # --threads overrides the record, and says so; a run without the record is noted too
    over = predict_run(two, cpu_profile=prof, prompt_tokens=60, threads=1)
    assert {r["stage"]: r["predicted"] for r in over["rows"]}["train"] == pytest.approx(train["1"])
    assert over["threads"]["generation"] == 1
    assert any(re.search(r"--threads 1\b.*torch_threads \[2\]", n) for n in over["notes"])
    bare, _ = _run(tmp_path, "bare")
    assert any("did not record torch_threads" in n for n in predict_run(bare, cpu_profile=prof)["notes"])
    res = runner.invoke(app, ["--from-run", str(two), "--cpu-profile", prof, "--threads", "1"])
    assert res.exit_code == 0 and "note: --threads 1 overrides" in res.output


def test_bad_recorded_threads_and_actor_sizes_are_clear_errors(tmp_path):
    run, prof = _steps_run(tmp_path, "bad", [[50] * 8] * 3, threads=[2, 0, 2])
    with pytest.raises(SpecRLError, match="step 2 has torch_threads=0"):
        predict_run(run, cpu_profile=prof)
    run, _ = _steps_run(tmp_path, "some", [[50] * 8] * 3, threads=[2, None, 2])
    with pytest.raises(SpecRLError, match="in every step"):
        predict_run(run, cpu_profile=prof)
    for key, val in (("learner_threads", "0"), ("worker_threads", "two")):
        arun, _ = _run(tmp_path / key, "a", mode="async")
        text = (arun / "config.yaml").read_text()
        (arun / "config.yaml").write_text(text.replace(f"{key}: 1", f"{key}: {val}"))
        with pytest.raises(SpecRLError, match=f"{key}=.*{val}.*integer >= 1"):
            predict_run(arun, cpu_profile=prof)
    with pytest.raises(SpecRLError, match=r"--threads 0\b.*integer >= 1"):
        predict_run(_run(tmp_path / "t", "s")[0], cpu_profile=prof, threads=0)

"""The data-parallel learner (learner.world_size > 1): bad input, N=1 vs N=2 equivalence, pipelines, resume
across world sizes, a killed rank. Ranks are Ray actors on one local Ray (loopback, gloo, one thread each)."""

import os
import signal
import time
from pathlib import Path

import pytest
import ray
import torch
import yaml

from specrl.algorithms.rollouts import Rollouts
from specrl.errors import SpecRLError
from specrl.model.hf_checkpoint import hf_named_tensors
from specrl.model.loader import load_model
from specrl.parallel.data_parallel import merge_rank_records
from specrl.trainer.config_check import load_config, validate_config
from specrl.trainer.learner import Learner
from specrl.trainer.sync_trainer import seed_everything
from tests.test_rl_trainer import cfg_dict
from tests.tiny import make_tiny_checkpoint

# `make test` runs this module alone, after its parallel part:
# it starts a local Ray and learner ranks that meet in gloo process groups.
pytestmark = pytest.mark.serial

SECONDS = {"data": 0.0, "prepare": 0.0, "gen": 0.0}


@pytest.fixture(scope="module")
def tiny(tmp_path_factory) -> Path:
    return make_tiny_checkpoint(tmp_path_factory.mktemp("tiny") / "ckpt", seed=0)


def dp_cfg(tiny, world_size=2, **over):
    base = {"speculative__drafter": "none", "learner__world_size": world_size, "learner__collective_timeout_s": 20.0,
            "grpo__num_prompts_per_step": 2, "grpo__num_generations": 4, "policy__train_micro_batch_size": 2}
    return validate_config(cfg_dict(tiny, **{**base, **over}))


def seeded_rollouts(n=8, group=4, seed=1) -> Rollouts:
    """A fixed batch: random prompt/response tokens of varied lengths, rewards varying within each group."""
    g = torch.Generator().manual_seed(seed)
    prompts = [torch.randint(3, 128, (int(torch.randint(3, 9, (1,), generator=g)),), generator=g).tolist()
               for _ in range(n)]
    responses = [torch.randint(3, 128, (int(torch.randint(1, 7, (1,), generator=g)),), generator=g).tolist()
                 for _ in range(n)]
    return Rollouts(problem_indices=[i // group for i in range(n)], prompts=prompts, responses=responses,
                    gen_logprobs=[[-2.0] * len(x) for x in responses], finish_reasons=["stop"] * n,
                    rewards=torch.rand(n, generator=g), correct=[False] * n, formatted=[None] * n,
                    policy_versions=[0] * n, request_ids=list(range(n)))


# ---------------------------------------------------------------------------------------------- bad input
def test_bad_world_sizes_are_clear_errors(tiny, tmp_path):
    from specrl.cluster.learner_group import LearnerGroup
    from specrl.run.loop import sync_trainer

    with pytest.raises(SpecRLError, match="learner.world_size"):
        load_config(None, [f"model.name={tiny}", "learner.world_size=0"])
    with pytest.raises(SpecRLError, match=r"world_size \(3\).*num_prompts_per_step \(2\)"):
        dp_cfg(tiny, world_size=3)
    with pytest.raises(SpecRLError, match="learner.collective_timeout_s"):
        load_config(None, [f"model.name={tiny}", "learner.collective_timeout_s=0"])
    assert not ray.is_initialized()
    with pytest.raises(SpecRLError, match=r"128 CPUs.*may use"):
        LearnerGroup(dp_cfg(tiny, learner__threads=64))
    assert not ray.is_initialized()  # refused before starting anything
    with pytest.raises(SpecRLError, match=r"LearnerGroup.*world_size >= 2"):
        LearnerGroup(dp_cfg(tiny, world_size=1))
    with pytest.raises(SpecRLError, match="make_trainer=specrl.cluster.make_trainer"):
        sync_trainer(dp_cfg(tiny), tmp_path)


def test_merge_rank_records_weights_token_means_by_tokens():
    from specrl.observability.step_record import StepRecord

    base = {"step": 1, "loss": 0.0, "clip_fraction": 0.0, "kl": None, "ratio_mean": 1.0, "is_ratio_mean": None,
            "is_clipped_fraction": None, "is_ratio_max": None, "draft_loss": 0.0, "token_mult_prob_error": 1.0,
            "stage_seconds": {"data": 1.0, "prepare": 0.0, "gen": 2.0, "logprob": 0.5, "train": 1.0}}
    a = {**base, "loss": 0.6, "clip_fraction": 0.5, "draft_loss": 2.0, "rank_tokens": 30.0}
    b = {**base, "loss": 0.2, "clip_fraction": 0.0, "draft_loss": 4.0, "rank_tokens": 10.0,
         "stage_seconds": {**base["stage_seconds"], "train": 3.0}}
    rec = merge_rank_records([StepRecord.from_json(a), StepRecord.from_json(b)])
    assert rec["loss"] == pytest.approx(0.4)  # each rank normalised by global tokens / 2
    assert rec["clip_fraction"] == pytest.approx(0.375)  # (0.5 * 30 + 0) / 40
    assert rec["draft_loss"] == pytest.approx(3.0) and rec["kl"] is None
    assert rec["stage_seconds"]["train"] == 3.0 and rec["step_seconds"] == pytest.approx(6.5)
    assert "rank_tokens" not in rec


# ---------------------------------------------------------------------------------------------- with Ray
def single_learner(cfg) -> Learner:
    seed_everything(cfg.run.seed)
    policy, _ = load_model(cfg.model.name, dtype=torch.float32)
    return Learner(cfg, policy.train())


def test_one_step_n1_equals_n2(tiny, local_ray):
    """Same seeded batch, fp32, one step: N=2 gives N=1's loss and updated weights.

    Tolerance: the two runs add the same fp32 terms in a different order (per-rank sums then FSDP's
    reduce-scatter average, and the global norm from per-shard norms), so gradients differ by a few ulp
    (~1e-7 relative) and the AdamW update (lr 1e-3) moves weights by ~1e-3: differences stay below 1e-6 of the
    weights' scale. The loss is summed from the same per-token terms: relative 1e-5.
    """
    from specrl.cluster.learner_group import LearnerGroup

    cfg = dp_cfg(tiny)
    r = seeded_rollouts()
    one = single_learner(cfg)
    before = {k: v.clone() for k, v in hf_named_tensors(one.policy).items()}
    rec1 = one.learn(r, dict(SECONDS))
    w1 = hf_named_tensors(one.policy)
    group = LearnerGroup(cfg)
    try:
        version, w2, drafter = group.named_weights()
        assert version == 0 and drafter is None
        assert all(torch.equal(w2[k], before[k]) for k in before)  # every rank starts from the same weights
        rec2 = group.learn(r, dict(SECONDS))
        version, w2, _ = group.named_weights()
    finally:
        group.close()
    assert version == 1 and group.version == 1 and set(w2) == set(w1)
    scale = max(float(v.abs().max()) for v in w1.values())
    moved = max(float((w1[k] - before[k]).abs().max()) for k in w1)
    diff = max(float((w1[k] - w2[k]).abs().max()) for k in w1)
    assert moved > 1e-4  # the step changed the weights
    print(f"one step N=1 vs N=2: max |weight diff| {diff:.2e}, max |w| {scale:.3f}, moved {moved:.2e}")
    assert diff <= 1e-6 * scale, (diff, scale)
    assert rec2["loss"] == pytest.approx(rec1["loss"], rel=1e-5, abs=1e-7)
    assert rec2["grad_norm"] == pytest.approx(rec1["grad_norm"], rel=1e-5)
    for key in ("reward_mean", "response_length_mean", "step", "lr"):
        assert rec2[key] == rec1[key], key
    for key in ("clip_fraction", "ratio_mean", "token_mult_prob_error"):
        assert rec2[key] == pytest.approx(rec1[key], rel=1e-5), key


def run_cfg(tiny, tmp_path, name, **over) -> Path:
    reward = tmp_path / "varied.py"  # the random tiny model never solves a task: a reward that varies per sample
    reward.write_text("def varied(prompt, completion, row):\n    return float(sum(map(ord, completion)) % 7)\n")
    d = cfg_dict(tiny, **{"speculative__drafter": "none", "learner__world_size": 2, "grpo__val_every": 0,
                          "learner__collective_timeout_s": 20.0, "run__name": name,
                          "reward__functions": [f"{reward}:varied"], **over})
    path = tmp_path / f"{name}.yaml"
    path.write_text(yaml.safe_dump(d))
    return path


def metrics(run: Path) -> list[dict]:
    from specrl.observability.metrics import read_jsonl

    return read_jsonl(run / "metrics.jsonl")


def test_sync_pipeline_world_size_2_learns_like_1_and_exports_hf(tiny, tmp_path, local_ray):
    """3 steps of the sync pipeline with 2 ranks: DCP checkpoints, an HF export transformers loads, and the
    same step-1 record as 1 rank (identical rollouts from identical weights)."""
    from transformers import AutoModelForCausalLM

    from specrl.checkpoint.sharded_state import DCP_PART
    from specrl.checkpoint.store import load_latest
    from specrl.cluster import make_trainer
    from specrl.run.loop import train_main

    two = train_main(str(run_cfg(tiny, tmp_path, "two")), [], None, str(tmp_path / "two"), make_trainer=make_trainer)
    one = train_main(str(run_cfg(tiny, tmp_path, "one", learner__world_size=1)), [], None, str(tmp_path / "one"))
    m2, m1 = metrics(two), metrics(one)
    assert [r["step"] for r in m2] == [1, 2, 3]
    assert m2[0]["reward_mean"] == m1[0]["reward_mean"] and m1[0]["reward_std"] > 0
    assert m2[0]["loss"] == pytest.approx(m1[0]["loss"], rel=1e-5, abs=1e-7)
    ck = load_latest(two / "checkpoints")
    assert ck.step == 3 and (ck.parts[DCP_PART] / ".metadata").is_file() and "policy" not in ck.parts
    final2, _ = load_model(two / "final", dtype=torch.float32)
    final1, _ = load_model(one / "final", dtype=torch.float32)
    hf = AutoModelForCausalLM.from_pretrained(str(two / "final"))
    assert torch.equal(hf.model.embed_tokens.weight.detach(), final2.embed_tokens.weight.detach())
    w1, w2 = hf_named_tensors(final1), hf_named_tensors(final2)
    scale = max(float(v.abs().max()) for v in w1.values())
    print("3-step final weight max |diff| / scale:", max(float((w1[k] - w2[k]).abs().max()) for k in w1) / scale,
          "rewards N=1", [r["reward_mean"] for r in m1], "N=2", [r["reward_mean"] for r in m2])
    assert all(torch.allclose(w1[k], w2[k], rtol=0, atol=1e-5 * scale) for k in w1)


def test_resume_across_world_sizes(tiny, tmp_path, local_ray):
    """A 2-rank checkpoint resumes on 1 rank and a 1-rank checkpoint on 2 (one format, DCP, for every world size),
    bit-exact weights; the optimizer state comes along (the next step matches an uninterrupted learner's)."""
    from specrl.checkpoint.store import load_latest
    from specrl.cluster import make_trainer
    from specrl.cluster.learner_group import LearnerGroup
    from specrl.run.loop import train_main
    from specrl.trainer.sync_trainer import GRPOTrainer

    two = train_main(str(run_cfg(tiny, tmp_path, "two", run__steps=2)), [], None, str(tmp_path / "two"),
                     make_trainer=make_trainer)
    one = train_main(str(run_cfg(tiny, tmp_path, "one", run__steps=2, learner__world_size=1)), [], None,
                     str(tmp_path / "one"))
    r = seeded_rollouts()
    r.policy_versions = [2] * len(r.prompts)
    # 2 -> 1: the single-process trainer reads the DCP directory
    t = GRPOTrainer.from_config(load_config(str(two / "config.yaml"), ["learner.world_size=1"]))
    t.load_parts(load_latest(two / "checkpoints").parts)
    exported, _ = load_model(two / "final", dtype=torch.float32)
    assert all(torch.equal(v, hf_named_tensors(exported)[k]) for k, v in hf_named_tensors(t.policy).items())
    assert t.step_count == 2 and len(t.learner.optimizer.state) > 0
    # 1 -> 2: the ranks read the single process's DCP directory (DCP reshards it)
    ck = load_latest(one / "checkpoints")
    group = LearnerGroup(load_config(str(one / "config.yaml"), ["learner.world_size=2"]))
    try:
        group.load_parts(ck.parts, ck.parts["trainer"])
        _, w, _ = group.named_weights()
        exported, _ = load_model(one / "final", dtype=torch.float32)
        assert all(torch.equal(v, w[k]) for k, v in hf_named_tensors(exported).items())
        rec2 = group.learn(r, dict(SECONDS))
        _, w2, _ = group.named_weights()
    finally:
        group.close()
    single = GRPOTrainer.from_config(load_config(str(one / "config.yaml")))
    single.load_parts(load_latest(one / "checkpoints").parts)
    rec1 = single.learner.learn(r, dict(SECONDS))
    w1 = hf_named_tensors(single.policy)
    scale = max(float(v.abs().max()) for v in w1.values())
    assert rec2["step"] == rec1["step"] == 3 and rec2["lr"] == rec1["lr"]
    assert all(torch.allclose(w1[k], w2[k], rtol=0, atol=1e-6 * scale) for k in w1)
    # and through the CLI: the 2-rank run continues on 1 rank to step 3
    train_main(None, ["learner.world_size=1", "run.steps=3"], str(two), None)
    assert [m["step"] for m in metrics(two)] == [1, 2, 3]


def test_killed_rank_stops_the_run_with_the_last_checkpoint_and_resume(tiny, tmp_path, local_ray):
    """SIGKILL of rank 1 as step 2's learner stage starts: rank 0's collective times out, the run stops naming
    step 1's checkpoint and the resume command, and the resumed run finishes."""
    from specrl.checkpoint.store import list_checkpoints
    from specrl.cluster import make_trainer
    from specrl.run.loop import train_main

    def killing_trainer(cfg, run_dir):
        t = make_trainer(cfg, run_dir)
        learn = t.learner.learn

        def learn_then_kill(r, seconds):
            if t.learner.step_count == 1:
                os.kill(t.learner.pids[1], signal.SIGKILL)
            return learn(r, seconds)

        t.learner.learn = learn_then_kill
        return t

    cfg = run_cfg(tiny, tmp_path, "kill", learner__collective_timeout_s=5.0)
    t0 = time.monotonic()
    with pytest.raises(SpecRLError) as e:
        train_main(str(cfg), [], None, str(tmp_path / "kill"), make_trainer=killing_trainer)
    # bounded by the 5 s collective timeout, not a hang until gloo's default of 30 minutes: a loose bound, so a slow
    # or busy machine cannot fail it
    assert time.monotonic() - t0 < 300.0
    msg = str(e.value)
    assert "learner rank 1 died" in msg and "step_000001" in msg, msg
    assert f"specrl train --resume {tmp_path / 'kill'}" in msg
    assert [s for s, _ in list_checkpoints(tmp_path / "kill" / "checkpoints")] == [1]
    assert not any(p.name.startswith(".tmp") for p in (tmp_path / "kill" / "checkpoints").iterdir())
    train_main(None, [], str(tmp_path / "kill"), None, make_trainer=make_trainer)
    assert [m["step"] for m in metrics(tmp_path / "kill")] == [1, 2, 3]


def test_async_pipeline_world_size_2(tiny, tmp_path, local_ray):
    from specrl.cluster import make_trainer
    from specrl.run.loop import train_main

    cfg = run_cfg(tiny, tmp_path, "async", pipeline__mode="async", pipeline__max_trajectory_age_steps=0)
    run = train_main(str(cfg), [], None, str(tmp_path / "async"), make_trainer=make_trainer)
    m = metrics(run)
    assert [r["step"] for r in m] == [1, 2, 3] and all(r["trajectory_age_max"] == 0 for r in m)
    assert (run / "final" / "model.safetensors").is_file()


def test_scaling_benchmark_runs_on_a_tiny_setting(tiny, tmp_path, local_ray):
    """benchmarks/learner_scaling.py end to end (bf16-mixed from examples/short.yaml: the ranks' FSDP
    MixedPrecisionPolicy path), one repeat; the record names the machine and dtypes."""
    import sys

    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
    from learner_scaling import main

    try:
        rec = main(["--model", str(tiny), "--repeats", "1", "--response-tokens", "4", "--out",
                    str(tmp_path / "s.json")])
    finally:
        torch.set_num_threads(1)
    from specrl.device import processor_class, resolve_precision

    assert rec["precision"] == resolve_precision("auto", "cpu")  # default.yaml: auto (this processor's)
    assert rec["ranks"]["ranks"] == 2 and rec["single"]["threads"] == 2
    assert rec["hardware"]["cpu_cores"] >= 1 and rec["hardware"]["processor_class"] == processor_class()
    assert rec["single"]["seconds_median"] > 0 and rec["ranks"]["seconds_median"] > 0
    assert (tmp_path / "s.json").is_file()


def _eagle_dir(tiny, tmp_path) -> str:
    """A freshly initialised EAGLE head of the tiny model, saved where `eagle:DIR` loads it."""
    from specrl.drafters import EagleDrafter
    from specrl.drafters.storage.io import save_drafter

    target, _ = load_model(str(tiny), dtype=torch.float32)
    torch.manual_seed(5)
    return str(save_drafter(EagleDrafter(target), tmp_path / "eagle"))


def _odd_groups(n_groups=3, group=4, seed=2) -> Rollouts:
    """What dynamic sampling can hand the learner: a group count (3) that the world size (2) does not divide."""
    r = seeded_rollouts(n=n_groups * group, group=group, seed=seed)
    r.rewards[::group] += 1.0  # every group's rewards vary
    return r


@pytest.mark.parametrize("case", ["mini_batches", "online_drafter", "odd_groups", "bf16"])
def test_one_step_n1_equals_n2_beyond_the_plain_point(tiny, tmp_path, local_ray, case):
    """N=2 gives N=1's step at each documented point beyond plain dapo/fp32/one mini-batch: two mini-batches x two
    iterations (four optimizer steps), the online drafter over two mini-batches (its loss and weights too: it
    reads the policy's embedding as updated by the first), a group count that the world
    size does not divide (dynamic sampling), and bf16-mixed (where FSDP's MixedPrecisionPolicy casts what autocast
    keeps in fp32: the bound is measured and stated in docs/scale-out.md)."""
    from specrl.cluster.learner_group import LearnerGroup

    over = {"mini_batches": {"grpo__mini_batches": 2, "grpo__num_iterations": 2},
            "online_drafter": {"speculative__drafter": f"eagle:{_eagle_dir(tiny, tmp_path)}", "drafter__online": True,
                               "drafter__learning_rate": 1e-3, "grpo__mini_batches": 2},
            "odd_groups": {"grpo__num_prompts_per_step": 4, "grpo__filter_zero_advantage_groups": True},
            "bf16": {"policy__precision": "bf16-mixed"}}[case]
    cfg = dp_cfg(tiny, **over)
    r = _odd_groups() if case == "odd_groups" else seeded_rollouts()
    if case == "online_drafter":
        from specrl.drafters.storage.io import load_drafter

        seed_everything(cfg.run.seed)
        policy = load_model(cfg.model.name, dtype=torch.float32)[0].train()
        one = Learner(cfg, policy, load_drafter(cfg.speculative.drafter.split(":", 1)[1], policy))
    else:
        one = single_learner(cfg)
    before = {k: v.clone() for k, v in hf_named_tensors(one.policy).items()}
    rec1 = one.learn(r, dict(SECONDS))
    w1 = hf_named_tensors(one.policy)
    d1 = {k: v.detach().clone() for k, v in one.drafter.state_dict().items()} if one.drafter is not None else None
    group = LearnerGroup(cfg)
    try:
        rec2 = group.learn(r, dict(SECONDS))
        _, w2, d2 = group.named_weights()
        if case == "online_drafter":  # the ranks' DCP checkpoint holds both optimizers: read it in one process
            from specrl.checkpoint.sharded_state import DCP_PART, load_dcp

            group.state_parts()[DCP_PART].write_dir(tmp_path / "dcp")
            seed_everything(cfg.run.seed)
            policy = load_model(cfg.model.name, dtype=torch.float32)[0].train()
            back = Learner(cfg, policy, load_drafter(cfg.speculative.drafter.split(":", 1)[1], policy))
            load_dcp(tmp_path / "dcp", back.policy, back.drafter, back.optimizers)
            for mine, theirs, m1, m2 in ((one.optimizer, back.optimizer, one.policy, back.policy),
                                         (one.drafter_trainer.optimizer, back.drafter_trainer.optimizer,
                                          one.drafter, back.drafter)):
                for p, q in zip(m1.parameters(), m2.parameters(), strict=True):
                    assert int(theirs.state[q]["step"]) == int(mine.state[p]["step"]) > 0
                    assert torch.allclose(theirs.state[q]["exp_avg"], mine.state[p]["exp_avg"], atol=1e-7)
    finally:
        group.close()
    scale = max(float(v.abs().max()) for v in w1.values())
    moved = max(float((w1[k] - before[k]).abs().max()) for k in w1)
    diff = max(float((w1[k] - w2[k]).abs().max()) for k in w1)
    # the update's relative L2 difference: AdamW's sign-like first step makes max |diff| the size of the step
    # wherever rounding flips a near-zero gradient, so the norm says how much of the update moved
    upd = sum(float(((w1[k] - before[k]).double() ** 2).sum()) for k in w1) ** 0.5
    rel = sum(float(((w1[k] - w2[k]).double() ** 2).sum()) for k in w1) ** 0.5 / upd
    print(f"{case}: N=1 vs N=2 max |weight diff| {diff:.2e} (moved {moved:.2e}, max |w| {scale:.3f}), update "
          f"L2 difference {rel:.2e} of the update; loss {rec1['loss']:.6g} vs {rec2['loss']:.6g}")
    assert moved > 1e-4
    if case == "bf16":
        # bf16 rounds the update itself: measure N=1's and N=2's distance to the fp32 update of one process
        ref = single_learner(dp_cfg(tiny, policy__precision="fp32"))
        ref.learn(r, dict(SECONDS))
        w0 = hf_named_tensors(ref.policy)

        def off(w):
            return sum(float(((w[k] - w0[k]).double() ** 2).sum()) for k in w0) ** 0.5 / upd

        print(f"bf16: update L2 distance to fp32's: N=1 (autocast) {off(w1):.3f}, N=2 (MixedPrecisionPolicy) "
              f"{off(w2):.3f}")
        assert off(w2) <= 1.5 * off(w1) + 0.05, (off(w1), off(w2))
    else:
        assert diff <= 1e-6 * scale, (diff, scale)
    assert rec2["loss"] == pytest.approx(rec1["loss"], rel=1e-2 if case == "bf16" else 1e-5, abs=1e-7)
    assert rec2["optimizer_steps"] == rec1["optimizer_steps"]
    if case == "online_drafter":
        assert d2 is not None and set(d2) == set(d1)
        ddiff = max(float((d1[k] - d2[k]).abs().max()) for k in d1)
        assert ddiff <= 1e-6 * max(float(v.abs().max()) for v in d1.values()), ddiff
        assert rec2["draft_loss"] == pytest.approx(rec1["draft_loss"], rel=1e-5)


def test_the_async_learner_actor_holds_no_policy_when_ranks_own_it_and_publishes_one_copy(tiny, local_ray):
    """With learner.world_size 2 the async pipeline's LearnerActor only coordinates: it loads no weights, and a
    publish hands it a reference to what rank 0 gathered and cast (bf16 here), never the tensors themselves."""
    from specrl.cluster.actors import LearnerActor, WeightStore

    cfg = dp_cfg(tiny, pipeline__mode="async", pipeline__max_trajectory_age_steps=0, model__rollout_dtype="bfloat16")
    store = WeightStore.remote()
    actor = LearnerActor.remote(cfg.model_dump(mode="json"), 1, store)
    try:
        assert ray.get(actor.ready.remote())[1] is None
        assert ray.get(actor.resident_parameters.remote()) == 0
        version, _, _ = ray.get(actor.publish.remote())
        live, refs = ray.get(store.latest.remote())
        policy, drafter = ray.get(refs[0])
        assert live == version == 0 and drafter is None
        want = hf_named_tensors(load_model(str(tiny), dtype=torch.float32)[0])
        assert set(policy) == set(want)
        assert all(policy[k].dtype == torch.bfloat16 and torch.equal(policy[k], want[k].to(torch.bfloat16))
                   for k in want)
    finally:
        ray.kill(actor)

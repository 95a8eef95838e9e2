"""The async pipeline on Ray: lag 0 equals sync, lag 1 overlaps with IS against the generating version, nothing
is lost or trained twice (also when a rollout worker is killed), resume after the driver is killed, bad input."""

import json
import os
import re
import subprocess
import sys
import time
from pathlib import Path

import pytest
import ray
import torch
import yaml

from specrl.errors import SpecRLError
from specrl.observability.metrics import read_jsonl
from specrl.run.loop import train_main
from specrl.trainer.config_check import validate_config
from specrl.trainer.sync_trainer import GRPOTrainer
from tests.faults import subprocess_code
from tests.test_rl_trainer import cfg_dict
from tests.tiny import make_tiny_checkpoint

# `make test` runs this module alone, after its parallel part:
# it starts a local Ray and async pipelines of several processes.
pytestmark = pytest.mark.serial

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def tiny(tmp_path_factory) -> Path:
    return make_tiny_checkpoint(tmp_path_factory.mktemp("tiny") / "ckpt", seed=0)


def test_async_bad_input(tiny, tmp_path):
    """(First in this file: it needs Ray not started yet.)"""
    from specrl.cluster import make_trainer

    with pytest.raises(SpecRLError, match="must be >= 0"):
        validate_config(async_cfg(tiny, lag=-1))
    bad = async_cfg(tiny, lag=1)
    bad["grpo"]["importance_sampling_correction"] = False
    with pytest.raises(SpecRLError, match="pipeline.max_trajectory_age_steps=1 .* grpo.importance_sampling_correction"):
        validate_config(bad)
    many = validate_config(async_cfg(tiny, lag=0, workers=64))
    with pytest.raises(SpecRLError, match=r"\b64 rollout.*\b65 CPUs"):
        make_trainer(many, tmp_path / "a")
    nowhere = validate_config(async_cfg(tiny, lag=0, pipeline__ray_address="127.0.0.1:1"))
    with pytest.raises(SpecRLError, match=r"ray_address='127.*1:1'.*connect"):
        make_trainer(nowhere, tmp_path / "b")
    assert not ray.is_initialized()
    exact = validate_config(async_cfg(tiny, lag=0))
    from specrl.run.loop import sync_trainer

    with pytest.raises(SpecRLError, match=r"mode='async' runs on Ray"):
        sync_trainer(exact, tmp_path / "c")
    with pytest.raises(SpecRLError, match=r"compare.*mode='async'.*mode=sync"):
        cfgf = tmp_path / "c.yaml"
        cfgf.write_text(yaml.safe_dump(async_cfg(tiny, lag=0)))
        train_main(str(cfgf), [], None, str(tmp_path / "cmp"), True)


def async_cfg(tiny, lag=1, workers=1, **over):
    base = {"speculative__drafter": "ngram", "speculative__num_draft_tokens": 2, "pipeline__mode": "async",
            "pipeline__max_trajectory_age_steps": lag, "pipeline__num_rollout_workers": workers,
            "grpo__importance_sampling_correction": lag > 0}
    return cfg_dict(tiny, **{**base, **over})


def learner_policy(t):
    """The learner actor's policy state dict (its checkpoint part holds the live modules; here, a copy of them)."""
    from specrl.checkpoint.sharded_state import DCP_PART

    return ray.get(t.learner.state_parts.remote())[DCP_PART].policy.state_dict()


@pytest.mark.parametrize("workers", [1, 2])
def test_async_lag0_equals_sync(tiny, tmp_path, local_ray, workers):
    from specrl.cluster.async_trainer import AsyncGRPOTrainer

    sync = GRPOTrainer.from_config(validate_config(cfg_dict(tiny, speculative__drafter="ngram",
                                                            speculative__num_draft_tokens=2)))
    a = AsyncGRPOTrainer(validate_config(async_cfg(tiny, lag=0, workers=workers)), tmp_path / "run")
    try:
        for step in range(1, 4):
            rs, ra = sync.step(), a.step()
            assert a.last_rollouts.responses == sync.last_rollouts.responses, step
            assert a.last_rollouts.request_ids == list(range((step - 1) * 8, step * 8))
            pol = learner_policy(a)
            assert all(torch.equal(pol[k], v) for k, v in sync.policy.state_dict().items()), step
            assert ra["reward_mean"] == rs["reward_mean"] and ra["trajectory_age_max"] == 0
            assert ra["acceptance_length"] == pytest.approx(rs["acceptance_length"]) or workers > 1
    finally:
        a.close()


def test_async_dynamic_sampling_and_two_iterations_equal_sync(tiny, tmp_path, local_ray):
    """Dynamic sampling on the async driver (extra groups split over 2 workers) and mu = 2: at lag 0 the run is
    the sync run, extra prompts, ids, counts and weights included."""
    from specrl.cluster.async_trainer import AsyncGRPOTrainer

    fn = tmp_path / "reward.py"
    fn.write_text("def reward(prompt, completion, row):\n"  # constant for half the prompts
                  "    if sum(map(ord, prompt)) % 2:\n"
                  "        return 0.5\n"
                  "    return float(sum(map(ord, completion)) % 3 == 0)\n")
    over = {"reward__functions": [f"{fn}:reward"], "grpo__filter_zero_advantage_groups": True,
            "grpo__max_extra_prompt_draws": 4, "grpo__num_iterations": 2}
    sync = GRPOTrainer.from_config(validate_config(cfg_dict(tiny, speculative__drafter="ngram",
                                                            speculative__num_draft_tokens=2, **over)))
    a = AsyncGRPOTrainer(validate_config(async_cfg(tiny, lag=0, workers=2, **over)), tmp_path / "run")
    try:
        drawn = 0
        for step in range(1, 3):
            rs, ra = sync.step(), a.step()
            assert a.last_rollouts.request_ids == sync.last_rollouts.request_ids, step
            assert a.last_rollouts.responses == sync.last_rollouts.responses, step
            for k in ("groups_trained", "groups_filtered", "extra_prompts_drawn", "optimizer_steps"):
                assert ra[k] == rs[k], (step, k)
            pol = learner_policy(a)
            assert all(torch.equal(pol[k], v) for k, v in sync.policy.state_dict().items()), step
            drawn += ra["extra_prompts_drawn"]
        assert drawn > 0
    finally:
        a.close()


def test_async_lag1_overlaps_and_records(tiny, tmp_path, local_ray):
    from specrl.cluster.async_trainer import AsyncGRPOTrainer

    a = AsyncGRPOTrainer(validate_config(async_cfg(tiny, lag=1)), tmp_path / "run")
    try:
        recs = [a.step() for _ in range(3)]
    finally:
        a.close()
    assert [r["step"] for r in recs] == [1, 2, 3]
    # step 1 must come from version 0; later steps from version >= step - 2 (the lag bound)
    for r in recs:
        assert all(v >= r["step"] - 2 for v in r["group_policy_versions"]) and r["trajectory_age_max"] <= 1
        assert r["trained_samples"] == 8 and r["is_ratio_mean"] is not None
        for key in ("exposed_gen_seconds", "learner_idle_ratio", "refit_seconds", "dropped_stale_groups"):
            assert r[key] is not None, key
    events = [json.loads(line) for line in (tmp_path / "run" / "timeline.jsonl").read_text().splitlines()]
    assert {e["kind"] for e in events} >= {"gen", "refit", "train", "logprob", "publish"}
    assert {e["lane"] for e in events} == {"worker 0", "learner"}
    from specrl.observability.run_report import async_summary, write_report

    report = write_report(tmp_path / "run", recs).read_text()
    a = async_summary(recs)
    assert a is not None and a["trajectory_age_max"] == max(r["trajectory_age_max"] for r in recs)
    assert a["dropped_stale_groups"] == sum(r["dropped_stale_groups"] for r in recs)
    assert "## Async pipeline" in report
    assert re.search(rf"\| trajectory age\b.* / {a['trajectory_age_max']} \|", report)
    assert (tmp_path / "run" / "timeline.png").exists()


def test_is_ratio_against_the_generating_version(tiny):
    """Two known policy versions: rollouts generated by version A, learner at version B (lag 1). The importance
    weights are exp(logp_B - logp_A) per token, i.e. against the version that generated each token."""
    from specrl.backends.registry import build_backend
    from specrl.model.loader import load_model
    from specrl.model.tokenizer import stop_token_ids
    from specrl.trainer.learner import Learner
    from specrl.trainer.producer import RolloutProducer

    cfg = validate_config(async_cfg(tiny, lag=1, generation__temperature=1.0))
    a, tok = load_model(cfg.model.name, dtype=torch.float32)
    b, _ = load_model(cfg.model.name, dtype=torch.float32)
    with torch.no_grad():
        for p in b.parameters():
            p.add_(0.02 * torch.randn_like(p))
    backend = build_backend(cfg, a)  # version 0 = A
    producer = RolloutProducer(cfg, tok, backend, stop_token_ids(tok, a.args))
    r = producer.stage_gen(1, producer.stage_data())
    assert r.policy_version == 0
    learner = Learner(cfg, b, max_policy_lag=1)
    learner.step_count = 1  # B is version 1: the rollouts are one version behind
    from specrl.algorithms.batch import collate

    batch = collate(r, learner.collate_spec)
    learner.stage_logprob(batch)
    from specrl.trainer.scoring import response_logprobs

    ref_a = torch.zeros_like(batch.gen_logp)
    with torch.no_grad():
        for i in range(len(r.prompts)):
            toks, m = batch.tokens[[i], : batch.ends[i]], batch.mask[[i], : batch.ends[i] - 1]
            lp, _ = response_logprobs(a, toks, m, 1.0)
            ref_a[i, : lp.shape[1]] = lp
    m = batch.mask
    assert torch.allclose(batch.gen_logp[m], ref_a[m], atol=1e-4)  # behaviour log-probs are A's
    weights = torch.exp(batch.old_logp - batch.gen_logp)[m]
    assert not torch.allclose(weights, torch.ones_like(weights), atol=1e-3)  # A and B differ
    rec = learner.learn(r, {"data": 0.0, "prepare": 0.0, "gen": 0.0})
    capped = weights.clamp(max=cfg.grpo.importance_sampling_cap)
    assert rec["policy_lag"] == 1
    assert rec["is_ratio_mean"] == pytest.approx(float(capped.mean()), rel=1e-3)
    assert rec["is_ratio_max"] == pytest.approx(float(capped.max()), rel=1e-3)


def test_worker_killed_mid_generation_nothing_lost_or_twice(tiny, tmp_path):
    """A rollout worker SIGKILLs itself during step 2: Ray restarts it, the share is retried with re-synced weights,
    and every (step, prompt, sample) id is trained exactly once."""
    cfg = tmp_path / "c.yaml"
    cfg.write_text(yaml.safe_dump(async_cfg(tiny, lag=1, run__checkpoint_every=0, grpo__val_every=0)))
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    (tmp_path / "run").mkdir()
    code = subprocess_code({"kill_worker_at_step": (2, str(tmp_path / "run" / ".worker-killed-2"))},
                           "from specrl.run.loop import train_main; from specrl.cluster import make_trainer; "
                           f"train_main({str(cfg)!r}, [], None, {str(tmp_path / 'run')!r}, False, "
                           "make_trainer=make_trainer)")
    proc = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert (tmp_path / "run" / ".worker-killed-2").exists()  # the kill happened
    recs = read_jsonl(tmp_path / "run" / "metrics.jsonl")
    assert [r["step"] for r in recs] == [1, 2, 3]
    assert [r["trained_request_id_range"] for r in recs] == [[0, 7], [8, 15], [16, 23]]
    assert all(r["trained_samples"] == 8 for r in recs)


def test_driver_killed_and_resumed(tiny, tmp_path):
    """kill -9 of the whole async run in step 3, resume: steps 1..3 each once, same ids, the run completes."""
    cfg = tmp_path / "c.yaml"
    cfg.write_text(yaml.safe_dump(async_cfg(tiny, lag=1, run__steps=4, grpo__val_every=0)))
    run = tmp_path / "run"
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    code = subprocess_code({"kill_driver_at_step": 3},
                           "from specrl.run.loop import train_main; from specrl.cluster import make_trainer; "
                           f"train_main({str(cfg)!r}, [], None, {str(run)!r}, False, make_trainer=make_trainer)")
    proc = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == -9, proc.stderr[-3000:]
    assert sorted(p.name for p in (run / "checkpoints").iterdir()) == ["step_000001", "step_000002"]
    code = ("from specrl.run.loop import train_main; from specrl.cluster import make_trainer; "
            f"train_main(None, [], {str(run)!r}, None, False, make_trainer=make_trainer)")
    proc = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    recs = read_jsonl(run / "metrics.jsonl")
    assert [r["step"] for r in recs] == [1, 2, 3, 4]
    assert [r["trained_request_id_range"] for r in recs] == [[0, 7], [8, 15], [16, 23], [24, 31]]
    assert (run / "report.md").exists()


def test_pipelines_benchmark_runs_all_four_arms(tiny, tmp_path):
    """benchmarks/pipelines.py end to end on the tiny model (through `specrl train`, async included): its table,
    JSON and plot, and the arms' run directories removed at the end (no --keep-runs); no speed is asserted."""
    from tests.bench import load_benchmark

    cfg = tmp_path / "c.yaml"
    cfg.write_text(yaml.safe_dump(cfg_dict(tiny, speculative__drafter="ngram", speculative__num_draft_tokens=2)))
    mod = load_benchmark("pipelines")
    out = mod.main(["--config", str(cfg), "--steps", "2", "--out", str(tmp_path / "p")])
    table = (out / "pipelines.md").read_text()
    for arm in ("sync-ar", "sync-spec", "async-ar", "async-spec"):
        assert f"| {arm} |" in table
        assert json.loads((out / "pipelines.json").read_text())[arm]["steps"] == 2
    assert (out / "pipelines_reward.png").exists()
    assert sorted(p.name for p in out.iterdir()) == ["pipelines.json", "pipelines.md", "pipelines_reward.png"]


def test_worker_that_cannot_build_its_backend_is_a_clear_error(tiny, tmp_path, local_ray):
    from specrl.cluster.async_trainer import AsyncGRPOTrainer

    cfg = validate_config(async_cfg(tiny, lag=0, speculative__drafter="eagle:/nonexistent"))
    with pytest.raises(SpecRLError, match=r"rollout worker 0:.*/nonexistent"):
        AsyncGRPOTrainer(cfg, tmp_path / "run")


# ----------------------------------------------------------------------------- SIGINT / SIGTERM in an async run
def _tagged_processes(tag: str) -> list[str]:
    """Live processes whose environment carries SPECRL_TEST_TAG=tag: the run's driver and every Ray process it
    started (GCS, raylet, workers inherit the driver's environment), and nothing another run started."""
    found = []
    for env in Path("/proc").glob("[0-9]*/environ"):
        try:
            if f"SPECRL_TEST_TAG={tag}".encode() in env.read_bytes().split(b"\0"):
                found.append((env.parent / "cmdline").read_bytes().replace(b"\0", b" ").decode()[:120])
        except OSError:  # gone meanwhile
            pass
    return found


def _cli(args: list[str], env: dict, seen: list | None = None,
         faults: dict | None = None) -> subprocess.CompletedProcess:
    """`specrl train ARGS` in a subprocess with `faults` installed (tests/faults.py); with `seen`, the tagged
    processes are sampled while it runs (so a test can show that the leftover check does see the run's Ray
    processes while they exist)."""
    code = subprocess_code(faults or {}, "from specrl.cli import main; main()")
    with subprocess.Popen([sys.executable, "-c", code, "train", *args], env=env, stdout=subprocess.PIPE,
                          stderr=subprocess.PIPE, text=True) as p:
        if seen is not None:
            while p.poll() is None:
                seen.extend(_tagged_processes(env["SPECRL_TEST_TAG"]))
                time.sleep(0.5)
        out, err = p.communicate(timeout=600)
    return subprocess.CompletedProcess(p.args, p.returncode, out, err)


def _expected_prompts(cfg: dict, steps: int) -> list[list[int]]:
    from specrl.data.tasks import PromptSampler

    s = PromptSampler(cfg["task"]["train_size"], seed=validate_config(cfg).run.seed)
    return [s.next(cfg["grpo"]["num_prompts_per_step"]) for _ in range(steps)]


def _assert_each_id_once(run: Path, cfg: dict, steps: int) -> None:
    recs = read_jsonl(run / "metrics.jsonl")
    assert [r["step"] for r in recs] == list(range(1, steps + 1))
    assert [r["trained_request_id_range"] for r in recs] == [[8 * i, 8 * i + 7] for i in range(steps)]
    assert all(r["trained_samples"] == 8 for r in recs)
    # the data cursor: every step trained the prompts the seeded sampler gives it, none skipped or repeated
    assert [r["trained_prompt_indices"] for r in recs] == _expected_prompts(cfg, steps)


def _no_ray_left(tag: str) -> None:
    deadline = time.monotonic() + 10  # a process the shutdown signalled may take a moment to exit
    while _tagged_processes(tag) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert _tagged_processes(tag) == []


def test_async_signal_finishes_the_step_checkpoints_and_resumes(tiny, tmp_path):
    """SIGTERM in step 2 of an async run (lag 1: step 3's groups are being generated): step 2 finishes and is
    checkpointed with the data cursor before step 3, the in-flight step-3 work is discarded, Ray is shut down with
    no process left, `specrl train` exits 2 with the resume command; --resume completes the run with every
    (step, prompt, sample) id trained exactly once."""
    d = async_cfg(tiny, lag=1, run__steps=4, run__checkpoint_every=0, grpo__val_every=0)
    (tmp_path / "c.yaml").write_text(yaml.safe_dump(d))
    run, tag = tmp_path / "run", f"sig-{os.getpid()}-{time.monotonic_ns()}"
    env = {**os.environ, "PYTHONPATH": str(ROOT), "SPECRL_TEST_TAG": tag}
    seen: list[str] = []
    proc = _cli(["--config", str(tmp_path / "c.yaml"), "--out", str(run)], env, seen,
                faults={"signal_at_step": (2, "TERM", 1)})
    assert proc.returncode == 2, proc.stderr[-3000:]
    assert any("raylet" in c for c in seen) and any("RolloutWorker" in c for c in seen)  # the check sees them
    assert re.search(r"SIGTERM: finishing", proc.stderr)
    ck2 = re.escape(str(run / "checkpoints" / "step_000002"))
    assert re.search(rf"SIGTERM received.*step 2 of 4\b.*checkpoint {ck2}", proc.stderr.replace("\n", ""))
    assert f"specrl train --resume {run}" in proc.stderr.replace("\n", "")
    _no_ray_left(tag)
    assert [p.name for p in (run / "checkpoints").iterdir()] == ["step_000002"]
    assert [r["step"] for r in read_jsonl(run / "metrics.jsonl")] == [1, 2]
    ck = torch.load(run / "checkpoints" / "step_000002" / "trainer.pt", weights_only=False)
    assert ck["step"] == 2 and ck["sampler"]["cursor"] == 2 * 2  # before step 3's prompts, though they were drawn
    proc = _cli(["--resume", str(run)], env)
    assert proc.returncode == 0, proc.stderr[-3000:]
    _no_ray_left(tag)
    _assert_each_id_once(run, d, 4)
    assert (run / "report.md").exists()


def test_async_second_signal_aborts_at_once(tiny, tmp_path):
    """Two SIGINTs in step 2: the run aborts without finishing step 2 (no step-2 checkpoint or metrics), shuts Ray
    down with nothing left, exits 2 with the resume command; --resume redoes step 2 from checkpoint 1 and
    completes with each id trained once."""
    d = async_cfg(tiny, lag=1, run__steps=3, run__checkpoint_every=1, run__keep_checkpoints=3, grpo__val_every=0)
    (tmp_path / "c.yaml").write_text(yaml.safe_dump(d))
    run, tag = tmp_path / "run", f"sig2-{os.getpid()}-{time.monotonic_ns()}"
    env = {**os.environ, "PYTHONPATH": str(ROOT), "SPECRL_TEST_TAG": tag}
    proc = _cli(["--config", str(tmp_path / "c.yaml"), "--out", str(run)], env,
                faults={"signal_at_step": (2, "INT", 2)})
    assert proc.returncode == 2, proc.stderr[-3000:]
    err = proc.stderr.replace("\n", "")
    assert re.search(r"second SIGINT: aborted.*\b1 of 3 steps", err)
    assert f"the last is checkpoint {run / 'checkpoints' / 'step_000001'}" in err
    assert f"specrl train --resume {run}" in err
    _no_ray_left(tag)
    assert [p.name for p in (run / "checkpoints").iterdir()] == ["step_000001"]
    assert [r["step"] for r in read_jsonl(run / "metrics.jsonl")] == [1]
    proc = _cli(["--resume", str(run)], env)
    assert proc.returncode == 0, proc.stderr[-3000:]
    _no_ray_left(tag)
    _assert_each_id_once(run, d, 3)


# ----------------------------------------------------------------------------- checkpoints written by the learner
def test_async_checkpoint_state_is_written_by_the_learner_actor(tiny, tmp_path, local_ray):
    """The driver's checkpoint parts hold no tensors: the policy and optimizer stay in the learner actor, which
    writes them into the checkpoint as its DCP directory (no second copy of the state in the driver); what it writes is
    the learner's state; each held part is written once, and never after a later step has changed the live optimizer
    state."""
    from specrl.checkpoint.sharded_state import DCP_PART, load_dcp, read_model_tensors
    from specrl.checkpoint.store import load_checkpoint, save_checkpoint
    from specrl.cluster.actors import HeldPart
    from specrl.cluster.async_trainer import AsyncGRPOTrainer

    a = AsyncGRPOTrainer(validate_config(async_cfg(tiny, lag=0)), tmp_path / "run")
    try:
        a.step()
        parts = a.state_parts()
        assert {k for k, v in parts.items() if isinstance(v, HeldPart)} == {DCP_PART} == set(parts) - {"trainer"}
        assert parts["trainer"]["step"] == 1 and parts["trainer"]["pipeline"] == "async"
        ck = load_checkpoint(save_checkpoint(tmp_path / "ck", 1, parts))
        full = ray.get(a.learner.state_parts.remote())[DCP_PART]  # a copy of the actor's modules and optimizer
        saved = read_model_tensors(ck.parts[DCP_PART])
        assert saved.keys() == {f"policy.{k}" for k in full.policy.state_dict()}
        assert all(torch.equal(saved[f"policy.{k}"], v) for k, v in full.policy.state_dict().items())
        opt = full.optimizers[0]
        moments = {(i, name): t.clone() for i, p in enumerate(full.policy.parameters()) for name, t in
                   opt.state[p].items()}
        for st in opt.state.values():  # forget them, then read them back from the checkpoint
            for t in st.values():
                t.zero_()
        load_dcp(ck.parts[DCP_PART], full.policy, None, [opt])
        assert moments and all(torch.equal(opt.state[p][name], moments[i, name])
                               for i, p in enumerate(full.policy.parameters()) for name in opt.state[p])
        with pytest.raises(SpecRLError, match=f"no checkpoint part '{DCP_PART}'"):
            parts[DCP_PART].write_dir(tmp_path / "again")
        parts = a.state_parts()
        a.step()
        with pytest.raises(SpecRLError, match=f"'{DCP_PART}'.*step 1\\b.*step 2\\b"):
            parts[DCP_PART].write_dir(tmp_path / "late")
        assert not (tmp_path / "again").exists() and not (tmp_path / "late").exists()
    finally:
        a.close()


# ----------------------------------------------------------------------------- the pre-checkpoint weight check
def test_async_learner_probes_the_weights_before_a_checkpoint(tiny, tmp_path, local_ray):
    """A huge learning rate leaves finite but blown-up weights: the NaN/inf scan passes them, the 16-token forward +
    backward the sync learner runs does not. The async learner actor runs the same probe, so no checkpoint of those
    weights is written and the error names the cause (before, step_000001 was written and called good)."""
    from specrl.cluster import make_trainer

    reward = tmp_path / "varied.py"  # the random tiny model never solves a task: a reward that varies per sample
    reward.write_text("def varied(prompt, completion, row):\n    return float(sum(map(ord, completion)) % 7)\n")
    d = async_cfg(tiny, lag=0, policy__learning_rate=1e20, reward__functions=[f"{reward}:varied"],
                  grpo__val_every=0, run__steps=2)
    (tmp_path / "c.yaml").write_text(yaml.safe_dump(d))
    run = tmp_path / "run"
    with pytest.raises(SpecRLError, match=r"step 1:.*non-finite.*none"):
        train_main(str(tmp_path / "c.yaml"), [], None, str(run), False, make_trainer=make_trainer)
    assert not list((run / "checkpoints").glob("step_*"))


# ----------------------------------------------------------------------------- in-flight weight updates on Ray
def test_async_in_flight_updates_span_versions_within_the_lag_bound(tiny, tmp_path):
    """pipeline.in_flight_updates on Ray (engine steps slowed by a test hook so a share outlasts the learner's step):
    the worker loads the newly published version between engine steps, some samples span two versions, every
    token's version is within the lag bound with the sample's version its oldest, and each id is trained once.
    (tests/test_inflight.py checks the per-token versions, log-probs and IS ratios exactly, without Ray.)"""
    d = async_cfg(tiny, lag=1, run__steps=4, run__checkpoint_every=0, grpo__val_every=0,
                  pipeline__in_flight_updates=True, speculative__verify="rejection", generation__max_new_tokens=16)
    (tmp_path / "c.yaml").write_text(yaml.safe_dump(d))
    run, tag = tmp_path / "run", f"inflight-{os.getpid()}-{time.monotonic_ns()}"
    env = {**os.environ, "PYTHONPATH": str(ROOT), "SPECRL_TEST_TAG": tag}
    proc = _cli(["--config", str(tmp_path / "c.yaml"), "--out", str(run)], env, faults={"in_flight_delay": 0.1})
    assert proc.returncode == 0, proc.stderr[-3000:]
    _no_ray_left(tag)
    _assert_each_id_once(run, d, 4)
    recs = read_jsonl(run / "metrics.jsonl")
    assert sum(r["mixed_version_samples"] for r in recs) >= 1, [r["mixed_version_samples"] for r in recs]
    for r in recs:
        assert r["trajectory_age_max"] <= 1 and r["policy_lag"] <= 1 and r["is_ratio_mean"] is not None
    events = [json.loads(line) for line in (run / "timeline.jsonl").read_text().splitlines()]
    live = [e for e in events if e["kind"] == "refit" and e.get("in_flight")]
    # a share of step s starts at version >= s - 2; the only newer one published before it is done is s - 1
    assert live and all(e["version"] == e["step"] - 1 for e in live), live

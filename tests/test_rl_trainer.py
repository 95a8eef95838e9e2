"""The GRPO step, the run loop, resume after SIGKILL, compare mode and bad input, on a tiny random model."""

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import yaml

from specrl.algorithms.batch import collate
from specrl.checkpoint.sharded_state import DCP_PART, read_model_tensors
from specrl.drafters.base import Drafter, Proposal, pad_proposals
from specrl.drafters.storage import default as default_drafter
from specrl.errors import SpecRLError
from specrl.observability.metrics import STAGES, STEP_FIELDS, read_jsonl
from specrl.run.loop import train_main
from specrl.trainer.config_check import validate_config
from specrl.trainer.learner import Learner, NonFiniteError
from specrl.trainer.sync_trainer import GRPOTrainer
from tests.bench import load_benchmark
from tests.faults import subprocess_code
from tests.tiny import make_tiny_checkpoint

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def tiny(tmp_path_factory) -> Path:
    return make_tiny_checkpoint(tmp_path_factory.mktemp("tiny") / "ckpt", seed=0)


def cfg_dict(tiny: Path, **over) -> dict:
    d = {
        "model": {"name": str(tiny), "max_seq_len": 192, "rollout_dtype": "float32"},
        "task": {"name": "chain_sum", "difficulty": "easy", "train_size": 40, "val_size": 4,
                 "system_prompt": "Be brief."},
        "grpo": {"num_prompts_per_step": 2, "num_generations": 4, "val_every": 2},
        "policy": {"learning_rate": 1e-3, "train_micro_batch_size": 4, "precision": "fp32"},  # exact on any CPU
        "generation": {"max_new_tokens": 8, "max_batch_size": 8},
        "speculative": {"verify": "seed_exact"},
        "run": {"name": "t", "steps": 3, "checkpoint_every": 1, "keep_checkpoints": 3, "tensorboard": False,
                "progress": False},
    }
    for key, value in over.items():
        section, _, field = key.partition("__")
        d.setdefault(section, {})[field] = value
    return d


def write_cfg(path: Path, d: dict) -> Path:
    path.write_text(yaml.safe_dump(d))
    return path


def test_step_record_and_weight_sync(tiny):
    t = GRPOTrainer.from_config(validate_config(cfg_dict(tiny)))
    rec = t.step()
    assert all(k in rec for k in STEP_FIELDS)
    assert set(rec["stage_seconds"]) == set(STAGES)
    assert rec["step"] == 1 and rec["generated_tokens"] > 0
    assert abs(rec["step_seconds"] - sum(rec["stage_seconds"].values())) < 1e-6
    # fp32 rollout copy of the same weights: the recomputed logprobs match the engine's
    assert 1.0 <= rec["token_mult_prob_error"] < 1.001
    assert rec["acceptance_length"] is None  # autoregressive
    assert rec["acceptance_rate_per_position"] == [] and rec["draft_loss"] is None and rec["draft_updates"] == 0
    assert rec["draft_refreshed"] is False and rec["drafter_collapsed"] is False
    assert rec["policy_version"] == 0 and rec["policy_lag"] == 0 and t.learner.version == 1
    t.stage_prepare()
    assert t.backend.policy_version == 1
    rollout = dict(t.backend.model.named_parameters())
    assert all(torch.equal(p, rollout[n]) for n, p in t.policy.named_parameters())
    assert t.producer.sampler.cursor == 2


def test_grpo_update_raises_logprob_of_rewarded_sample(tiny):
    t = GRPOTrainer.from_config(validate_config(cfg_dict(tiny, policy__learning_rate=1e-2)))
    idx = t.stage_data()
    t.stage_prepare()
    r = t.stage_gen(idx)
    r.rewards = torch.tensor([1.0, 0.0, 0.0, 0.0, 0.0, 0.0, 0.0, 1.0])
    before = collate(r, t.learner.collate_spec)
    t.learner.stage_logprob(before)
    t.learner.stage_train(before)
    after = collate(r, t.learner.collate_spec)
    t.learner.stage_logprob(after)
    seq = lambda b, i: float((b.old_logp[i] * b.mask[i]).sum())  # noqa: E731
    assert seq(after, 0) > seq(before, 0)
    assert seq(after, 7) > seq(before, 7)
    assert seq(after, 1) < seq(before, 1)


def test_non_finite_stops_with_step(tiny, tmp_path):
    t = GRPOTrainer.from_config(validate_config(cfg_dict(tiny)))
    t.step()
    good = {k: v.clone() for k, v in t.learner.named_weights()[1].items()}

    class GoodWeightsSync:  # tags the new version but keeps the step-1 weights in the backend
        def push(self, version, policy, drafter=None):
            t.backend.load_weights("policy", good, version)

    t.weight_sync = GoodWeightsSync()  # the engine keeps good weights; the trainer's go bad
    with torch.no_grad():
        t.policy.norm.weight.fill_(float("nan"))
    with pytest.raises(NonFiniteError, match="step 2: .*non-finite"):
        t.step()


def test_stale_weight_sync_is_an_error(tiny):
    """A sync that never delivers the learner's version: the sync learner refuses rollouts of older weights."""
    t = GRPOTrainer.from_config(validate_config(cfg_dict(tiny)))
    t.step()

    class NoSync:
        def push(self, version, policy, drafter=None):
            pass

    t.weight_sync = NoSync()
    with pytest.raises(SpecRLError, match=r"\(lag 1;.*0\.\.0\)"):
        t.step()


def test_run_writes_everything(tiny, tmp_path):
    cfg = write_cfg(tmp_path / "c.yaml", cfg_dict(tiny))
    run_dir = train_main(str(cfg), ["run.steps=2"], None, str(tmp_path / "run"), False)
    for name in ("config.yaml", "metrics.jsonl", "validation.jsonl", "report.md", "reward.png", "stages.png",
                 "acceptance.png", "final/model.safetensors", "final/tokenizer.json"):
        assert (run_dir / name).exists(), name
    recs = read_jsonl(run_dir / "metrics.jsonl")
    assert [r["step"] for r in recs] == [1, 2]
    assert recs[1]["accuracy"] is not None  # validated at step 2 (val_every=2 and last step)
    assert [r["step"] for r in read_jsonl(run_dir / "validation.jsonl")] == [0, 2]
    assert yaml.safe_load((run_dir / "config.yaml").read_text())["run"]["steps"] == 2
    with pytest.raises(SpecRLError, match=r"holds a run.*--resume"):
        train_main(str(cfg), [], None, str(run_dir), False)


def test_bad_model_context(tiny, tmp_path):
    with pytest.raises(SpecRLError, match=r"max_seq_len \(1024\).*context \(512"):
        GRPOTrainer.from_config(validate_config(cfg_dict(tiny, model__max_seq_len=1024)))
    t = GRPOTrainer.from_config(validate_config(cfg_dict(tiny, model__max_seq_len=64,
                                                         generation__max_new_tokens=32)))
    with pytest.raises(SpecRLError, match=r"prompt has \d+ tokens.*max_seq_len"):
        t.step()


def test_unknown_task_via_trainer(tiny):
    with pytest.raises(SpecRLError, match="unknown task 'chain_summ'"):
        GRPOTrainer.from_config(validate_config(cfg_dict(tiny, task__name="chain_summ")))


def test_resume_bad_dir(tmp_path):
    with pytest.raises(SpecRLError, match="no config.yaml"):
        train_main(None, [], str(tmp_path), None, False)


def test_sigkill_resume_matches_uninterrupted(tiny, tmp_path):
    """Kill -9 mid-step 3, corrupt the newest checkpoint, resume: same final weights as a clean run."""
    cfg = write_cfg(tmp_path / "c.yaml", cfg_dict(tiny))
    clean = train_main(str(cfg), [], None, str(tmp_path / "clean"), False)
    killed = tmp_path / "killed"
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    code = subprocess_code({"kill_learner_at_step": 3}, "from specrl.run.loop import train_main; "
                           f"train_main({str(cfg)!r}, [], None, {str(killed)!r}, False)")
    proc = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == -9, proc.stderr[-2000:]
    assert sorted(p.name for p in (killed / "checkpoints").iterdir()) == ["step_000001", "step_000002"]
    assert not (killed / "report.md").exists()
    # damage the newest checkpoint: resume must fall back to step 1 and say so
    (killed / "checkpoints" / "step_000002" / DCP_PART / ".metadata").write_bytes(b"garbage")
    train_main(None, [], str(killed), None, False)
    a = read_model_tensors(clean / "checkpoints" / "step_000003" / DCP_PART)
    b = read_model_tensors(killed / "checkpoints" / "step_000003" / DCP_PART)
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    ra, rb = read_jsonl(clean / "metrics.jsonl"), read_jsonl(killed / "metrics.jsonl")
    assert [r["step"] for r in rb] == [1, 2, 3]
    assert [r["reward_mean"] for r in ra] == [r["reward_mean"] for r in rb]


class RepeatDrafter(Drafter):
    """Test drafter: proposes the last token k times (deterministic, one-hot q)."""

    kind = "repeat"

    def propose(self, batch, k):
        return Proposal(pad_proposals([[t[-1]] * k for t in batch.tokens], k))


@pytest.mark.parametrize("drafter", ["repeat", "ngram", "suffix"])
def test_compare_seed_exact(tiny, tmp_path, monkeypatch, drafter):
    if drafter == "repeat":
        monkeypatch.setattr(default_drafter, "resolve_drafter",
                            lambda spec, model: None if spec == "none" else RepeatDrafter())
    cfg = write_cfg(tmp_path / "c.yaml", cfg_dict(tiny, speculative__drafter="ngram" if drafter == "repeat"
                                                  else drafter, speculative__num_draft_tokens=2))
    out = train_main(str(cfg), ["run.steps=2"], None, str(tmp_path / "cmp"), True)
    data = json.loads((out / "compare.json").read_text())
    assert data["rollouts_identical"] is True and data["weights_identical"] is True
    assert data["rollouts_identical_per_step"] == [True, True]
    for k in ("gen_speedup", "step_speedup", "bound", "gen_share", "acceptance_length"):
        assert k in data
    assert data["acceptance_length"] >= 1.0
    assert (out / "compare.md").exists() and (out / "compare_reward.png").exists()
    assert (out / "speculative" / "report.md").exists() and (out / "autoregressive" / "report.md").exists()
    sd = read_jsonl(out / "speculative" / "metrics.jsonl")
    assert sd[0]["acceptance_length"] is not None
    # real drafts per sequence-step: k for the repeat drafter; n-gram/suffix padding is not counted (ragged drafts)
    k_mean = sd[0]["num_draft_tokens_mean"]
    assert k_mean == 2.0 if drafter == "repeat" else 0.0 <= k_mean <= 2.0


def test_compare_needs_drafter(tiny, tmp_path):
    cfg = write_cfg(tmp_path / "c.yaml", cfg_dict(tiny))
    with pytest.raises(SpecRLError, match=r"compare.*needs speculative rollouts"):
        train_main(str(cfg), [], None, str(tmp_path / "cmp"), True)
    with pytest.raises(SpecRLError, match="no config.yaml there"):  # a compare resumes only a compare's directory
        train_main(str(cfg), [], str(tmp_path), None, True)


def test_response_logprobs_matches_full_logits(tiny):
    from specrl import load_model
    from specrl.algorithms.grpo import token_logprobs
    from specrl.trainer.learner import response_logprobs

    model, _ = load_model(tiny, dtype=torch.float32)
    toks = torch.randint(3, 120, (3, 10))
    mask = torch.zeros(3, 9, dtype=torch.bool)
    mask[0, 4:] = True
    mask[2, 2:6] = True
    lp, captured = response_logprobs(model, toks, mask, temperature=0.7)
    logits, _ = model(toks)
    full = token_logprobs(logits[:, :-1], toks[:, 1:], 0.7)
    assert torch.allclose(lp[mask], full[mask], atol=1e-5)
    assert bool((lp[~mask] == 0).all()) and "final" in captured


def test_bf16_mixed_step(tiny):
    t = GRPOTrainer.from_config(validate_config(cfg_dict(tiny, policy__precision="bf16-mixed",
                                                         model__rollout_dtype="bfloat16")))
    rec = t.step()
    assert rec["token_mult_prob_error"] < 1.5 and t.policy.norm.weight.dtype == torch.float32


@pytest.mark.parametrize("kind", ["eagle", "mtp"])
def test_online_drafter_training(tiny, monkeypatch, kind):
    t = online_trainer(tiny, monkeypatch, kind)
    before = {k: v.clone() for k, v in t.drafter.state_dict().items()}
    rec = t.step()
    assert rec["draft_loss"] is not None and rec["draft_loss"] > 0
    assert rec["acceptance_length"] is not None
    after = t.drafter.state_dict()
    assert any(not torch.equal(before[k], after[k]) for k in before)  # the drafter learned
    t.stage_prepare()
    engine_state = t.backend.drafter.state_dict()
    assert all(torch.equal(after[k].to(engine_state[k].dtype), engine_state[k]) for k in after)
    rec2 = t.step()
    assert rec2["draft_loss"] is not None


def test_online_needs_trainable_drafter(tiny):
    cfg = validate_config(cfg_dict(tiny, speculative__drafter="eagle:x", drafter__online=True))
    cfg.speculative.drafter = "ngram"  # bypass the config check to reach the trainer's own
    with pytest.raises(SpecRLError, match=r"EAGLE or MTP.*'ngram'"):
        GRPOTrainer.from_config(cfg)


def test_non_finite_in_run_names_step_and_last_good_checkpoint(tiny, tmp_path, monkeypatch):
    real = Learner.stage_train

    def flaky(self, batch, capture=None):
        if self.step_count + 1 == 2:
            raise NonFiniteError("step 2: non-finite GRPO loss (nan); update skipped")
        return real(self, batch, capture)

    monkeypatch.setattr(Learner, "stage_train", flaky)
    cfg = write_cfg(tmp_path / "c.yaml", cfg_dict(tiny))
    with pytest.raises(SpecRLError, match=r"step 2: non-finite.*step_000001"):
        train_main(str(cfg), [], None, str(tmp_path / "run"), False)
    assert [r["step"] for r in read_jsonl(tmp_path / "run" / "metrics.jsonl")] == [1]
    assert sorted(p.name for p in (tmp_path / "run" / "checkpoints").iterdir()) == ["step_000001"]


# ----------------------------------------------------------------------------- staleness control loop


def online_trainer(tiny, monkeypatch, kind="eagle", **over) -> GRPOTrainer:
    from specrl.drafters import EagleDrafter, MTPDrafter

    def build(spec, model):
        if spec == "none":
            return None
        torch.manual_seed(1)
        return EagleDrafter(model) if kind == "eagle" else MTPDrafter(model)

    monkeypatch.setattr(default_drafter, "resolve_drafter", build)
    over = {"speculative__drafter": f"{kind}:x", "speculative__num_draft_tokens": 2, "drafter__online": True,
            "drafter__learning_rate": 1e-2, **over}
    return GRPOTrainer.from_config(validate_config(cfg_dict(tiny, **over)))


def fake_acceptance(t: GRPOTrainer, values: list[float], draft_tokens: int = 64) -> None:
    """Make each generate call report the next acceptance length (with speculative steps verified)."""
    real, it = t.backend.generate, iter(values)

    def generate(*a, **k):
        out = real(*a, **k)
        out.metrics = {**out.metrics, "acceptance_length": next(it), "verify_steps": 7, "draft_tokens": draft_tokens}
        return out

    t.backend.generate = generate


def test_drafter_health_reference_and_streak():
    from specrl.drafters.training.online import DrafterHealth

    h = DrafterHealth(fraction=0.8, collapse_threshold=1.05, collapse_patience=2)
    assert h.observe(None) == (False, False) and h.reference is None  # no speculation: no reference yet
    assert h.observe(2.0) == (False, False) and h.reference == 2.0
    assert h.observe(1.7) == (False, False)  # 1.7 >= 0.8 * 2.0
    assert h.observe(1.5) == (True, False) and h.reference == 2.0  # stale, reference kept until a refresh
    h.refreshed()
    assert h.observe(1.5) == (False, False) and h.reference == 1.5  # first step after the refresh
    assert h.observe(1.0) == (True, False)
    assert h.observe(1.04) == (True, True)  # second step <= 1.05 in a row
    assert h.observe(None) == (False, False) and h.streak == 0  # a step without speculation breaks the streak
    h2 = DrafterHealth(0.8, 1.05, 2)
    h2.load_state_dict(h.state_dict())
    assert h2 == h


def test_drafter_health_reference_follows_improvement_but_not_one_noisy_step():
    from specrl.drafters.training.online import DrafterHealth

    h = DrafterHealth(fraction=0.85, collapse_threshold=1.05, collapse_patience=2)
    h.observe(1.5)
    h.observe(2.5)  # one lucky step moves the average only part of the way
    assert 1.5 < h.reference < 2.0
    for _ in range(12):  # online training made the drafter better: the bar rises with it
        h.observe(2.4)
    assert h.reference == pytest.approx(2.4, abs=0.05)
    assert h.observe(1.9)[0]  # back at the old level is now stale (1.9 < 0.85 * 2.4)


def test_drafter_refresh_leaves_policy_bit_identical(tiny, monkeypatch):
    t = online_trainer(tiny, monkeypatch, drafter__refresh_steps=3)
    idx = t.stage_data()
    t.stage_prepare()
    batch = collate(t.stage_gen(idx), t.learner.collate_spec)
    t.learner.stage_logprob(batch, capture=True)
    t.learner.stage_train(batch)
    policy = {k: v.clone() for k, v in t.policy.state_dict().items()}
    drafter = {k: v.clone() for k, v in t.drafter.state_dict().items()}
    opt, dt = t.learner.optimizer, t.learner.drafter_trainer
    pstate = {id(p): {k: v.clone() for k, v in opt.state[p].items()} for p in t.policy.parameters()}
    lr = opt.param_groups[0]["lr"]
    assert dt.refresh(dt.captures, 1) == 3
    assert all(torch.equal(policy[k], v) for k, v in t.policy.state_dict().items())  # bit-identical policy
    for p in t.policy.parameters():  # and untouched AdamW moments / step counts of the policy
        assert all(torch.equal(pstate[id(p)][k], v) for k, v in opt.state[p].items())
    assert any(not torch.equal(drafter[k], v) for k, v in t.drafter.state_dict().items())  # drafter moved
    assert opt.param_groups[0]["lr"] == lr  # the scheduler was not stepped
    assert all(p.grad is None for p in t.drafter.parameters())
    with torch.no_grad():
        t.drafter.fc.weight.fill_(float("nan"))
    with pytest.raises(NonFiniteError, match=r"non-finite.*refresh update 1") as e:
        dt.refresh(dt.captures, 1)
    assert "step 1:" in str(e.value)


def test_staleness_loop_refreshes_when_acceptance_drops(tiny, monkeypatch):
    t = online_trainer(tiny, monkeypatch, drafter__staleness_fraction=0.85, drafter__refresh_steps=3)
    fake_acceptance(t, [2.0, 1.5, 1.5, 1.2])
    lines: list[str] = []
    t.log = lines.append
    recs = [t.step() for _ in range(2)]
    # step 1 sets the reference; step 2 (1.5 < 0.85 * 2.0) is stale -> 1 online + 3 refresh updates
    assert [r["draft_refreshed"] for r in recs] == [False, True]
    assert [r["draft_updates"] for r in recs] == [1, 4]
    assert [r["acceptance_length_reference"] for r in recs] == [2.0, 2.0]
    (stale,) = lines  # one event line, naming the step, the acceptance length, the fraction and the reference
    assert re.search(r"step 2\b.*stale.*1\.50.*0\.85.*2\.00", stale), stale
    # the refreshed drafter reaches the engine through the ordinary prepare/weight-sync path
    t.stage_prepare()
    engine_state = t.backend.drafter.state_dict()
    assert all(torch.equal(v.to(engine_state[k].dtype), engine_state[k]) for k, v in t.drafter.state_dict().items())
    # step 3 is the first after the refresh: it sets the new reference (1.5); step 4 (1.2 < 1.275) refreshes
    recs += [t.step() for _ in range(2)]
    assert [r["draft_refreshed"] for r in recs[2:]] == [False, True]
    assert [r["acceptance_length_reference"] for r in recs[2:]] == [1.5, 1.5]
    assert t.state_parts()["trainer"]["drafter_health"] == {"reference": None, "streak": 0, "ema": None,
                                                            "prev_al": 1.2, "cause": None, "last_refresh": 4}


def test_staleness_refresh_disabled_or_frozen(tiny, monkeypatch):
    t = online_trainer(tiny, monkeypatch, drafter__refresh_steps=0)
    fake_acceptance(t, [2.0, 1.0])
    recs = [t.step() for _ in range(2)]
    assert [r["draft_updates"] for r in recs] == [1, 1] and not any(r["draft_refreshed"] for r in recs)
    # a frozen drafter (online=false): nothing to refresh, no drafter updates, AL still tracked
    t = GRPOTrainer.from_config(validate_config(cfg_dict(tiny, speculative__drafter="ngram",
                                                         speculative__num_draft_tokens=2)))
    fake_acceptance(t, [2.0, 1.0])
    recs = [t.step() for _ in range(2)]
    assert [r["draft_updates"] for r in recs] == [0, 0] and [r["draft_loss"] for r in recs] == [None, None]
    assert [r["acceptance_length"] for r in recs] == [2.0, 1.0] and not recs[1]["draft_refreshed"]


def test_collapse_warning(tiny, monkeypatch):
    t = GRPOTrainer.from_config(validate_config(cfg_dict(tiny, speculative__drafter="ngram",
                                                         speculative__num_draft_tokens=2,
                                                         drafter__collapse_patience=2)))
    fake_acceptance(t, [1.02, 1.0, 1.01, 1.6])
    lines: list[str] = []
    t.log = lines.append
    from specrl.drafters.training.online import DrafterCollapseWarning

    rec1 = t.step()
    assert rec1["drafter_collapsed"] is False and not lines
    with pytest.warns(DrafterCollapseWarning, match=r"\b2 consecutive.*'ngram'"):
        rec2 = t.step()
    (collapsed,) = lines  # one event line, naming the step, the bound and the drafter kind
    assert rec2["drafter_collapsed"] is True and re.search(r"step 2\b.*1\.05.*'ngram'", collapsed), collapsed
    assert t.step()["drafter_collapsed"] is True and len(lines) == 1  # warned once per streak
    assert t.step()["drafter_collapsed"] is False  # AL recovered



def test_zeroed_drafter_collapses(tiny, monkeypatch):
    """An EAGLE head with zeroed weights drafts token 0 every time, which the policy rarely accepts (AL 1.04 and
    1.09 on the tiny model, deterministic under seed_exact; a threshold of 1.2 leaves room)."""
    from specrl.drafters import EagleDrafter
    from specrl.drafters.training.online import DrafterCollapseWarning

    def build(spec, model):
        if spec == "none":
            return None
        d = EagleDrafter(model)
        with torch.no_grad():
            for p in d.parameters():
                p.zero_()
        return d

    monkeypatch.setattr(default_drafter, "resolve_drafter", build)
    t = GRPOTrainer.from_config(validate_config(cfg_dict(tiny, speculative__drafter="eagle:x",
                                                         speculative__num_draft_tokens=2,
                                                         drafter__collapse_threshold=1.2)))
    t.log = lambda msg: None
    with pytest.warns(DrafterCollapseWarning, match=r"'eagle:x' looks broken"):
        recs = [t.step() for _ in range(2)]
    assert all(1.0 <= r["acceptance_length"] <= 1.2 for r in recs)
    assert [r["drafter_collapsed"] for r in recs] == [False, True]


def test_frozen_vs_online_benchmark(tiny, tmp_path):
    """benchmarks/drafter_frozen_vs_online.py on the tiny model: both arms, the plot and table; only the online
    arm's drafter changes."""
    from safetensors.torch import load_file

    from specrl import load_model
    from specrl.drafters import EagleDrafter
    from specrl.drafters.storage.io import save_drafter

    model, _ = load_model(tiny, dtype=torch.float32)
    torch.manual_seed(1)
    ddir = save_drafter(EagleDrafter(model), tmp_path / "eagle")
    cfg = write_cfg(tmp_path / "c.yaml", cfg_dict(tiny, speculative__num_draft_tokens=2,
                                                  drafter__learning_rate=1e-2))
    mod = load_benchmark("drafter_frozen_vs_online")
    out = mod.main(["--config", str(cfg), "--steps", "2", "--out", str(tmp_path / "fvo"),
                    "--drafter", f"eagle:{ddir}", "--keep-runs"])
    for name in ("acceptance_frozen_vs_online.png", "acceptance_frozen_vs_online.md",
                 "acceptance_frozen_vs_online.json", "frozen/metrics.jsonl", "online/metrics.jsonl",
                 "online/report.md"):
        assert (out / name).exists(), name
    table = json.loads((out / "acceptance_frozen_vs_online.json").read_text())
    assert table["frozen"]["draft_updates"] == 0 and table["online"]["draft_updates"] >= 2
    assert set(table) == {"hardware", "frozen", "online"} and table["hardware"]["processor_class"]
    assert all(table[a]["steps"] == 2 and table[a]["acceptance_length_last_third"] >= 1.0 for a in ("frozen", "online"))
    md = (out / "acceptance_frozen_vs_online.md").read_text()
    assert "| frozen | 2 |" in md
    assert any(x.startswith("hardware:") and table["hardware"]["processor_class"] in x for x in md.splitlines())
    init = load_file(ddir / "model.safetensors")
    for arm, should_change in (("frozen", False), ("online", True)):
        final = load_file(out / arm / "drafter_final" / "model.safetensors")
        assert final.keys() == init.keys()
        changed = any(not torch.equal(init[k], final[k].to(init[k].dtype)) for k in init)
        assert changed is should_change, arm
    for arm in ("frozen", "online"):
        recs = read_jsonl(out / arm / "metrics.jsonl")
        assert [r["step"] for r in recs] == [1, 2] and all(r["acceptance_length"] is not None for r in recs)
        assert yaml.safe_load((out / arm / "config.yaml").read_text())["drafter"]["online"] is (arm == "online")
    # a second call with the same config reads both arms instead of rerunning them; another config reruns its arm
    stamp = {arm: (out / arm / "metrics.jsonl").stat().st_mtime_ns for arm in ("frozen", "online")}
    mod.main(["--config", str(cfg), "--steps", "2", "--out", str(out), "--drafter", f"eagle:{ddir}", "--keep-runs",
              "--arms", "online"])
    assert {arm: (out / arm / "metrics.jsonl").stat().st_mtime_ns for arm in stamp} == stamp
    mod.main(["--config", str(cfg), "--steps", "2", "--out", str(out), "--drafter", f"eagle:{ddir}", "--keep-runs",
              "--arms", "online", "--set", "drafter.learning_rate=2e-2"])
    assert (out / "online" / "metrics.jsonl").stat().st_mtime_ns != stamp["online"]
    assert (out / "frozen" / "metrics.jsonl").stat().st_mtime_ns == stamp["frozen"]
    with pytest.raises(SpecRLError, match="unknown arm"):
        mod.main(["--config", str(cfg), "--out", str(out), "--drafter", f"eagle:{ddir}", "--arms", "warm"])


def test_a_few_drafts_do_not_count_as_drafter_health(tiny, monkeypatch):
    # auto k probing once at a large batch drafts a handful of tokens: their AL (here 1.0) is noise, not staleness
    t = online_trainer(tiny, monkeypatch, drafter__staleness_fraction=0.85)
    fake_acceptance(t, [2.0, 1.0], draft_tokens=8)
    recs = [t.step() for _ in range(2)]
    assert [r["draft_refreshed"] for r in recs] == [False, False]
    assert [r["acceptance_length_reference"] for r in recs] == [None, None]


def test_importance_sampling_correction_in_a_sync_step(tiny):
    """On-policy fp32 rollouts: weights ~1, with top-p < 1 too: the trainer scores tokens under the same truncated,
    renormalised distribution the sampler drew them from."""
    off = GRPOTrainer.from_config(validate_config(cfg_dict(tiny))).step()
    assert off["is_ratio_mean"] is None and off["is_clipped_fraction"] is None
    rec = GRPOTrainer.from_config(validate_config(cfg_dict(tiny, grpo__importance_sampling_correction=True))).step()
    assert rec["is_ratio_mean"] == pytest.approx(1.0, abs=1e-4) and rec["is_clipped_fraction"] == 0.0
    assert rec["loss"] == pytest.approx(off["loss"], abs=1e-4)
    topp = GRPOTrainer.from_config(validate_config(cfg_dict(tiny, grpo__importance_sampling_correction=True,
                                                            generation__top_p=0.9))).step()
    assert topp["is_ratio_mean"] == pytest.approx(1.0, abs=1e-4) and topp["is_ratio_max"] <= 1.0 + 1e-4


def test_a_prompt_that_comes_back_in_a_later_epoch_drafts_from_its_earlier_rollouts(tiny):
    """The producer leaves the group to the engine (one group per prompt), so the suffix index of a prompt's first
    epoch serves its second: with greedy rollouts the second epoch repeats the first, and its drafts from history
    are accepted where the first epoch's (siblings' and own context only) were not."""
    d = cfg_dict(tiny, speculative__drafter="suffix", speculative__num_draft_tokens=3)
    d["task"]["train_size"] = 1
    d["grpo"].update(num_prompts_per_step=1, num_generations=2)
    d["generation"].update(temperature=1e-3, max_new_tokens=16)  # near-greedy: an epoch repeats the one before
    d["policy"].update(learning_rate=1e-9, train_micro_batch_size=2)  # ... when the update keeps the argmax
    t = GRPOTrainer.from_config(validate_config(d))
    seen = []
    generate = t.backend.generate
    t.backend.generate = lambda requests, params: seen.append(requests) or generate(requests, params)
    first, second = t.step(), t.step()
    assert [r.group_id for reqs in seen for r in reqs] == [None] * 4
    assert first["prompt_indices"] == second["prompt_indices"] == [0]
    got = [rec.get("history_accepted") or 0 for rec in (first, second)]
    assert got[1] >= got[0] + 8, got

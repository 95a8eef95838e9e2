"""The online drafter's trainer of its own (`specrl.drafters.training.trainer`): the learner optimises the policy
only, the drafter's update never changes the policy's, the drafter clips its own gradient norm, and its optimizer
state survives a checkpoint (the one DCP directory part, any world size)."""

import pytest
import torch

from specrl.algorithms.batch import collate
from specrl.checkpoint.sharded_state import DCP_PART, read_model_tensors
from specrl.checkpoint.store import load_checkpoint, save_checkpoint
from specrl.drafters.training.trainer import DrafterTrainer
from tests.test_rl_trainer import online_trainer
from tests.test_rl_updates import rollouts as step_rollouts
from tests.test_rl_updates import weights
from tests.tiny import make_tiny_checkpoint

SECONDS = {"data": 0.0, "prepare": 0.0, "gen": 0.0}


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return make_tiny_checkpoint(tmp_path_factory.mktemp("tiny") / "ckpt", seed=0)


def rollouts(t, rewarded: bool = True):
    """A step's rollouts, with rewards set by hand (the random tiny model earns none, so the policy would not move)."""
    return step_rollouts(t, rewarded=rewarded)


def test_the_learners_optimizer_holds_no_drafter_parameters(tiny, monkeypatch):
    t = online_trainer(tiny, monkeypatch)
    policy = {id(p) for p in t.policy.parameters()}
    drafter = {id(p) for p in t.drafter.parameters()}
    learner_params = {id(p) for g in t.learner.optimizer.param_groups for p in g["params"]}
    assert learner_params == policy and not learner_params & drafter
    dt = t.learner.drafter_trainer
    assert {id(p) for g in dt.optimizer.param_groups for p in g["params"]} == drafter
    assert t.learner.optimizers == [t.learner.optimizer, dt.optimizer]
    assert dt.lr == pytest.approx(1e-2)  # drafter.learning_rate; the policy's is 1e-3


@pytest.mark.parametrize("over", [{}, {"grpo__mini_batches": 2, "grpo__num_iterations": 2}])
def test_the_policy_update_does_not_depend_on_the_online_drafter(tiny, monkeypatch, over):
    """The same rollouts: the policy after an online-drafter step equals, bit for bit, the policy of a learner whose
    drafter is frozen (drafter.online=false), whether the train forward (one optimizer step) or the logprob stage
    (four) captures the drafter's inputs; the drafter did train."""
    a = online_trainer(tiny, monkeypatch, **over)
    b = online_trainer(tiny, monkeypatch, drafter__online=False, **over)
    assert b.drafter is None and a.drafter is not None
    r = rollouts(a)
    before, policy_before = weights(a.drafter), weights(a.policy)
    rec_a = a.learner.learn(r, SECONDS)
    rec_b = b.learner.learn(r, SECONDS)
    assert rec_a["draft_updates"] == rec_a["optimizer_steps"] == rec_b["optimizer_steps"]
    assert rec_b["draft_updates"] == 0 and rec_b["draft_loss"] is None and rec_a["draft_loss"] > 0
    assert all(torch.equal(v, b.policy.state_dict()[k]) for k, v in a.policy.state_dict().items())
    assert rec_a["loss"] == rec_b["loss"] and rec_a["grad_norm"] == rec_b["grad_norm"] > 0
    assert any(not torch.equal(v, a.policy.state_dict()[k]) for k, v in policy_before.items())  # the policy moved
    assert any(not torch.equal(v, a.drafter.state_dict()[k]) for k, v in before.items())


def test_the_drafter_clips_its_own_gradient_norm(tiny, monkeypatch):
    """At the drafter's optimizer step its gradient norm is at most its max_grad_norm, though unclipped it is
    larger; without the clip the hook would see the unclipped norm (as it does under a loose limit)."""
    t = online_trainer(tiny, monkeypatch, grpo__mini_batches=2)
    r = rollouts(t)
    batch = collate(r, t.learner.collate_spec)
    t.learner.stage_logprob(batch, capture=True)
    policy_gn = t.learner.stage_train(batch)["grad_norm"]
    cap = 0.05
    dt = DrafterTrainer(t.drafter, spec="eagle:x", learning_rate=1e-2, lr_factor=lambda s: 1.0, max_grad_norm=cap)
    seen = []

    def norm_at_step(opt, args, kwargs):
        grads = [p.grad for g in opt.param_groups for p in g["params"] if p.grad is not None]
        seen.append(float(torch.nn.utils.get_total_norm(grads)))

    dt.optimizer.register_step_pre_hook(norm_at_step)
    updates, loss = dt.train_online(t.learner.drafter_trainer.captures, batch.plan, 1, step=1)
    assert updates == 2 and loss > 0 and len(seen) == 2 and len(dt.grad_norms) == 2
    print(f"drafter gradient norms before clipping {dt.grad_norms}, the policy's {policy_gn:.3g}")
    assert all(gn > cap for gn in dt.grad_norms)  # the clip had something to do
    assert all(s <= cap * (1 + 1e-4) for s in seen), seen
    # with a loose limit the step sees the unclipped norm (the hook measures what clipping changes)
    loose = DrafterTrainer(t.drafter, spec="eagle:x", learning_rate=1e-2, lr_factor=lambda s: 1.0,
                           max_grad_norm=1e9)
    seen.clear()
    loose.optimizer.register_step_pre_hook(norm_at_step)
    loose.train_online(t.learner.drafter_trainer.captures, batch.plan[:1], 1, step=1)
    assert seen[0] == pytest.approx(loose.grad_norms[0], rel=1e-5) and seen[0] > cap


def test_resume_restores_the_drafter_optimizer_state(tiny, monkeypatch, tmp_path):
    """Checkpoint parts written through the store after one online step; a fresh learner that loads them holds
    the drafter's AdamW moments, and its next step on the same rollouts equals the uninterrupted learner's."""
    a = online_trainer(tiny, monkeypatch)
    a.step()
    parts = a.state_parts()
    assert set(parts) == {DCP_PART, "trainer"}  # model and both optimizers: one DCP directory
    ck = load_checkpoint(save_checkpoint(tmp_path / "ck", 1, parts))
    assert {k.split(".")[0] for k in read_model_tensors(ck.parts[DCP_PART])} == {"policy", "drafter"}
    b = online_trainer(tiny, monkeypatch)
    b.load_parts(ck.parts)
    da, db = a.learner.drafter_trainer.optimizer, b.learner.drafter_trainer.optimizer
    pa, pb = list(a.drafter.parameters()), list(b.drafter.parameters())
    assert len(b.learner.optimizer.param_groups) == 1 and len(db.param_groups) == 1
    assert all(int(db.state[q]["step"]) == 1 for q in pb)
    for p, q in zip(pa, pb, strict=True):
        assert all(torch.equal(da.state[p][k], db.state[q][k]) for k in ("exp_avg", "exp_avg_sq"))
    r = rollouts(a)
    a.learner.learn(r, SECONDS)
    b.learner.learn(r, SECONDS)
    assert all(torch.equal(v, b.drafter.state_dict()[k]) for k, v in a.drafter.state_dict().items())
    assert all(torch.equal(v, b.policy.state_dict()[k]) for k, v in a.policy.state_dict().items())


def test_a_dcp_checkpoint_holds_both_optimizers(tiny, monkeypatch, tmp_path):
    """The checkpoint format (DCP, written and read here by a single process with `save_dcp` / `load_dcp`): the
    policy's and the drafter's optimizer states both come back."""
    from specrl.checkpoint.sharded_state import load_dcp, save_dcp

    a = online_trainer(tiny, monkeypatch)
    a.step()
    save_dcp(str(tmp_path / "dcp"), a.policy, a.drafter, a.learner.optimizers)
    b = online_trainer(tiny, monkeypatch)
    load_dcp(tmp_path / "dcp", b.policy, b.drafter, b.learner.optimizers)
    for oa, ob, ma, mb in ((a.learner.optimizer, b.learner.optimizer, a.policy, b.policy),
                           (a.learner.drafter_trainer.optimizer, b.learner.drafter_trainer.optimizer, a.drafter,
                            b.drafter)):
        for p, q in zip(ma.parameters(), mb.parameters(), strict=True):
            assert torch.equal(p, q) and torch.equal(oa.state[p]["exp_avg_sq"], ob.state[q]["exp_avg_sq"])


def test_wants_capture_follows_the_mode_and_staleness(tiny, monkeypatch):
    every = online_trainer(tiny, monkeypatch).learner.drafter_trainer
    assert every.wants_capture(None) and every.wants_capture(2.0)
    on_stale = online_trainer(tiny, monkeypatch, drafter__online_mode="on_stale",
                              drafter__refresh_steps=2).learner.drafter_trainer
    assert not on_stale.wants_capture(None) and not on_stale.wants_capture(1.0)  # no reference yet
    on_stale.health.observe(2.0)
    assert on_stale.wants_capture(1.0) and not on_stale.wants_capture(1.9)
    frozen = online_trainer(tiny, monkeypatch, drafter__online=False).learner.drafter_trainer
    assert frozen.drafter is None and frozen.optimizer is None and not frozen.wants_capture(None)

"""Updates per batch inside a real learner: the fused one-update step, several updates with an acting clip, a
lag-1 step, the on_stale drafter mode and dynamic sampling, on the tiny random model."""

import copy

import pytest
import torch

from specrl.algorithms.batch import CollateSpec, collate, update_plan
from specrl.algorithms.rollouts import Rollouts
from specrl.drafters.training import trainer as drafter_trainer_mod
from specrl.errors import SpecRLError
from specrl.rollout.generation_metrics import SpecMetrics
from specrl.trainer.config_check import validate_config
from specrl.trainer.learner import Learner
from specrl.trainer.producer import EXTRA_REQUEST_BASE, fill_groups
from specrl.trainer.scoring import response_logprobs
from specrl.trainer.sync_trainer import GRPOTrainer
from tests.test_rl_trainer import cfg_dict, fake_acceptance, online_trainer
from tests.tiny import make_tiny_checkpoint

SECONDS = {"data": 0.0, "prepare": 0.0, "gen": 0.0}


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return make_tiny_checkpoint(tmp_path_factory.mktemp("tiny") / "ckpt", seed=0)


def trainer(tiny, **over) -> GRPOTrainer:
    return GRPOTrainer.from_config(validate_config(cfg_dict(tiny, **over)))


def rollouts(t: GRPOTrainer, push: bool = True, rewarded: bool = False) -> Rollouts:
    """A step's rollouts; `rewarded`: with rewards set by hand (the random tiny model earns none)."""
    idx = t.stage_data()
    if push:
        t.stage_prepare()
    r = t.stage_gen(idx)
    if rewarded:
        r.rewards = torch.tensor([1.0, 0.0, 0.0, 0.0, 0.0, 0.0, 1.0, 0.5])
    return r


def weights(m: torch.nn.Module) -> dict:
    return {k: v.detach().clone() for k, v in m.state_dict().items()}


@pytest.mark.parametrize("over", [{}, {"grpo__kl_coef": 0.1, "grpo__importance_sampling_correction": True}])
def test_one_update_folds_logprob_into_train(tiny, monkeypatch, over):
    """One optimizer step per batch: no logprob forward, and the same weights, bit for bit, as the two-stage
    step (logprob forward, then train) it replaces."""
    a, b = trainer(tiny, **over), trainer(tiny, **over)
    r = rollouts(a)
    batch = collate(r, b.learner.collate_spec)
    b.learner.stage_logprob(batch)
    b.learner.stage_train(batch)  # the two-stage reference
    calls = []
    monkeypatch.setattr(Learner, "stage_logprob", lambda self, batch, capture=None: calls.append(batch))
    rec, batch = a.learner.learn_batch(r, SECONDS)
    assert calls == [] and rec["logprob_skipped"] is True and rec["optimizer_steps"] == 1
    assert rec["stage_seconds"]["logprob"] < rec["stage_seconds"]["train"]  # collation only
    assert all(torch.equal(v, b.policy.state_dict()[k]) for k, v in a.policy.state_dict().items())
    assert rec["ratio_mean"] == 1.0 and rec["clip_fraction"] == 0.0
    assert 1.0 <= rec["token_mult_prob_error"] < 1.001  # from the train forward's detached log-probs
    assert not batch.old_logp.requires_grad and bool((batch.old_logp[batch.mask] < 0).all())
    if over:
        assert rec["kl"] == 0.0 and batch.ref_logp is not None  # the reference forward ran, in the train stage


def test_one_update_with_online_drafter_matches_two_stages(tiny, monkeypatch):
    """The drafter's inputs captured in the train forward (detached) train it exactly as the logprob stage's did."""
    a = online_trainer(tiny, monkeypatch)
    b = online_trainer(tiny, monkeypatch)
    r = rollouts(a)
    two = collate(r, b.learner.collate_spec)
    b.learner.stage_logprob(two, capture=True)
    b.learner.stage_train(two)
    assert b.learner.drafter_trainer.after_policy_update(two.plan, 1, None, 1)["draft_updates"] == 1
    rec, batch = a.learner.learn_batch(r, SECONDS)
    captures = a.learner.drafter_trainer.captures  # the drafter trainer keeps them; the batch holds no drafter state
    assert rec["logprob_skipped"] and rec["draft_updates"] == 1 and len(captures) == 2
    assert all(torch.equal(v, b.drafter.state_dict()[k]) for k, v in a.drafter.state_dict().items())
    assert all(torch.equal(v, b.policy.state_dict()[k]) for k, v in a.policy.state_dict().items())
    assert not any(t.requires_grad for c in captures for t in c.values())
    assert not hasattr(batch, "captured") and not hasattr(batch, "capture")


def test_clip_acts_on_the_second_iteration(tiny):
    """num_iterations=2 with a large learning rate: the second pass sees ratios outside [0.8, 1.28], the clip
    zeroes those tokens' gradient, and the weights differ from the same step with the clip opened wide."""
    over = {"grpo__num_iterations": 2, "policy__learning_rate": 3e-2}
    a, b = trainer(tiny, **over), trainer(tiny, **over, grpo__clip_low=0.999, grpo__clip_high=1e6)
    r = rollouts(a, rewarded=True)
    assert r.prompts == rollouts(b).prompts
    ra = a.learner.learn(r, SECONDS)
    rb = b.learner.learn(r, SECONDS)
    assert ra["logprob_skipped"] is False and ra["optimizer_steps"] == 2
    assert ra["clip_fraction"] > 0.05 and rb["clip_fraction"] == 0.0
    assert ra["ratio_mean"] != 1.0
    assert any(not torch.equal(v, b.policy.state_dict()[k]) for k, v in a.policy.state_dict().items())


def test_update_plan():
    assert update_plan(8, 1, 4) == [[[0, 1, 2, 3], [4, 5, 6, 7]]]
    assert update_plan(8, 2, 3) == [[[0, 1, 2], [3]], [[4, 5, 6], [7]]]
    assert update_plan(6, 4, 8) == [[[0, 1]], [[2, 3]], [[4]], [[5]]]  # a short batch: as even as possible
    assert update_plan(2, 4, 8) == [[[0]], [[1]]]


def _toy_rollouts(n: int = 8) -> Rollouts:
    prompts = [[1, 2, 3] for _ in range(n)]
    responses = [list(range(10, 10 + i % 4)) for i in range(n)]  # lengths 0..3: one row in four has no response
    return Rollouts(list(range(n)), prompts, responses, [[-0.5] * len(x) for x in responses], ["stop"] * n,
                    torch.arange(n, dtype=torch.float32), [False] * n, [None] * n)


def test_collate_gives_each_rank_its_share_and_the_whole_mini_batch_normaliser():
    """Two ranks: each holds half of every mini-batch, the plans line up, the normaliser is the whole mini-batch's
    over the world size, and the rows' lengths trim a micro-batch to its longest scored sequence."""
    r = _toy_rollouts()
    one = collate(r, CollateSpec(4, False, mini_batches=2, micro_size=2))
    assert one.plan == [[[0, 1], [2, 3]], [[4, 5], [6, 7]]] and one.ends == [0, 4, 5, 6, 0, 4, 5, 6]
    assert one.norms == [6.0, 6.0]  # response tokens per mini-batch
    ranks = [collate(r, CollateSpec(4, False, mini_batches=2, micro_size=2, rank=k, world_size=2)) for k in (0, 1)]
    assert [b.plan for b in ranks] == [[[[0, 1]], [[2, 3]]]] * 2 and [b.norms for b in ranks] == [[3.0, 3.0]] * 2
    assert torch.equal(torch.cat([ranks[0].tokens[:2], ranks[1].tokens[:2], ranks[0].tokens[2:],
                                  ranks[1].tokens[2:]]), one.tokens)
    assert ranks[1].ends == [5, 6, 5, 6]
    seqs = collate(r, CollateSpec(4, False, normalizer="max_tokens", max_new_tokens=16, world_size=2))
    assert seqs.norms == [8 * 16 / 2]


def test_collate_refuses_mini_batches_the_ranks_cannot_share():
    with pytest.raises(SpecRLError, match=r"\[4, 4\].*over 3") as e:  # the sizes, the world size, the setting
        collate(_toy_rollouts(), CollateSpec(4, False, mini_batches=2, rank=0, world_size=3))
    assert "grpo.mini_batches" in str(e.value)
    with pytest.raises(SpecRLError, match=r"rank 2 of world_size"):
        collate(_toy_rollouts(), CollateSpec(4, False, rank=2, world_size=2))
    with pytest.raises(SpecRLError, match=r"max_tokens normaliser needs"):
        collate(_toy_rollouts(), CollateSpec(4, False, normalizer="max_tokens"))


def test_mini_batches_step_the_optimizer_not_the_version(tiny):
    t = trainer(tiny, grpo__mini_batches=2, grpo__num_iterations=3, policy__lr_schedule="linear")
    lr0 = t.learner.optimizer.param_groups[0]["lr"]
    rec = t.step()
    assert rec["optimizer_steps"] == 6 and rec["lr"] == lr0
    p = next(t.policy.parameters())
    assert int(t.learner.optimizer.state[p]["step"]) == 6  # AdamW stepped 6 times
    assert t.learner.version == 1 and t.learner.scheduler.last_epoch == 1  # one RL step, one schedule step
    assert t.step()["policy_version"] == 1  # the next rollouts are version 1: lag checks count RL steps


def test_lag_one_step_with_two_iterations(tiny):
    """As the async learner actor: max_policy_lag=1, rollouts of version 0 trained at version 1 with mu=2. The
    proximal log-probs are the weights at the start of the step (not the behaviour policy's), the IS weights are
    proximal / behaviour, and the clip acts around the proximal policy."""
    t = trainer(tiny, grpo__num_iterations=2, grpo__importance_sampling_correction=True,
                policy__learning_rate=3e-2)
    t.learner.max_policy_lag = 1
    t.learner.learn(rollouts(t, rewarded=True), SECONDS)  # version 0 -> 1
    stale = rollouts(t, push=False, rewarded=True)  # the backend still holds version 0
    assert stale.policy_version == 0 and t.learner.version == 1
    start = copy.deepcopy(t.policy)
    rec, batch = t.learner.learn_batch(stale, SECONDS)
    assert rec["policy_lag"] == 1 and rec["optimizer_steps"] == 2 and not rec["logprob_skipped"]
    with torch.no_grad():
        for i in range(len(stale.prompts)):
            toks, m = batch.tokens[[i], : batch.ends[i]], batch.mask[[i], : batch.ends[i] - 1]
            lp, _ = response_logprobs(start, toks, m, 1.0)
            assert torch.allclose(batch.old_logp[i, : lp.shape[1]][m[0]], lp[0][m[0]], atol=1e-5)
    w = torch.exp(batch.old_logp - batch.gen_logp)[batch.mask].clamp(max=2.0)
    assert rec["is_ratio_mean"] == pytest.approx(float(w.mean()), rel=1e-4) and rec["is_ratio_mean"] != 1.0
    assert rec["clip_fraction"] > 0.0
    with pytest.raises(SpecRLError, match=r"\(lag 2;.*0\.\.1\)"):
        t.learner.learn(stale, SECONDS)


def test_on_stale_trains_the_drafter_only_when_acceptance_falls(tiny, monkeypatch):
    t = online_trainer(tiny, monkeypatch, drafter__online_mode="on_stale", drafter__refresh_steps=3)
    fake_acceptance(t, [2.0, 1.5])
    captures = []
    real = drafter_trainer_mod.draft_batch
    monkeypatch.setattr(drafter_trainer_mod, "draft_batch", lambda *a: captures.append(1) or real(*a))
    before = weights(t.drafter)
    rec1 = t.step()  # sets the reference AL: no drafter loss, no capture, drafter untouched
    assert rec1["draft_updates"] == 0 and rec1["draft_loss"] is None and captures == []
    assert all(torch.equal(v, t.drafter.state_dict()[k]) for k, v in before.items())
    rec2 = t.step()  # 1.5 < 0.85 x 2.0: stale, so this step captures and refreshes
    assert rec2["draft_refreshed"] and rec2["draft_updates"] == 3 and len(captures) == 2
    assert any(not torch.equal(v, t.drafter.state_dict()[k]) for k, v in before.items())


# ----------------------------------------------------------------------------- dynamic sampling

def fake_rollouts(step: int, prompts: list[int], rewards: list[float], n: int = 2, first_group: int = 0) -> Rollouts:
    k = len(prompts) * n
    metrics = SpecMetrics(0)
    metrics.generated_tokens = k
    return Rollouts([p for p in prompts for _ in range(n)], [[1, p] for p in prompts for _ in range(n)],
                    [[3]] * k, [[-1.0]] * k, ["stop"] * k, torch.tensor(rewards), [False] * k, [None] * k,
                    metrics.as_dict(), [0] * k, step, [first_group * n + i for i in range(k)], {}, [[0]] * k)


def test_fill_groups_counts_and_cap():
    cfg = validate_config({"grpo": {"num_prompts_per_step": 3, "num_generations": 2,
                                    "filter_zero_advantage_groups": True, "max_extra_prompt_draws": 4},
                           "policy": {"train_micro_batch_size": 2}})
    calls = []

    def generate(idx, first):  # the first extra prompt is informative, the rest constant
        calls.append((list(idx), first))
        rewards = [x for i, _ in enumerate(idx) for x in ((0.0, 1.0) if first + i == 3 else (1.0, 1.0))]
        return fake_rollouts(5, idx, rewards, first_group=first)

    r = fake_rollouts(5, [10, 11, 12], [0.0, 1.0, 1.0, 1.0, 0.0, 0.0])  # group 0 informative, 1 and 2 not
    out = fill_groups(cfg, 100, 5, r, generate)
    # round 1 draws 2 (the deficit), one is kept; round 2 draws 1, not kept; round 3 draws the last 1 -> cap
    assert [len(c[0]) for c in calls] == [2, 1, 1] and [c[1] for c in calls] == [3, 5, 6]
    assert out.dynamic_sampling == {"groups_trained": 2, "groups_filtered": 5, "extra_prompts_drawn": 4,
                                    "reward_mean_generated": pytest.approx(10 / 14)}
    assert out.problem_indices[:2] == [10, 10] and out.problem_indices[2] == calls[0][0][0]
    assert out.rewards.tolist() == [0.0, 1.0, 0.0, 1.0]
    assert not {10, 11, 12} & {i for c in calls for i in c[0]}  # extra prompts are new prompts
    assert out.engine_metrics["generated_tokens"] == 14  # every group generated, kept or not
    assert fill_groups(cfg, 100, 5, r, generate).problem_indices == out.problem_indices  # a pure function of step
    nothing = fill_groups(cfg, 100, 5, fake_rollouts(5, [1, 2, 3], [1.0] * 6),
                          lambda idx, first: fake_rollouts(5, idx, [0.0] * 2 * len(idx), first_group=first))
    assert nothing.dynamic_sampling["groups_trained"] == 0 and nothing.problem_indices == [1, 1, 2, 2, 3, 3]
    cfg.grpo.filter_zero_advantage_groups = False
    assert fill_groups(cfg, 100, 5, r, generate) is r


def test_dynamic_sampling_in_a_sync_step(tiny, tmp_path):
    """A reward that is constant for every third group scored (so the first group of the run is filtered): the
    trained step has only informative groups, extra groups carry ids of their own range, the record counts them."""
    fn = tmp_path / "reward.py"
    fn.write_text("import itertools\n"
                  "calls = itertools.count()\n"
                  "def reward(prompt, completion, row):\n"
                  "    if next(calls) // 4 % 3 == 0:\n"
                  "        return 0.5\n"
                  "    return float(sum(map(ord, completion)) % 3 == 0)\n")
    t = trainer(tiny, reward__functions=[f"{fn}:reward"], grpo__filter_zero_advantage_groups=True,
                grpo__max_extra_prompt_draws=6)
    rec = t.step()
    r = t.last_rollouts
    assert rec["extra_prompts_drawn"] >= 1 and rec["groups_filtered"] >= 1
    assert rec["groups_filtered"] == 2 + rec["extra_prompts_drawn"] - rec["groups_trained"]
    assert len(r.prompts) == 4 * (rec["groups_trained"] or 2)
    if rec["groups_trained"]:
        assert all(bool((g != g[0]).any()) for g in r.rewards.view(-1, 4))
    assert len(set(r.request_ids)) == len(r.request_ids)
    assert all(i < 8 or i >= EXTRA_REQUEST_BASE for i in r.request_ids)  # step 0's own ids, or the extra range
    assert rec["generated_tokens"] > sum(len(x) for x in r.responses)  # the filtered groups were generated too


def test_no_gradients_held_between_steps(tiny):
    """Each optimizer step frees the gradients it applied: between steps the learner holds weights and AdamW state,
    not a third copy of the policy's size."""
    t = trainer(tiny, grpo__mini_batches=2)
    batch = collate(rollouts(t, rewarded=True), t.learner.collate_spec)
    t.learner.stage_logprob(batch)
    t.learner.stage_train(batch)
    assert all(p.grad is None for p in t.policy.parameters())
    assert all(len(s) > 0 for s in t.learner.optimizer.state.values())  # the update did happen


@pytest.mark.parametrize("over", [{"generation__top_p": 0.9, "generation__top_k": 50},
                                  {"generation__top_k": 20}, {"generation__top_p": 0.7, "grpo__num_iterations": 2}])
def test_the_trainer_scores_tokens_under_the_samplers_filtered_distribution(tiny, over):
    """Rollout log-probs include top-p / top-k; the trainer's recomputation applies the same filter, so the
    importance ratio is 1 at lag 0 (fp32); temperature-only log-probs miss it by far (tools/logprob_match.py)."""
    t = trainer(tiny, **over)
    rec, batch = t.learner.learn_batch(rollouts(t), SECONDS)
    assert 1.0 <= rec["token_mult_prob_error"] <= 1.001, rec["token_mult_prob_error"]
    assert abs(rec["ratio_mean"] - 1.0) < 1e-3


def test_the_filtered_log_probs_are_the_samplers_and_train_the_kept_tokens_only():
    from specrl.algorithms.grpo import token_logprobs
    from specrl.algorithms.logprobs import head_logprobs
    from specrl.rollout.sampling import behaviour_logprobs, scaled_logits

    g = torch.Generator().manual_seed(0)
    hidden = torch.randn(40, 16, generator=g)
    head = torch.nn.Linear(16, 96, bias=False)
    targets = torch.randint(0, 96, (40,), generator=g)
    logits = head(hidden)
    n = logits.shape[0]
    scaled = scaled_logits(logits, torch.full((n,), 0.8), torch.full((n,), 0.9), torch.full((n,), 30))
    kept = torch.isfinite(scaled.gather(-1, targets[:, None]))[:, 0]
    want = behaviour_logprobs(logits, scaled, targets, torch.full((n,), 0.8))
    plain = token_logprobs(logits[None], targets[None], 0.8, 0.9, 30)[0]
    assert torch.allclose(plain[kept], want[kept].to(plain.dtype), atol=1e-5)
    assert bool(torch.isfinite(plain).all())  # a target outside the set keeps a finite log-probability
    # the chunked head (4 rows a chunk) gives the same values and gradients as the plain ops
    h1, h2 = hidden.clone().requires_grad_(), hidden.clone().requires_grad_()
    a, _ = head_logprobs(h1, head, targets, 0.8, top_p=0.9, top_k=30)
    b, _ = head_logprobs(h2, head, targets, 0.8, top_p=0.9, top_k=30, max_rows=4)
    (a * torch.arange(n)).sum().backward()
    (b * torch.arange(n)).sum().backward()
    assert torch.allclose(a, b, atol=1e-5) and torch.allclose(h1.grad, h2.grad, atol=1e-5)
    # tokens outside the kept set get no gradient through the normaliser
    z = logits.detach().clone().requires_grad_()
    token_logprobs(z[None], targets[None], 0.8, 0.9, 30)[0].sum().backward()
    support = torch.isfinite(scaled) | torch.nn.functional.one_hot(targets, 96).bool()
    assert bool((z.grad[~support] == 0).all()) and bool((z.grad[support] != 0).any())

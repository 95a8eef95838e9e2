"""In-flight weight updates (`pipeline.in_flight_updates`): new weights land between engine steps
inside a generate call, so one sequence spans two policy versions. Each token records the version that produced
it, its behaviour log-prob is that version's (with the KV cache the earlier version wrote, as it was sampled),
the learner's importance weights use those per-token behaviour log-probs, and the lag bound checks a sequence's
oldest version. Bad combinations are config errors naming both keys."""

import pytest
import torch

from specrl.algorithms.batch import collate
from specrl.algorithms.grpo import token_logprobs
from specrl.backends.registry import build_backend
from specrl.errors import SpecRLError
from specrl.model.hf_checkpoint import hf_named_tensors
from specrl.model.loader import load_model
from specrl.model.tokenizer import stop_token_ids
from specrl.trainer.config_check import validate_config
from specrl.trainer.learner import Learner
from specrl.trainer.producer import RolloutProducer
from tests.test_async import async_cfg
from tests.tiny import make_tiny_checkpoint

SWITCH = 4  # the hook loads version 1 at its 4th call (AR: tokens 0..4 come from version 0, tokens 5.. from 1)


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return make_tiny_checkpoint(tmp_path_factory.mktemp("tiny") / "ckpt", seed=0)


def inflight_cfg(tiny, **over):
    base = {"pipeline__in_flight_updates": True, "speculative__verify": "rejection", "speculative__drafter": "none",
            "generation__temperature": 1.0, "generation__max_new_tokens": 12}
    return async_cfg(tiny, lag=1, **{**base, **over})


def test_config_rules_name_both_keys(tiny):
    validate_config(inflight_cfg(tiny))
    with pytest.raises(SpecRLError, match=r"in_flight_updates=true.*verify=seed_exact.*"
                                          r"verify=rejection.*in_flight_updates=false"):
        validate_config(inflight_cfg(tiny, speculative__verify="seed_exact"))
    with pytest.raises(SpecRLError, match=r"in_flight_updates=true.*async pipeline.*mode=async"):
        validate_config(inflight_cfg(tiny, pipeline__mode="sync", pipeline__max_trajectory_age_steps=0,
                                     grpo__importance_sampling_correction=False))
    with pytest.raises(SpecRLError, match=r"pipeline.max_trajectory_age_steps=1 .* "
                                          r"grpo.importance_sampling_correction=true"):
        validate_config(inflight_cfg(tiny, grpo__importance_sampling_correction=False))
    from specrl.rollout.protocol import BackendCapabilities

    no = BackendCapabilities("vllm", ("rejection",), ("none",), 0, exact_seeds=False)
    with pytest.raises(SpecRLError, match=r"rollout worker:.*in_flight_updates=true.*vllm"):
        no.require(in_flight_updates=True, where="rollout worker")


@pytest.fixture(scope="module", params=["none", "ngram", "draft-model"])
def two_versions(tiny, request):
    """Version 0 = A, version 1 = B (A plus noise); rollouts of one step with B loaded mid-sequence, by plain
    decoding (one token per engine step) and by speculative decoding with rejection sampling: n-gram drafts (on
    the random tiny model nearly all rejected) and A itself as the draft model (all accepted until B arrives,
    then some: engine steps of up to 3 tokens on both sides of the switch)."""
    drafter = f"draft-model:{tiny}" if request.param == "draft-model" else request.param
    cfg = validate_config(inflight_cfg(tiny, speculative__drafter=drafter, speculative__num_draft_tokens=2,
                                       generation__max_new_tokens=24 if request.param == "draft-model" else 12))
    a, tok = load_model(cfg.model.name, dtype=torch.float32)
    b, _ = load_model(cfg.model.name, dtype=torch.float32)
    torch.manual_seed(3)
    with torch.no_grad():
        for p in b.parameters():
            p.add_(0.05 * torch.randn_like(p))
    backend = build_backend(cfg, a)
    calls = []

    def between_steps():
        calls.append(len(calls))
        if len(calls) == SWITCH:
            backend.load_weights("policy", hf_named_tensors(b), 1)

    backend.between_steps = between_steps
    producer = RolloutProducer(cfg, tok, backend, stop_token_ids(tok, a.args))
    r = producer.stage_gen(1, producer.stage_data())
    assert len(calls) >= SWITCH  # the engine called the hook between its steps
    return cfg, a, b, r


def _switch(versions: list[int]) -> int:
    """Index of the first token of version 1 (len if none)."""
    return versions.index(1) if 1 in versions else len(versions)


def test_tokens_after_the_update_carry_the_new_version(two_versions):
    cfg, _, _, r = two_versions
    for resp, versions in zip(r.responses, r.token_versions, strict=True):
        j = _switch(versions)
        assert versions == [0] * j + [1] * (len(resp) - j)  # one switch, never back
        if cfg.speculative.drafter == "none":  # one token per engine step: the switch lands after token SWITCH
            assert j == min(len(resp), SWITCH + 1)
        elif cfg.speculative.drafter.startswith("draft-model"):  # A drafts for A: 3 tokens a step until B comes
            assert j == min(len(resp), 1 + 3 * SWITCH) and r.engine_metrics["acceptance_length"] > 1.5
        else:  # up to k + 1 = 3 tokens per step: after the SWITCH + 1 first steps
            assert SWITCH + 1 <= j <= min(len(resp), 3 * (SWITCH + 1))
    assert sum(len(set(v)) > 1 for v in r.token_versions) >= 4  # most samples span both versions
    assert r.policy_versions == [0] * len(r.responses) and r.policy_version == 0  # a sample's oldest version


def _behaviour_reference(a, b, prompt: list[int], resp: list[int], j: int) -> torch.Tensor:
    """Log-probs of resp as the engine sampled them, token j being the first of version 1: token i comes from the
    forward at position len(prompt) + i - 1, which also wrote that position's KV, so A's forwards cover positions
    < len(prompt) + j - 1 and B's run on top of the KV cache A wrote."""
    toks = torch.tensor([prompt + resp])
    n_in, q = toks.shape[1] - 1, len(prompt) + j - 1  # input positions; A runs positions 0..q-1
    cache = a.new_cache(1, toks.shape[1] + 1)
    pos = torch.arange(n_in)[None]
    ha, _ = a.forward_hidden(toks[:, :q], pos[:, :q], cache.slots(0, 1), kv_len=q)
    hb, _ = b.forward_hidden(toks[:, q:n_in], pos[:, q:], cache.slots(0, 1), kv_len=n_in)
    logits = torch.cat([a.logits(ha), b.logits(hb)], 1)[:, len(prompt) - 1:]
    return token_logprobs(logits, toks[:, len(prompt):], 1.0)[0]


@torch.no_grad()
def test_behaviour_logprobs_are_each_tokens_generating_version(two_versions):
    _, a, b, r = two_versions
    checked = 0
    for prompt, resp, lp, versions in zip(r.prompts, r.responses, r.gen_logprobs, r.token_versions, strict=True):
        if _switch(versions) == len(resp):
            continue
        ref = _behaviour_reference(a, b, prompt, resp, _switch(versions))
        assert torch.allclose(torch.tensor(lp), ref, atol=1e-4)
        new = torch.tensor(versions) == 1
        toks = torch.tensor([prompt + resp])
        a_only = token_logprobs(a.logits(a.forward_hidden(toks)[0][:, len(prompt) - 1:-1]), toks[:, len(prompt):],
                                1.0)[0]
        assert torch.allclose(torch.tensor(lp)[~new], a_only[~new], atol=1e-4)  # version-0 tokens: A's
        assert not torch.allclose(torch.tensor(lp)[new], a_only[new], atol=1e-3)  # version-1 tokens: not A's
        checked += 1
    assert checked >= 4


def test_is_ratios_use_the_per_token_behaviour_logprobs(two_versions):
    """The learner at version 1 (B): importance weights exp(logp_B - behaviour) per token, where the behaviour
    log-prob is A's for version-0 tokens and B's (over A's cache) for version-1 tokens; lag = 1 from the oldest."""
    cfg, a, b, r = two_versions
    learner = Learner(cfg, b, max_policy_lag=1)
    learner.step_count = 1
    batch = collate(r, learner.collate_spec)
    learner.stage_logprob(batch)
    m = batch.mask
    behaviour = torch.zeros_like(batch.gen_logp)
    with torch.no_grad():
        for i, (prompt, resp, versions) in enumerate(zip(r.prompts, r.responses, r.token_versions, strict=True)):
            if _switch(versions) < len(resp):
                behaviour[i, len(prompt) - 1: len(prompt) - 1 + len(resp)] = _behaviour_reference(
                    a, b, prompt, resp, _switch(versions))
            else:  # all its tokens came from A
                toks = torch.tensor([prompt + resp])
                behaviour[i, len(prompt) - 1: len(prompt) - 1 + len(resp)] = token_logprobs(
                    a.logits(a.forward_hidden(toks)[0][:, len(prompt) - 1:-1]), toks[:, len(prompt):], 1.0)[0]
    assert torch.allclose(batch.gen_logp[m], behaviour[m], atol=1e-4)
    weights = torch.exp(batch.old_logp - behaviour)[m]
    capped = weights.clamp(max=cfg.grpo.importance_sampling_cap)
    rec = learner.learn(r, {"data": 0.0, "prepare": 0.0, "gen": 0.0})
    assert rec["policy_lag"] == 1 and rec["policy_version"] == 0
    assert rec["is_ratio_mean"] == pytest.approx(float(capped.mean()), rel=1e-3)
    assert rec["is_ratio_max"] == pytest.approx(float(capped.max()), rel=1e-3)
    # the lag bound counts from a sequence's oldest token: a learner two versions on refuses these rollouts,
    # although their newest tokens are only one version behind it
    late = Learner(cfg, b, max_policy_lag=1)
    late.step_count = 2
    with pytest.raises(SpecRLError, match=r"version 0\b.*\(lag 2"):
        late.learn(r, {"data": 0.0, "prepare": 0.0, "gen": 0.0})

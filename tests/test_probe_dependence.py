"""The probe's independence tests (`specrl.backends.probe_dependence`): exact samplers pass; samplers whose noise is
shared, between a prompt's continuations (each continuation alone is exact) or between two positions, fail them."""

from __future__ import annotations

import pytest
import torch

from specrl.backends.probe import probe_backend
from specrl.backends.probe_dependence import MIN_PAIRS, dependence_pairs, dependence_tests, pair_test
from specrl.drafters import NGramDrafter
from specrl.model.transformer import tiny_model
from specrl.rollout.engine import RolloutEngine
from specrl.rollout.protocol import BackendCapabilities, GenerationResult, RolloutOutput, RolloutRequest
from specrl.rollout.sampling import SamplingParams

PROMPTS = [[1, 2, 3, 1, 2, 3, 1, 2], [5, 6, 7, 8, 5, 6, 7], [9, 10, 9, 10, 9]]


@pytest.fixture(scope="module")
def target():
    return tiny_model("llama", vocab_size=64, seed=3)


def test_pair_test_accepts_independent_uniforms_and_rejects_equal_ones():
    g = torch.Generator().manual_seed(0)
    a, b = torch.rand(2000, generator=g), torch.rand(2000, generator=g)
    stat, dof, p, counts = pair_test(a, b)
    assert dof == 15 and sum(counts) == 2000 and p > 0.01
    assert pair_test(a, a)[2] < 1e-100  # every pair on the diagonal cells
    nan = a.clone()
    nan[:10] = float("nan")
    assert sum(pair_test(nan, b)[3]) == 1990  # pairs holding a NaN (out of support) are left out


def test_pairs_are_disjoint_neighbours_and_siblings():
    # 2 prompts with 3 and 2 rows of 5 tokens; u = 10 * row + position, so each value names its place
    u = torch.tensor([[10.0 * r + t for t in range(5)] for r in range(5)]).flatten()
    pairs = dependence_pairs(u, [3, 2], 5)
    a, b = pairs["serial"]
    assert a.tolist() == [10.0 * r + t for r in range(5) for t in (0, 2)]  # positions (0, 1), (2, 3); 4 unpaired
    assert b.tolist() == [10.0 * r + t for r in range(5) for t in (1, 3)]
    a, b = pairs["siblings"]
    # prompt 0: rows (0, 1), row 2 unpaired; prompt 1: rows (3, 4)
    assert a.tolist() == [10.0 * r + t for r in (0, 3) for t in range(5)]
    assert b.tolist() == [10.0 * r + t for r in (1, 4) for t in range(5)]


def test_dependence_tests_need_enough_pairs_and_the_right_shape():
    u = torch.rand(12 * 4, generator=torch.Generator().manual_seed(1))
    rows = dependence_tests(u, [6, 6], 4)
    assert [r["test"] for r in rows] == ["serial", "siblings"]
    assert all(not r["tested"] and r["p_value"] is None and r["pairs"] < MIN_PAIRS for r in rows)
    with pytest.raises(ValueError, match="13 rows"):
        dependence_tests(u, [6, 7], 4)


def test_native_speculative_sampling_passes_the_independence_tests(target):
    engine = RolloutEngine(target, max_batch_size=512, max_seq_len=64, drafter=NGramDrafter(), num_draft_tokens=3)
    r = probe_backend(engine, target, PROMPTS, SamplingParams(temperature=1.0, seed=1), num_samples=300,
                      num_tokens=6)
    assert r.passed, r.summary()
    assert [(d["test"], d["pairs"], d["tested"], d["rejected"]) for d in r.dependence] == \
        [("serial", 900, True, False), ("siblings", 900, True, False)]
    assert r.dependence_alpha == 1e-4 and "siblings p=" in r.summary()


class SharedSiblingNoise:
    """The native engine with a prompt's continuations paired on one request id: each sample is drawn exactly, but
    the two of a pair are the same sample (a request-id or seed collision in a GRPO group)."""

    capabilities = BackendCapabilities("shared", ("rejection",), ("none",), 0, exact_seeds=False)
    policy_version = 0

    def __init__(self, model):
        self.engine = RolloutEngine(model, max_batch_size=512, max_seq_len=64)

    def generate(self, requests, params):
        seen: dict[tuple, list[int]] = {}
        shared = []
        for r in requests:
            ids = seen.setdefault(tuple(r.prompt_token_ids), [])
            rid = ids[-1] if len(ids) % 2 else r.request_id  # a pair's second takes its first's id
            ids.append(rid)
            shared.append(RolloutRequest(list(r.prompt_token_ids), rid))
        out = self.engine.generate(shared, params)
        return GenerationResult([RolloutOutput(o.token_ids, o.logprobs, o.finish_reason) for o in out], out.metrics)

    def load_weights(self, which, named_tensors, version):
        raise NotImplementedError


class ReusedNoise:
    """Draws every token from the model by inverse CDF over tokens by descending probability, with one uniform for
    positions 2i and 2i + 1: the first of a pair is exact, the second's noise is already known from the first."""

    capabilities = BackendCapabilities("reused", ("rejection",), ("none",), 0, exact_seeds=False)
    policy_version = 0

    def __init__(self, model):
        self.model = model

    @torch.no_grad()
    def generate(self, requests, params):
        g = torch.Generator().manual_seed(7)
        outs = []
        for r in requests:
            toks = list(r.prompt_token_ids)
            for t in range(params.max_new_tokens):
                if t % 2 == 0:
                    u = float(torch.rand((), generator=g, dtype=torch.float64))
                logits, _ = self.model(torch.tensor([toks]))
                p, order = torch.softmax(logits[0, -1].double() / params.temperature, -1).sort(descending=True)
                i = int(torch.searchsorted(p.cumsum(0), torch.tensor([u * float(p.sum())], dtype=torch.float64)))
                toks.append(int(order[min(i, len(order) - 1)]))
            outs.append(RolloutOutput(toks[len(r.prompt_token_ids):], [0.0] * params.max_new_tokens, "length"))
        return GenerationResult(outs, {})

    def load_weights(self, which, named_tensors, version):
        raise NotImplementedError


def test_probe_fails_siblings_drawn_with_the_same_noise(target):
    # every continuation alone is drawn from the policy, but each is counted twice, which inflates every
    # statistic: only the siblings test is asked to fail, and it fails by far (p = 0 here)
    r = probe_backend(SharedSiblingNoise(target), target, PROMPTS, SamplingParams(temperature=1.0, seed=1),
                      num_samples=300, num_tokens=6)
    by = {d["test"]: d for d in r.dependence}
    assert by["siblings"]["tested"] and by["siblings"]["p_value"] < 1e-30, r.summary()
    assert by["siblings"]["rejected"] and not r.passed and "one prompt" in r.reason


def test_probe_fails_one_uniform_reused_for_two_positions(target):
    r = probe_backend(ReusedNoise(target), target, PROMPTS, SamplingParams(temperature=1.0), num_samples=300,
                      num_tokens=6)
    by = {d["test"]: d for d in r.dependence}
    assert by["serial"]["p_value"] < 1e-30 and not by["siblings"]["rejected"], r.summary()
    assert by["serial"]["rejected"] and not r.passed and "neighbouring tokens" in r.reason

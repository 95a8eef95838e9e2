"""The losslessness probe (`specrl.backends.probe`) without vLLM: it passes the native engine's speculative
sampling and fails backends that sample from a wrong distribution (the vLLM side: tests/test_backend_vllm.py)."""

from __future__ import annotations

import pytest
import torch

from specrl.backends.probe import detectable_w, probe_backend
from specrl.drafters import NGramDrafter
from specrl.errors import SpecRLError
from specrl.model.transformer import tiny_model
from specrl.rollout.engine import RolloutEngine
from specrl.rollout.protocol import BackendCapabilities, GenerationResult, RolloutOutput
from specrl.rollout.sampling import SamplingParams

PROMPTS = [[1, 2, 3, 1, 2, 3, 1, 2], [5, 6, 7, 8, 5, 6, 7], [9, 10, 9, 10, 9]]


@pytest.fixture(scope="module")
def target():
    return tiny_model("llama", vocab_size=64, seed=3)


class WrongTemperature:
    """Samples with the native engine at another temperature than asked: a lossy backend."""

    capabilities = BackendCapabilities("wrong", ("rejection",), ("none",), 0, exact_seeds=False)
    policy_version = 0

    def __init__(self, model, factor: float):
        self.engine = RolloutEngine(model, max_batch_size=512, max_seq_len=64)
        self.factor = factor

    def generate(self, requests, params):
        p = SamplingParams(temperature=params.temperature * self.factor, max_new_tokens=params.max_new_tokens,
                           seed=params.seed)
        r = self.engine.generate(requests, p)
        return GenerationResult([RolloutOutput(o.token_ids, o.logprobs, o.finish_reason) for o in r], r.metrics)

    def load_weights(self, which, named_tensors, version):
        raise NotImplementedError


@pytest.mark.parametrize("top_p,top_k", [(1.0, 0), (0.9, 0), (1.0, 5)])
def test_probe_passes_native_speculative_sampling(target, top_p, top_k):
    engine = RolloutEngine(target, max_batch_size=512, max_seq_len=64, drafter=NGramDrafter(), num_draft_tokens=3)
    r = probe_backend(engine, target, PROMPTS, SamplingParams(temperature=1.0, top_p=top_p, top_k=top_k, seed=1),
                      num_samples=300, num_tokens=6)
    assert r.passed, r.summary()
    assert r.num_tokens == 1800 and r.out_of_support == 0


def test_probe_fails_a_backend_sampling_at_the_wrong_temperature(target):
    r = probe_backend(WrongTemperature(target, 2.0), target, PROMPTS, SamplingParams(temperature=1.0),
                      num_samples=300, num_tokens=6)
    assert not r.passed and "unlikely tokens too often" in r.reason, r.summary()
    assert r.mean_logp_sampled < r.mean_logp_expected
    r = probe_backend(WrongTemperature(target, 0.5), target, PROMPTS, SamplingParams(temperature=1.0),
                      num_samples=300, num_tokens=6)
    assert not r.passed and "likely tokens too often" in r.reason, r.summary()


def test_probe_power_and_input_errors(target):
    # 1,800 tokens, 9 dof, alpha 1e-3: power 0.99 against w >= 0.164; the detectable w shrinks as 1/sqrt(N)
    assert detectable_w(1800, 9, 1e-3, 0.99) == pytest.approx(0.1637, abs=1e-3)
    assert detectable_w(7200, 9, 1e-3, 0.99) == pytest.approx(detectable_w(1800, 9, 1e-3, 0.99) / 2, rel=1e-6)
    engine = RolloutEngine(target, max_batch_size=8, max_seq_len=64)
    with pytest.raises(SpecRLError, match="temperature > 0"):
        probe_backend(engine, target, PROMPTS, SamplingParams(temperature=0.0))
    with pytest.raises(SpecRLError, match="num_tokens >= 2"):
        probe_backend(engine, target, PROMPTS, SamplingParams(), num_samples=3, num_tokens=1)


def test_probe_reference_pit_is_uniform_under_the_null(target):
    """Tokens drawn directly from the reference's own distributions give a passing, uniform histogram."""
    torch.manual_seed(0)

    class Exact:
        capabilities = BackendCapabilities("exact", ("rejection",), ("none",), 0, exact_seeds=False)
        policy_version = 0

        def generate(self, requests, params):
            outs = []
            for r in requests:
                toks = list(r.prompt_token_ids)
                for _ in range(params.max_new_tokens):
                    logits, _ = target(torch.tensor([toks]))
                    toks.append(int(torch.multinomial(torch.softmax(logits[0, -1] / params.temperature, -1), 1)))
                outs.append(RolloutOutput(toks[len(r.prompt_token_ids):], [0.0] * params.max_new_tokens, "length"))
            return GenerationResult(outs, {})

        def load_weights(self, which, named_tensors, version):
            raise NotImplementedError

    r = probe_backend(Exact(), target, PROMPTS, SamplingParams(temperature=0.8), num_samples=150, num_tokens=4)
    assert r.passed, r.summary()
    assert abs(r.mean_logp_sampled - r.mean_logp_expected) < 0.1


def test_vllm_backend_without_vllm_says_how_to_install(monkeypatch, tmp_path):
    import sys

    from specrl.backends.vllm import VLLMBackend, VLLMOptions, fused_group_errors

    monkeypatch.setitem(sys.modules, "vllm", None)  # as if vLLM were not installed
    (tmp_path / "config.json").write_text("{}")
    with pytest.raises(SpecRLError, match="make venv-vllm"):
        VLLMBackend(tmp_path)
    with pytest.raises(SpecRLError, match="tensor_parallel_size=1"):
        VLLMOptions(tensor_parallel_size=2)
    with pytest.raises(SpecRLError, match="no vLLM equivalent"):
        VLLMOptions(drafter="mtp:/x")
    with pytest.raises(SpecRLError, match="sampling_fix"):
        VLLMOptions(sampling_fix="maybe")
    names = [f"model.layers.0.self_attn.{x}_proj.weight" for x in "qkv"] + ["model.layers.0.mlp.up_proj.weight"]
    assert fused_group_errors(names[:3]) == []
    assert fused_group_errors(names[:1]) and fused_group_errors(names[3:])


def test_config_rollout_backend_dispatch_and_errors(monkeypatch):
    from specrl.backends import registry as backends
    from specrl.trainer.config_check import load_config

    cfg = load_config(None, ["rollout.backend=vllm", "run.steps=1"])
    called = {}

    class Fake:
        capabilities = BackendCapabilities("fake", ("rejection",), ("none",), 0, exact_seeds=False)

    monkeypatch.setitem(backends.BACKENDS, "vllm", lambda c, p: called.setdefault("vllm", (c, p)) and Fake())
    assert isinstance(backends.build_backend(cfg, object()), Fake)
    assert called["vllm"][0] is cfg
    with pytest.raises(SpecRLError, match="seed_exact is native-only"):
        load_config(None, ["rollout.backend=vllm", "speculative.drafter=ngram", "speculative.verify=seed_exact"])
    with pytest.raises(SpecRLError, match="auto is native-only"):
        load_config(None, ["rollout.backend=vllm", "speculative.drafter=ngram", "speculative.num_draft_tokens=auto"])
    with pytest.raises(SpecRLError, match=r"tensor_parallel_size: must be 1"):
        load_config(None, ["rollout.vllm.tensor_parallel_size=2"])
    with pytest.raises(SpecRLError, match=r"backend 'sglang'.*native, vllm"):
        load_config(None, ["rollout.backend=sglang"])
    with pytest.raises(SpecRLError, match=r"max_model_len \(64\).*max_seq_len"):
        load_config(None, ["rollout.backend=vllm", "rollout.vllm.max_model_len=64"])


@pytest.mark.parametrize("key", ["dtype", "max_model_len", "kv_cache_space_gib", "enforce_eager",
                                 "tensor_parallel_size", "sampling_fix", "probe", "probe_samples"])
def test_vllm_keys_outside_their_section_name_the_section(key):
    from specrl.trainer.config_check import load_config

    with pytest.raises(SpecRLError, match=rf"rollout\.{key}: unknown.*'rollout\.vllm\.{key}'"):
        load_config(None, [f"rollout.{key}=1"])


def test_the_sample_is_sized_from_the_target_bias_and_each_position_states_its_power(target):
    """tokens_needed inverts detectable_w (1 / w^2); the probe reports accepted drafts per depth and bonus tokens
    from the backend's metrics, and a depth with too few tokens for the target bias is not tested."""
    from specrl.backends.probe import position_power, tokens_needed

    n = tokens_needed(0.10, 9, 1e-3, 0.99)
    assert detectable_w(n, 9, 1e-3, 0.99) <= 0.10 < detectable_w(n - 1, 9, 1e-3, 0.99)
    assert tokens_needed(0.05, 9, 1e-3, 0.99) == pytest.approx(4 * n, rel=1e-3)
    with pytest.raises(SpecRLError, match=r"bias.*\(0, 1\].*\b0$"):
        tokens_needed(0, 9, 1e-3, 0.99)
    rows = position_power(10_000, [8_000, 100], 50, 9, 1e-3, 0.99, 0.10)
    assert [(r["position"], r["tokens"], r["tested"]) for r in rows] == [
        ("draft 1", 8_000, True), ("draft 2", 100, False), ("bonus", 50, False)]
    assert rows[1]["detectable_w"] == pytest.approx(detectable_w(10_000, 9, 1e-3, 0.99) * 100)
    assert position_power(10_000, [], None, 9, 1e-3, 0.99, 0.10) == []

    engine = RolloutEngine(target, max_batch_size=512, max_seq_len=64, drafter=NGramDrafter(), num_draft_tokens=3,
                           k_max=3)
    r = probe_backend(engine, target, PROMPTS, SamplingParams(temperature=1.0, seed=1), num_samples=150,
                      num_tokens=6, target_w=0.3)
    assert r.passed and len(r.accepted_per_position) == 3 and r.bonus_tokens is not None
    assert sum(r.accepted_per_position) + r.bonus_tokens <= r.num_tokens
    # the engine's drafter was watched: every tested token has its role, each role its own test
    assert [p["position"] for p in r.positions] == ["plain", "draft 1", "draft 2", "draft 3", "bonus", "no draft"]
    assert sum(p["tokens"] for p in r.positions) == r.num_tokens and r.pooled_alpha == r.alpha / 2
    by = {p["position"]: p for p in r.positions}
    assert by["draft 1"]["tokens"] >= min(r.accepted_per_position[0], 1) and by["plain"]["tokens"] >= 150
    assert all(p["tested"] == (p["detectable_w"] <= 0.3) and not p["rejected"] for p in r.positions)
    assert all(p["p_value"] is None for p in r.positions if p["tokens"] < 50)
    assert set(r.draft_lengths) <= {0, 1, 2, 3} and sum(r.k_histogram.values()) > 0
    assert r.as_dict()["positions"] == r.positions


def test_holm_and_a_bias_confined_to_one_position():
    """Holm's step-down decisions; a bias on 300 of 10,300 tokens (one position) that the pooled test misses is
    caught by that position's own test, and no other position is rejected."""
    from scipy.stats import chi2

    from specrl.backends.probe_positions import holm, position_tests

    assert holm([0.001, 0.02, 0.04], 0.05) == [True, True, True]
    assert holm([0.001, 0.03, 0.04], 0.05) == [True, False, False]  # 0.03 > 0.05 / 2 stops the procedure
    assert holm([0.5, 0.2], 0.05) == [False, False]
    g = torch.Generator().manual_seed(0)
    u = torch.cat([torch.rand(10_000, generator=g), 0.7 + 0.3 * torch.rand(300, generator=g)])
    codes = torch.cat([torch.zeros(10_000, dtype=torch.long), torch.full((300,), 3)])  # k_max = 2: 3 is the bonus
    counts = torch.histc(u, bins=10, min=0.0, max=1.0)
    pooled = chi2.sf(float(((counts - 1030) ** 2 / 1030).sum()), 9)
    rows = {r["position"]: r for r in position_tests(u, codes, 2, 10, 5e-4, 0.99, 0.10)}
    assert rows["bonus"]["rejected"] and not rows["plain"]["rejected"] and rows["bonus"]["p_value"] < 1e-20
    assert rows["draft 1"]["tokens"] == 0 and rows["draft 1"]["p_value"] is None and not rows["draft 1"]["tested"]
    assert rows["plain"]["tested"] and not rows["bonus"]["tested"]  # 300 tokens cannot detect w = 0.10
    assert pooled > 5e-4  # the pooled test alone would pass it


def test_each_token_gets_the_role_its_verify_step_gave_it():
    """token_roles: a verify step's row (request id, first draft position, real drafts d, emitted e) gives its
    tokens draft 1..d in order and the bonus after all d; a row with d = 0 is "no draft"; tokens no verify step
    emitted (the prefill's, plain steps') stay plain; tokens past the tested length are dropped."""
    from specrl.backends.probe_positions import role_names, token_roles

    k_max = 3
    names = role_names(k_max)
    assert names == ["plain", "draft 1", "draft 2", "draft 3", "bonus", "no draft"]
    # request 7: prompt of 4 tokens, sample 0; request 8: prompt of 2 tokens, sample 1
    rows = [(7, 5, 3, 2),  # output index 1: drafts 1 and 2 (the second a replacement: e < d + 1)
            (7, 7, 2, 3),  # output index 3: drafts 1, 2 and the bonus
            (8, 3, 0, 1),  # output index 1: a row with no drafts
            (8, 6, 3, 4),  # output index 4: 4 tokens, the last 2 past the 6 tested
            (99, 0, 1, 1)]  # not a probe request: ignored
    codes, lengths = token_roles(rows, {7: 4, 8: 2}, {7: 0, 8: 1}, 2, 6, k_max)
    assert [[names[c] for c in row] for row in codes] == [
        ["plain", "draft 1", "draft 2", "draft 1", "draft 2", "bonus"],
        ["plain", "no draft", "plain", "plain", "draft 1", "draft 2"]]
    assert lengths == {0: 1, 2: 1, 3: 2}

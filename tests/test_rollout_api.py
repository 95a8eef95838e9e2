"""The rollout backend protocol: the native engine implements it, capabilities are enforced, weights carry
versions, behaviour log-probs are the processed distribution's, and a trainer runs on a protocol-only backend."""

import pytest
import torch

from specrl import RolloutEngine, SamplingParams
from specrl.errors import SpecRLError
from specrl.model.hf_checkpoint import hf_named_tensors
from specrl.model.transformer import tiny_model
from specrl.rollout.protocol import BackendCapabilities, GenerationResult, RolloutBackend, RolloutRequest
from specrl.rollout.sampling import probs_from_logits

PROMPTS = [[1, 2, 3], [4, 5, 6, 7], [8]]


@pytest.fixture(scope="module")
def model():
    return tiny_model(vocab_size=64, seed=0)


def test_native_engine_is_a_rollout_backend(model):
    e = RolloutEngine(model, max_batch_size=4, max_seq_len=64)
    assert isinstance(e, RolloutBackend)
    caps = e.capabilities
    assert caps.name == "native" and "seed_exact" in caps.verify_modes and caps.exact_seeds
    assert set(caps.drafter_kinds) >= {"none", "ngram", "suffix", "draft-model", "eagle", "mtp"}
    res = e.generate([RolloutRequest(p, 10 + i) for i, p in enumerate(PROMPTS)], SamplingParams(max_new_tokens=5))
    assert isinstance(res, GenerationResult) and len(res) == 3 and res.policy_versions == [0, 0, 0]
    assert res.metrics["generated_tokens"] == sum(len(o.token_ids) for o in res) == 15
    assert not hasattr(e, "last_metrics")  # no side channel: the result carries the metrics
    # plain token lists are requests with request id = index
    again = e.generate([PROMPTS[1]], SamplingParams(max_new_tokens=5))
    alone = e.generate([RolloutRequest(PROMPTS[1], 0)], SamplingParams(max_new_tokens=5))
    assert again[0].token_ids == alone[0].token_ids


def test_capabilities_require_names_request_and_offer():
    caps = BackendCapabilities("vllm", ("rejection",), ("none", "ngram", "eagle"), 5, exact_seeds=False)
    caps.require(verify="rejection", drafter="eagle:/x", k=5)  # all offered
    with pytest.raises(SpecRLError, match=r"verify='seed_exact'.*vllm.*\['rejection'\]"):
        caps.require(verify="seed_exact", where="speculative")
    with pytest.raises(SpecRLError, match=r"'mtp:/d'.*vllm.*'ngram', 'eagle'"):
        caps.require(drafter="mtp:/d")
    with pytest.raises(SpecRLError, match=r"num_draft_tokens=6.*vllm.*\(5\)"):
        caps.require(k=6)
    with pytest.raises(SpecRLError, match=r"seeds.*not exact.*vllm"):
        caps.require(exact_seeds=True)


def test_load_weights_hf_names_and_versions(model):
    e = RolloutEngine(tiny_model(vocab_size=64, seed=1), max_batch_size=4, max_seq_len=64)
    sp = SamplingParams(temperature=0, max_new_tokens=8)
    ref = RolloutEngine(model, max_batch_size=4, max_seq_len=64).generate(PROMPTS, sp)
    named = hf_named_tensors(model)
    assert all(n.startswith(("model.", "lm_head")) for n in named)
    e.load_weights("policy", named, version=3)
    out = e.generate(PROMPTS, sp)
    assert [o.token_ids for o in out] == [o.token_ids for o in ref] and out.policy_versions == [3, 3, 3]
    with pytest.raises(SpecRLError, match="which='optimizer'; use one of"):
        e.load_weights("optimizer", named, 4)
    with pytest.raises(SpecRLError, match=r"version.*>= 0, got -1"):
        e.load_weights("policy", named, -1)
    with pytest.raises(SpecRLError, match="missing: \\['model.norm.weight'\\]"):
        e.load_weights("policy", {k: v for k, v in named.items() if k != "model.norm.weight"}, 4)
    with pytest.raises(SpecRLError, match="no drafter with weights"):
        e.load_weights("drafter", {}, 4)
    assert e.policy_version == 3  # a refused load changes nothing


@pytest.mark.parametrize("top_p,top_k", [(0.6, 0), (1.0, 5), (0.8, 10)])
def test_behaviour_logprobs_are_the_processed_distribution(model, top_p, top_k):
    """With top-p < 1 / top-k the behaviour log-prob is log of the renormalised truncated distribution, which
    is >= the full tempered log-prob the trainer recomputes (and differs from it)."""
    e = RolloutEngine(model, max_batch_size=4, max_seq_len=64)
    sp = SamplingParams(temperature=0.8, top_p=top_p, top_k=top_k, max_new_tokens=12, seed=4)
    differs = False
    for p, o in zip(PROMPTS, e.generate(PROMPTS, sp), strict=True):
        seq = torch.tensor([p + o.token_ids])
        with torch.no_grad():
            logits, _ = model(seq)
        rows = logits[0, len(p) - 1:-1]
        n = rows.shape[0]
        probs = probs_from_logits(rows, torch.full((n,), 0.8), torch.full((n,), top_p),
                                  torch.full((n,), top_k, dtype=torch.long))
        tok = torch.tensor(o.token_ids)
        behaviour = probs.gather(-1, tok[:, None]).squeeze(-1).log()
        full = torch.log_softmax(rows / 0.8, -1).gather(-1, tok[:, None]).squeeze(-1)
        got = torch.tensor(o.logprobs)
        assert torch.allclose(got, behaviour, atol=1e-5)
        assert bool((got >= full - 1e-6).all())
        differs |= bool((got - full).abs().max() > 1e-3)
    assert differs


class ProtocolOnly:
    """Wraps a backend and exposes nothing but the protocol: a trainer must not need more."""

    def __init__(self, inner):
        self._inner = inner
        self.capabilities = inner.capabilities
        self.calls = []

    @property
    def policy_version(self):
        return self._inner.policy_version

    def generate(self, requests, params):
        self.calls.append("generate")
        return self._inner.generate(requests, params)

    def load_weights(self, which, named_tensors, version):
        self.calls.append(f"load_weights:{which}:{version}")
        return self._inner.load_weights(which, named_tensors, version)


def test_trainer_runs_on_a_protocol_only_backend(tmp_path):
    from specrl.backends.registry import build_backend
    from specrl.model.loader import load_model
    from specrl.trainer.config_check import validate_config
    from specrl.trainer.sync_trainer import GRPOTrainer
    from tests.test_rl_trainer import cfg_dict
    from tests.tiny import make_tiny_checkpoint

    tiny = make_tiny_checkpoint(tmp_path / "ckpt")
    cfg = validate_config(cfg_dict(tiny, speculative__drafter="ngram", speculative__num_draft_tokens=2))
    policy, _ = load_model(cfg.model.name, dtype=torch.float32)
    backend = ProtocolOnly(build_backend(cfg, policy))
    t = GRPOTrainer.from_config(cfg, backend=backend)
    recs = [t.step() for _ in range(2)]
    assert [r["policy_version"] for r in recs] == [0, 1] and all(r["policy_lag"] == 0 for r in recs)
    assert backend.calls == ["load_weights:policy:0", "generate", "load_weights:policy:1", "generate"]
    # a backend that lacks what the config asks for is refused before any step, naming both
    limited = ProtocolOnly(build_backend(cfg, policy))
    limited.capabilities = BackendCapabilities("limited", ("rejection",), ("none", "ngram"), 7, False)
    with pytest.raises(SpecRLError, match=r"verify='seed_exact'.*not offered.*limited"):
        GRPOTrainer.from_config(cfg, backend=limited)


def test_local_weight_sync_versions(model):
    from specrl.trainer.weight_sync import LocalWeightSync

    e = RolloutEngine(tiny_model(vocab_size=64, seed=1), max_batch_size=2, max_seq_len=32)
    sync = LocalWeightSync(e)
    with pytest.raises(SpecRLError, match=r"version 0\b.*never pushed"):
        sync.wait_for(0)
    sync.push(2, hf_named_tensors(model))
    assert sync.wait_for(1) == 2 and e.policy_version == 2
    with pytest.raises(SpecRLError, match=r"version 1\b.*older.*\b2\b"):
        sync.push(1, hf_named_tensors(model))
    with pytest.raises(SpecRLError, match=r"version 3\b.*never pushed"):
        sync.wait_for(3)

"""Refit acknowledgement: every `load_weights` returns the digest of what the backend holds, and the publisher
refuses a load that was dropped, partial, went to the wrong layer name or reported an old version as new — in
the step it happens, before a rollout is generated. Native engine (LocalWeightSync, the sync trainer) here; the
async workers in test_refit_ack_async below; vLLM in tests/test_backend_vllm_refit.py."""

from __future__ import annotations

import pytest
import torch

import specrl.rollout.engine as engine_mod
from specrl import RolloutEngine
from specrl.drafters.kinds.eagle import EagleDrafter
from specrl.model.hf_checkpoint import hf_named_tensors
from specrl.model.transformer import tiny_model
from specrl.rollout.digest import SAMPLE, RefitError, check_refit, tensor_digest, weights_digest
from specrl.trainer.weight_sync import LocalWeightSync


def _perturbed(named, seed):
    g = torch.Generator().manual_seed(seed)
    return {k: v + 0.01 * torch.randn(v.shape, generator=g, dtype=v.dtype) if v.is_floating_point() else v
            for k, v in named.items()}


@pytest.fixture
def setup():
    policy = tiny_model("llama", vocab_size=64, seed=3, num_layers=4)
    engine = RolloutEngine(tiny_model("llama", vocab_size=64, seed=3, num_layers=4), max_batch_size=2,
                           max_seq_len=32, drafter=EagleDrafter(tiny_model("llama", vocab_size=64, seed=3,
                                                                           num_layers=4)))
    drafter = {k: v.detach().clone() for k, v in engine.drafter.state_dict().items()}
    return engine, hf_named_tensors(policy), drafter


def test_digest_sees_dtype_shape_and_sampled_values():
    t = torch.randn(300, 7)
    d = tensor_digest(t)
    assert d.startswith("float32[300, 7]:") and tensor_digest(t.clone()) == d
    assert tensor_digest(t.to(torch.bfloat16)) == tensor_digest(t, torch.bfloat16) != d
    assert tensor_digest(t.reshape(7, 300)) != d
    u = t.clone()
    u.view(-1)[-1] += 1  # the last element is always sampled
    assert tensor_digest(u) != d
    small = torch.arange(SAMPLE, dtype=torch.float32)
    for i in range(SAMPLE):  # a tensor of <= SAMPLE elements is hashed whole
        s = small.clone()
        s[i] = -1
        assert tensor_digest(s) != tensor_digest(small)


def test_a_good_refit_is_acknowledged_with_the_cast_applied(setup):
    engine, policy, drafter = setup
    engine.model.to(torch.bfloat16)  # the backend holds bf16: the publisher's fp32 tensors compare after the cast
    sync = LocalWeightSync(engine)
    new = _perturbed(policy, 1)
    sync.push(1, new, _perturbed(drafter, 2))
    ack = engine.weights_digest("policy")
    check_refit(new, ack, "policy", "native", 1)
    assert all(v.startswith("bfloat16") for v in ack.values())


def _patch_load_state_into(monkeypatch, fault):
    real = engine_mod.load_state_into

    def faulty(model, state, where):
        return fault(real, model, state, where)

    monkeypatch.setattr(engine_mod, "load_state_into", faulty)


def test_dropped_drafter_refit_is_caught(setup, monkeypatch):
    engine, policy, drafter = setup
    sync = LocalWeightSync(engine)
    sync.push(1, policy, drafter)
    monkeypatch.setattr(engine_mod, "copy_state", lambda *a, **k: None)  # the drafter load silently does nothing
    with pytest.raises(RefitError, match=r"\(drafter, version 2\).*\bfc\."):
        sync.push(2, _perturbed(policy, 1), _perturbed(drafter, 2))
    assert sync.version == 1  # the failed version never became live


def test_partial_policy_load_is_caught(setup, monkeypatch):
    engine, policy, drafter = setup
    sync = LocalWeightSync(engine)
    sync.push(1, policy, drafter)
    names = sorted(policy)
    half = set(names[::2])

    def partial(real, model, state, where):  # only every other tensor is copied
        held = hf_named_tensors(model)
        real(model, {k: (v if k in half else held[k].clone()) for k, v in state.items()}, where)

    _patch_load_state_into(monkeypatch, partial)
    with pytest.raises(RefitError, match=rf"version 2\).*native.*\({len(names) - len(half)} tensor"):
        sync.push(2, _perturbed(policy, 1), drafter)


def test_load_into_the_wrong_layer_name_is_caught(setup, monkeypatch):
    engine, policy, drafter = setup
    sync = LocalWeightSync(engine)
    a, b = "model.layers.0.mlp.down_proj.weight", "model.layers.1.mlp.down_proj.weight"

    def swapped(real, model, state, where):
        real(model, {**state, a: state[b], b: state[a]}, where)

    _patch_load_state_into(monkeypatch, swapped)
    with pytest.raises(RefitError, match=r"\b2 tensor.*down_proj.*down_proj") as e:
        sync.push(1, _perturbed(policy, 1), drafter)
    assert all(f"model.layers.{i}.mlp.down_proj.weight" in str(e.value) for i in (0, 1))


def test_old_version_reported_as_new_is_caught(setup, monkeypatch):
    engine, policy, drafter = setup
    sync = LocalWeightSync(engine)
    sync.push(1, policy, drafter)
    _patch_load_state_into(monkeypatch, lambda real, model, state, where: None)  # keeps version 1's weights
    with pytest.raises(RefitError, match=r"\(policy, version 2\).*native"):
        sync.push(2, _perturbed(policy, 1), drafter)


def test_a_backend_without_an_acknowledgement_or_with_missing_names_is_refused(setup):
    engine, policy, _ = setup

    class Silent:
        def load_weights(self, which, named, version):
            engine.load_weights(which, named, version)

    with pytest.raises(RefitError, match=r"Silent backend.*no acknowledgement"):
        LocalWeightSync(Silent()).push(1, policy)
    ack = weights_digest({k: v for k, v in policy.items() if "layers.1." not in k})
    with pytest.raises(RefitError, match=r"not held.*layers\.1\."):
        check_refit(policy, ack, "policy", "test", 1)


def test_sync_trainer_stops_in_the_step_whose_refit_fails(tmp_path, monkeypatch):
    from specrl.trainer.config_check import validate_config
    from specrl.trainer.sync_trainer import GRPOTrainer
    from tests.test_rl_trainer import cfg_dict
    from tests.tiny import make_tiny_checkpoint

    tiny = make_tiny_checkpoint(tmp_path / "ck")
    t = GRPOTrainer.from_config(validate_config(cfg_dict(tiny, speculative__drafter="ngram",
                                                         speculative__num_draft_tokens=2)))
    t.step()
    with torch.no_grad():  # an update the rollout side must pick up (step 1's may be zero: equal rewards)
        for p in t.learner.policy.parameters():
            p.add_(0.01)
    gens = []
    real_gen = t.stage_gen
    monkeypatch.setattr(t, "stage_gen", lambda idx: gens.append(1) or real_gen(idx))
    _patch_load_state_into(monkeypatch, lambda real, model, state, where: None)
    with pytest.raises(RefitError, match=r"\(policy, version 1\).*native"):
        t.step()
    assert gens == []  # no rollout of step 2 was generated


def test_vllm_worker_digest_maps_fused_rows_padded_vocab_and_opaque_weights():
    """`held_digest` (the vLLM worker's acknowledgement, plain torch): q/k/v and gate/up rows of fused
    parameters, an embedding padded to 64 rows, and a weight replaced by a prepacked handle (empty)."""
    from specrl.backends.vllm_worker import held_digest
    from specrl.rollout.digest import OPAQUE

    g = torch.Generator().manual_seed(0)
    q, k, v, gate, up, emb = (torch.randn(r, 4, generator=g) for r in (8, 2, 2, 6, 6, 10))
    params = {"model.layers.0.self_attn.qkv_proj.weight": torch.cat([q, k, v]),
              "model.layers.0.mlp.gate_up_proj.weight": torch.cat([gate, up]),
              "model.embed_tokens.weight": torch.cat([emb, torch.zeros(54, 4)]),
              "model.layers.0.mlp.down_proj.weight": torch.empty(0)}
    sent = {"model.layers.0.self_attn.q_proj.weight": q, "model.layers.0.self_attn.k_proj.weight": k,
            "model.layers.0.self_attn.v_proj.weight": v, "model.layers.0.mlp.gate_proj.weight": gate,
            "model.layers.0.mlp.up_proj.weight": up, "model.embed_tokens.weight": emb,
            "model.layers.0.mlp.down_proj.weight": torch.randn(4, 6, generator=g)}
    ack = held_digest(params, [(n, list(t.shape)) for n, t in sent.items()])
    assert ack["model.layers.0.mlp.down_proj.weight"] == OPAQUE
    check_refit(sent, ack, "policy", "vllm", 1)
    for name in ("model.layers.0.self_attn.k_proj.weight", "model.layers.0.mlp.up_proj.weight",
                 "model.embed_tokens.weight"):
        bad = {**sent, name: sent[name] + 1}
        with pytest.raises(RefitError, match=rf"\b1 tensor.*other values.*{name}"):
            check_refit(bad, ack, "policy", "vllm", 1)
    del params["model.layers.0.mlp.gate_up_proj.weight"]
    with pytest.raises(RefitError, match=r"\b2 sent.*not held"):
        check_refit(sent, held_digest(params, [(n, list(t.shape)) for n, t in sent.items()]), "policy", "vllm", 1)


class _Packed(torch.nn.Module):
    """A layer whose weight lives only in a packed kernel (the parameter is empty), as vLLM's CPU linears."""

    def __init__(self, w):
        super().__init__()
        self.weight = torch.nn.Parameter(torch.empty(0), requires_grad=False)
        packed = w.clone()
        self.quant_method = type("Method", (), {"apply": staticmethod(lambda layer, x, bias=None: x @ packed.t())})()
        self.packed = packed


def test_a_prepacked_weight_and_a_tied_heads_packed_copy_are_read_back_and_compared():
    """A prepacked weight and the tied LM head's packed copy of the embedding are compared through their kernels,
    so a stale kernel (the failure vLLM's CPU reload had: log-probs off by 0.14) fails the refit."""
    from specrl.backends.vllm_worker import held_digest
    from specrl.rollout.digest import HEAD_SUFFIX, READBACK

    g = torch.Generator().manual_seed(0)
    gate, up, down, emb = (torch.randn(r, c, generator=g) for r, c in ((6, 4), (6, 4), (4, 6), (10, 4)))
    gate_up, down_l, head = _Packed(torch.cat([gate, up])), _Packed(down), _Packed(torch.cat([emb, torch.zeros(6, 4)]))
    modules = {"model.layers.0.mlp.gate_up_proj": gate_up, "model.layers.0.mlp.down_proj": down_l, "lm_head": head}
    params = {"model.layers.0.mlp.gate_up_proj.weight": gate_up.weight, "model.layers.0.mlp.down_proj.weight":
              down_l.weight, "model.embed_tokens.weight": torch.cat([emb, torch.zeros(6, 4)])}
    sent = {"model.layers.0.mlp.gate_proj.weight": gate, "model.layers.0.mlp.up_proj.weight": up,
            "model.layers.0.mlp.down_proj.weight": down, "model.embed_tokens.weight": emb}
    shapes = [(n, list(t.shape)) for n, t in sent.items()]
    ack = held_digest(params, shapes, modules)
    assert all(ack[n].startswith(READBACK) for n in sent if "mlp" in n)
    assert ack["model.embed_tokens.weight" + HEAD_SUFFIX].startswith(READBACK)
    check_refit(sent, ack, "policy", "vllm", 1)
    for name, layer, rows in (("model.layers.0.mlp.up_proj.weight", gate_up, slice(6, 12)),
                              ("model.layers.0.mlp.down_proj.weight", down_l, slice(0, 4)),
                              ("model.embed_tokens.weight" + HEAD_SUFFIX, head, slice(0, 10))):
        stale = layer.packed.clone()
        layer.packed[rows] *= 1.05  # the kernel holds other values than the parameter was sent
        with pytest.raises(RefitError, match=rf"\b1 tensor.*other values.*{name}"):
            check_refit(sent, held_digest(params, shapes, modules), "policy", "vllm", 1)
        layer.packed.copy_(stale)

"""Packed bf16 inference linears (`specrl.model.packed`): bitwise the plain forward, never stale, training and
copying untouched, and the engine's outputs unchanged by packing."""

import copy
import io

import pytest
import torch
from torch import nn

from specrl import RolloutEngine, SamplingParams
from specrl.model import packed
from specrl.model.packed import PackedLinear, pack_for_inference, unpack
from specrl.model.transformer import tiny_model
from tests.tiny import prefill_and_decode

pytestmark = pytest.mark.skipif(not packed.supported(torch.bfloat16, "cpu"), reason="no oneDNN bf16 on this CPU")


def _bf16(arch="llama", seed=0):
    return tiny_model(arch, vocab_size=96, seed=seed).to(torch.bfloat16)


@pytest.mark.parametrize("arch", ["llama", "qwen2", "qwen3"])
def test_packed_forward_is_bitwise_the_plain_forward(arch):
    model = _bf16(arch)
    tokens = torch.randint(0, 96, (3, 7), generator=torch.Generator().manual_seed(1))
    want = prefill_and_decode(model, tokens)
    n = pack_for_inference(model)
    assert n == 4 * 7 + 1  # 7 linears per layer, 4 layers, the LM head
    assert all(isinstance(m, PackedLinear) for m in model.modules() if isinstance(m, nn.Linear))
    got = prefill_and_decode(model, tokens)
    for w, g in zip(want, got, strict=True):
        assert torch.equal(w, g)
    # and the packed path really ran (else this test would prove nothing)
    assert packed._CACHE.get(model.layers[0].self_attn) and "qkv" in packed._CACHE[model.layers[0].self_attn]
    assert "gate_up" in packed._CACHE[model.layers[0].mlp] and "w" in packed._CACHE[model.lm_head]


def test_weight_changes_in_place_are_picked_up():
    model = _bf16()
    pack_for_inference(model)
    tokens = torch.randint(0, 96, (2, 5), generator=torch.Generator().manual_seed(2))
    before = prefill_and_decode(model, tokens)
    other = _bf16(seed=7)
    model.load_state_dict(other.state_dict())  # in-place copies: version counters move
    after = prefill_and_decode(model, tokens)
    want = prefill_and_decode(other, tokens)  # other is unpacked
    assert not torch.equal(before[0], after[0])
    for w, g in zip(want, after, strict=True):
        assert torch.equal(w, g)
    # a parameter replaced outright (new storage) is picked up too
    with torch.no_grad():
        model.lm_head.weight.data = model.lm_head.weight.data.clone() * 2
        other.lm_head.weight.data = other.lm_head.weight.data.clone() * 2
    assert torch.equal(prefill_and_decode(model, tokens)[1], prefill_and_decode(other, tokens)[1])


def test_training_through_a_packed_model_is_the_plain_training():
    a, b = _bf16(), _bf16()
    pack_for_inference(b)
    tokens = torch.randint(0, 96, (2, 6), generator=torch.Generator().manual_seed(3))
    for m in (a, b):
        m.train()
        logits, _ = m(tokens)
        logits.logsumexp(-1).sum().backward()
    for (name, pa), pb in zip(a.named_parameters(), b.parameters(), strict=True):
        assert torch.equal(pa.grad, pb.grad), name


def test_copies_pickles_and_state_dict_see_plain_modules():
    model = _bf16()
    keys = list(model.state_dict())
    pack_for_inference(model)
    tokens = torch.randint(0, 96, (2, 5), generator=torch.Generator().manual_seed(4))
    want = prefill_and_decode(model, tokens)
    assert list(model.state_dict()) == keys
    clone = copy.deepcopy(model)
    buf = io.BytesIO()
    torch.save(model, buf)
    buf.seek(0)
    loaded = torch.load(buf, weights_only=False)
    for other in (clone, loaded):
        for w, g in zip(want, prefill_and_decode(other, tokens), strict=True):
            assert torch.equal(w, g)
    with torch.no_grad():  # the copy runs on its own weights, not the original's packed ones
        clone.lm_head.weight.mul_(2)
    assert not torch.equal(prefill_and_decode(clone, tokens)[1], want[1])
    assert torch.equal(prefill_and_decode(model, tokens)[1], want[1])


def test_unpack_restores_plain_linears():
    model = _bf16()
    pack_for_inference(model)
    unpack(model)
    assert not any(isinstance(m, PackedLinear) for m in model.modules())
    assert model not in packed._CACHE


def test_a_kernel_mismatch_leaves_the_model_unpacked(monkeypatch):
    model = _bf16()
    monkeypatch.setattr(packed, "_CHECKED", set())
    real = torch.ops.mkldnn._linear_pointwise

    class _Ops:  # a packed product that is off by one ulp somewhere
        @staticmethod
        def _linear_pointwise(*args):
            y = real(*args)
            y.view(-1)[0] = torch.nextafter(y.view(-1)[0], torch.tensor(float("inf"), dtype=y.dtype))
            return y

        _reorder_linear_weight = staticmethod(torch.ops.mkldnn._reorder_linear_weight)
        _is_mkldnn_bf16_supported = staticmethod(torch.ops.mkldnn._is_mkldnn_bf16_supported)

    monkeypatch.setattr(packed.torch.ops, "mkldnn", _Ops)
    assert pack_for_inference(model) == 0
    assert not any(isinstance(m, PackedLinear) for m in model.modules())


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_engine_outputs_do_not_depend_on_packing(temperature):
    prompts = [[1, 5, 9, 2], [3, 3, 8], [7, 1, 4, 4, 6, 2]]
    sp = SamplingParams(temperature=temperature, max_new_tokens=12, seed=5)
    outs = []
    for pack in (False, True):
        eng = RolloutEngine(_bf16(), max_batch_size=2, max_seq_len=32, packed=pack)
        assert (eng.packed_layers > 0) == pack
        outs.append(eng.generate(prompts, sp).outputs)
    for a, b in zip(*outs, strict=True):
        assert a.token_ids == b.token_ids and a.logprobs == b.logprobs

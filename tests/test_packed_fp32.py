"""Packed float32 inference linears (`specrl.model.packed`): per kernel class a column-major copy (AVX512) or oneDNN's
prepacked weight (AVX2) of each weight, the plain forward to float32 rounding, never stale, training untouched, an
engine's outputs unchanged by packing, and nothing packed where no layout is named."""

import pytest
import torch
from torch import nn

from specrl import RolloutEngine, SamplingParams
from specrl.model import packed
from specrl.model.packed import PackedLinear, pack_for_inference, unpack
from specrl.model.transformer import tiny_model
from tests.tiny import prefill_and_decode


@pytest.fixture(autouse=True, params=["AVX512", "AVX2"])
def kernels(request, monkeypatch):
    """The float32 layout follows torch's kernel class; both layouts are correct on any CPU, so these tests run each
    of them everywhere."""
    monkeypatch.setattr(packed.torch.backends.cpu, "get_cpu_capability", lambda: request.param)
    return request.param


TOL = dict(rtol=1e-4, atol=1e-5)  # float32 rounding of a sum over a few hundred products is ~1e-7 relative


def test_float32_packs_every_linear_and_matches_the_plain_forward(kernels):
    model = tiny_model("llama", vocab_size=96)
    tokens = torch.randint(0, 96, (3, 7), generator=torch.Generator().manual_seed(1))
    want = prefill_and_decode(model, tokens)
    assert pack_for_inference(model) == 4 * 7 + 1  # 7 linears per layer, 4 layers, the LM head
    got = prefill_and_decode(model, tokens)
    for w, g in zip(want, got, strict=True):
        torch.testing.assert_close(g, w, **TOL)
    # the laid-out path really ran, on laid-out copies of the fused weights
    hits = [packed._CACHE[model.layers[0].self_attn]["qkv"], packed._CACHE[model.layers[0].mlp]["gate_up"],
            packed._CACHE[model.lm_head]["w"]]
    assert {h[0][0] for h in hits} == {packed.FLOAT32_LAYOUT[kernels]}
    if kernels == "AVX512":
        for w in (h[1] for h in hits):
            assert w.stride() == (1, w.shape[0])
        attn = model.layers[0].self_attn
        assert torch.equal(hits[0][1], torch.cat([attn.q_proj.weight, attn.k_proj.weight, attn.v_proj.weight]))


def test_float32_weight_changes_in_place_are_picked_up():
    model = tiny_model("llama", vocab_size=96)
    pack_for_inference(model)
    tokens = torch.randint(0, 96, (2, 5), generator=torch.Generator().manual_seed(2))
    before = prefill_and_decode(model, tokens)
    model.load_state_dict(tiny_model("llama", vocab_size=96, seed=7).state_dict())  # in place: versions move
    after = prefill_and_decode(model, tokens)
    unpack(model)
    plain = prefill_and_decode(model, tokens)
    for a, p, b in zip(after, plain, before, strict=True):
        torch.testing.assert_close(a, p, **TOL)
        assert not torch.allclose(a, b, **TOL)


def test_float32_training_through_a_packed_model_is_the_plain_training():
    tokens = torch.randint(0, 96, (2, 6), generator=torch.Generator().manual_seed(3))
    grads = []
    for pack in (False, True):
        model = tiny_model("llama", vocab_size=96)
        if pack:
            pack_for_inference(model)
        logits, _ = model.forward(tokens)
        logits.logsumexp(-1).sum().backward()
        grads.append([p.grad for p in model.parameters()])
    for a, b in zip(*grads, strict=True):
        assert torch.equal(a, b)  # with gradients on, the plain F.linear path runs: bitwise the same


def test_float32_unpack_and_state_dict_see_plain_modules():
    model = tiny_model("llama", vocab_size=96)
    pack_for_inference(model)
    assert all(p.is_contiguous() for p in model.state_dict().values())
    unpack(model)
    assert not any(isinstance(m, PackedLinear) for m in model.modules())
    assert all(type(m) is nn.Linear for m in model.modules() if isinstance(m, nn.Linear))


def test_engine_packs_float32_and_its_greedy_outputs_do_not_depend_on_it():
    prompts = [[1, 5, 9, 2], [3, 3, 8], [7, 1, 4, 4, 6, 2]]
    sp = SamplingParams(temperature=0.0, max_new_tokens=12, seed=5)
    outs = []
    for pack in (False, True):
        eng = RolloutEngine(tiny_model("llama", vocab_size=96), max_batch_size=2, max_seq_len=32, packed=pack)
        assert (eng.packed_layers > 0) == pack
        outs.append(eng.generate(prompts, sp).outputs)
    for a, b in zip(*outs, strict=True):
        assert a.token_ids == b.token_ids
        torch.testing.assert_close(torch.tensor(b.logprobs), torch.tensor(a.logprobs), rtol=1e-4, atol=1e-4)


def test_float32_is_not_packed_where_no_layout_is_named(monkeypatch):
    monkeypatch.setattr(packed.torch.backends.cpu, "get_cpu_capability", lambda: "DEFAULT")
    model = tiny_model("llama", vocab_size=96)
    assert pack_for_inference(model) == 0
    assert not any(isinstance(m, PackedLinear) for m in model.modules())


def test_float32_products_of_few_rows_run_on_the_plain_weight(monkeypatch):
    monkeypatch.setattr(packed.torch.backends.cpu, "get_cpu_capability", lambda: "AVX512")  # the column-major rule
    model = tiny_model("llama", vocab_size=96)
    tokens = torch.randint(0, 96, (packed.FLOAT32_MIN_ROWS - 1, 5), generator=torch.Generator().manual_seed(4))
    cache = model.new_cache(tokens.shape[0], 32)
    pos = torch.full((tokens.shape[0], 1), 0)
    with torch.no_grad():
        want, _ = model.forward(tokens[:, :1], pos, cache)
    pack_for_inference(model)
    with torch.no_grad():
        got, _ = model.forward(tokens[:, :1], pos, model.new_cache(tokens.shape[0], 32))
    assert torch.equal(got, want)  # below FLOAT32_MIN_ROWS the plain F.linear runs: bitwise the same
    assert not packed._CACHE.get(model.lm_head)  # and nothing was laid out


def test_the_layout_is_chosen_when_packing_not_per_product(monkeypatch):
    monkeypatch.setattr(packed.torch.backends.cpu, "get_cpu_capability", lambda: "AVX2")
    model = tiny_model("llama", vocab_size=96)
    pack_for_inference(model)
    monkeypatch.setattr(packed.torch.backends.cpu, "get_cpu_capability", lambda: "AVX512")  # after packing
    tokens = torch.randint(0, 96, (3, 7), generator=torch.Generator().manual_seed(5))
    prefill_and_decode(model, tokens)
    assert packed._CACHE[model.lm_head]["w"][0][0] == "onednn"  # the layout packed for, not the current class


def test_a_tree_cast_after_packing_runs_plain(kernels):
    model = tiny_model("llama", vocab_size=96)
    pack_for_inference(model)
    model.to(torch.float64)  # no layout was chosen for this dtype
    tokens = torch.randint(0, 96, (2, 5), generator=torch.Generator().manual_seed(6))
    prefill_and_decode(model, tokens)
    assert not packed._CACHE.get(model.lm_head)

"""The chunked LM-head log-probabilities: the same values, gradients and top-k as the plain ops, in fp32 and in
bf16 autocast, for tied heads, through a learner step; and its bad inputs."""

from __future__ import annotations

import pytest
import torch

from specrl.algorithms import logprobs as hl
from specrl.algorithms.grpo import token_logprobs
from specrl.errors import SpecRLError


def _plain(hidden, head, targets, t):
    return token_logprobs(head(hidden).float().unsqueeze(0), targets.unsqueeze(0), t)[0]


def _case(n=37, h=24, v=101, seed=0):
    g = torch.Generator().manual_seed(seed)
    hidden = torch.randn(n, h, generator=g, requires_grad=True)
    head = torch.nn.Linear(h, v, bias=False)
    with torch.no_grad():
        head.weight.copy_(torch.randn(v, h, generator=g) * 0.3)
    targets = torch.randint(0, v, (n,), generator=g)
    upstream = torch.randn(n, generator=g)
    return hidden, head, targets, upstream


def _grads(fn, hidden, head, upstream):
    hidden.grad = None
    head.weight.grad = None
    (fn() * upstream).sum().backward()
    return hidden.grad.clone(), head.weight.grad.clone()


@pytest.mark.parametrize("t", [1.0, 0.7])
@pytest.mark.parametrize("rows", [1, 5, 36])
def test_chunked_matches_plain_fp32(t, rows):
    hidden, head, targets, up = _case()
    lp, _ = hl.head_logprobs(hidden, head, targets, t, max_rows=rows)
    ref = _plain(hidden, head, targets, t)
    torch.testing.assert_close(lp, ref, rtol=1e-5, atol=1e-5)
    gh, gw = _grads(lambda: hl.head_logprobs(hidden, head, targets, t, max_rows=rows)[0], hidden, head, up)
    rh, rw = _grads(lambda: _plain(hidden, head, targets, t), hidden, head, up)
    torch.testing.assert_close(gh, rh, rtol=1e-4, atol=1e-5)
    torch.testing.assert_close(gw, rw, rtol=1e-4, atol=1e-5)


def test_chunked_matches_plain_under_bf16_autocast():
    hidden, head, targets, up = _case(n=64, h=32, v=257)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        lp, _ = hl.head_logprobs(hidden, head, targets, 0.7, max_rows=10)
        ref = _plain(hidden, head, targets, 0.7)
    # the forward's products are the same bf16 products, chunk by chunk
    torch.testing.assert_close(lp, ref, rtol=0, atol=1e-5)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        gh, gw = _grads(lambda: hl.head_logprobs(hidden, head, targets, 0.7, max_rows=10)[0], hidden, head, up)
        rh, rw = _grads(lambda: _plain(hidden, head, targets, 0.7), hidden, head, up)
    assert gh.dtype == rh.dtype == torch.float32 and gw.dtype == rw.dtype == torch.float32
    # bf16 rounds the gradient products: autograd rounds the whole batch's product once, the chunks each chunk's.
    # Both must be as close to the float64 gradient as bf16 allows, the chunked one no further than twice the plain.
    h64 = hidden.detach().double().requires_grad_()
    head64 = torch.nn.Linear(32, 257, bias=False).double()
    with torch.no_grad():
        head64.weight.copy_(head.weight.double())
    (_plain(h64, head64, targets, 0.7).double() * up.double()).sum().backward()
    for got, ref, exact in ((gh, rh, h64.grad), (gw, rw, head64.weight.grad)):
        err_chunked = (got.double() - exact).abs().max().item()
        err_plain = (ref.double() - exact).abs().max().item()
        scale = exact.abs().max().item()
        assert err_chunked <= max(2 * err_plain, 1e-3 * scale), (err_chunked, err_plain, scale)
        assert err_chunked <= 2e-2 * scale


def test_top_matches_softmax_topk():
    hidden, head, targets, _ = _case(v=50)
    with torch.no_grad():
        _, (p, i, a) = hl.head_logprobs(hidden, head, targets, 0.7, top=8, max_rows=4)
        _, (p1, i1, a1) = hl.head_logprobs(hidden, head, targets, 0.7, top=8, max_rows=10_000)
        probs = torch.softmax(head(hidden).float(), -1)  # untempered, as the drafter distils
    rp, ri = probs.topk(8, -1)
    for pp, ii, aa in ((p, i, a), (p1, i1, a1)):
        torch.testing.assert_close(pp, rp)
        assert torch.equal(ii, ri) and torch.equal(aa, probs.argmax(-1))


def test_tied_head_gets_both_gradients():
    hidden, head, targets, up = _case()
    emb = torch.nn.Embedding(*head.weight.shape)
    emb.weight = head.weight  # tied, as SmolLM2's head
    x = emb(torch.arange(hidden.shape[0]) % head.weight.shape[0]) + hidden
    (hl.head_logprobs(x, head, targets, 1.0, max_rows=4)[0] * up).sum().backward()
    g_chunked = head.weight.grad.clone()
    head.weight.grad = None
    x = emb(torch.arange(hidden.shape[0]) % head.weight.shape[0]) + hidden
    (_plain(x, head, targets, 1.0) * up).sum().backward()
    torch.testing.assert_close(g_chunked, head.weight.grad, rtol=1e-4, atol=1e-5)


def test_default_chunk_rows_follow_the_vocabulary(monkeypatch):
    assert hl.chunk_rows(49_152) == (128 << 20) // (4 * 49_152)
    assert hl.chunk_rows(151_936) < hl.chunk_rows(49_152)
    monkeypatch.setattr(hl, "CHUNK_BYTES", 4 * 101 * 3)
    assert hl.chunk_rows(101) == 3


@pytest.mark.parametrize("kwargs,match", [
    ({"temperature": 0.0}, "temperature must be > 0"),
    ({"temperature": -1.0}, "temperature must be > 0"),
    ({"max_rows": 0}, "max_rows must be >= 1"),
])
def test_bad_input(kwargs, match):
    hidden, head, targets, _ = _case()
    args = {"temperature": 1.0, **kwargs}
    t = args.pop("temperature")
    with pytest.raises(SpecRLError, match=match):
        hl.head_logprobs(hidden, head, targets, t, **args)


def test_head_with_bias_is_refused():
    hidden, _, targets, _ = _case()
    with pytest.raises(SpecRLError, match="without bias"):
        hl.head_logprobs(hidden, torch.nn.Linear(24, 101), targets, 1.0)

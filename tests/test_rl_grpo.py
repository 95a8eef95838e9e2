"""GRPO maths against hand-computed values."""

import math

import pytest
import torch

from specrl.algorithms.grpo import (
    clipped_surrogate_loss,
    group_advantages,
    kl_k3,
    masked_mean,
    token_logprobs,
    token_mult_prob_error,
)
from specrl.errors import SpecRLError


def test_group_advantages_normalized():
    r = torch.tensor([1.0, 0.0, 1.0, 0.0, 2.0, 2.0, 2.0, 2.0])
    adv = group_advantages(r, group_size=4, normalize_std=True)
    # group 1: mean 0.5, unbiased std = sqrt(1/3)
    s = math.sqrt(1 / 3)
    expected = torch.tensor([0.5 / s, -0.5 / s, 0.5 / s, -0.5 / s, 0, 0, 0, 0])
    assert torch.allclose(adv, expected, atol=1e-4)


def test_group_advantages_no_std():
    r = torch.tensor([3.0, 1.0, 0.0, 0.0])
    adv = group_advantages(r, group_size=2, normalize_std=False)
    assert torch.allclose(adv, torch.tensor([1.0, -1.0, 0.0, 0.0]))


@pytest.mark.parametrize("n,g", [(6, 4), (4, 1)])
def test_group_advantages_bad(n, g):
    with pytest.raises(SpecRLError):
        group_advantages(torch.zeros(n), group_size=g)


def test_token_logprobs_temperature():
    logits = torch.tensor([[[2.0, 0.0, 0.0]]])
    tgt = torch.tensor([[0]])
    lp = token_logprobs(logits, tgt, temperature=2.0)
    expected = 1.0 - math.log(math.e + 2.0)
    assert lp.shape == (1, 1)
    assert abs(lp.item() - expected) < 1e-6
    with pytest.raises(SpecRLError):
        token_logprobs(logits, tgt, temperature=0.0)


def test_kl_k3_values():
    lp = torch.tensor([math.log(0.5)])
    ref = torch.tensor([math.log(0.25)])
    r = math.log(0.25) - math.log(0.5)
    assert abs(kl_k3(lp, ref).item() - (math.exp(r) - r - 1)) < 1e-6
    assert kl_k3(ref, ref).item() == 0.0


def test_surrogate_on_policy_is_minus_mean_advantage():
    logp = torch.tensor([[-1.0, -2.0, -3.0], [-0.5, -0.5, -9.0]], requires_grad=True)
    mask = torch.tensor([[1, 1, 1], [1, 1, 0]], dtype=torch.bool)
    adv = torch.tensor([1.0, -2.0])
    out = clipped_surrogate_loss(logp, logp.detach(), adv, mask)
    # ratio 1 everywhere: loss = -(1+1+1-2-2)/5 = 0.2
    assert abs(out.loss.item() - 0.2) < 1e-6
    assert out.num_tokens == 5 and out.clipped_tokens == 0
    out.loss.backward()
    # d loss / d logp = -A / N on unmasked tokens, 0 on padding
    expected = torch.tensor([[-0.2, -0.2, -0.2], [0.4, 0.4, 0.0]])
    assert torch.allclose(logp.grad, expected, atol=1e-6)


def test_surrogate_asymmetric_clip():
    old = torch.zeros(1, 4)
    # ratios 1.5, 0.5, 1.5, 0.5
    logp = torch.log(torch.tensor([[1.5, 0.5, 1.5, 0.5]])).requires_grad_(True)
    mask = torch.ones(1, 4, dtype=torch.bool)
    adv = torch.tensor([[1.0, 1.0, -1.0, -1.0]])
    out = clipped_surrogate_loss(logp, old, adv, mask, clip_low=0.2, clip_high=0.28)
    # A>0, r=1.5 -> min(1.5, 1.28) = 1.28 (clipped); A>0, r=0.5 -> min(0.5, 0.8) = 0.5
    # A<0, r=1.5 -> min(-1.5, -1.28) = -1.5;        A<0, r=0.5 -> min(-0.5, -0.8) = -0.8 (clipped)
    expected = -(1.28 + 0.5 - 1.5 - 0.8) / 4
    assert abs(out.loss.item() - expected) < 1e-6
    assert out.clipped_tokens == 2
    out.loss.backward()
    # clipped tokens carry no gradient
    assert logp.grad[0, 0].item() == 0.0 and logp.grad[0, 3].item() == 0.0
    assert logp.grad[0, 1].item() != 0.0


def test_surrogate_kl_and_normalizer():
    logp = torch.log(torch.tensor([[0.5, 0.5]]))
    ref = torch.log(torch.tensor([[0.25, 0.5]]))
    mask = torch.ones(1, 2, dtype=torch.bool)
    out = clipped_surrogate_loss(logp, logp, torch.zeros(1), mask, ref_logp=ref, kl_coef=0.1, normalizer=4)
    k = kl_k3(logp, ref)[0, 0].item()
    assert abs(out.loss.item() - 0.1 * k / 4) < 1e-7
    assert abs(out.kl_sum - k) < 1e-7
    with pytest.raises(SpecRLError):
        clipped_surrogate_loss(logp, logp, torch.zeros(1), mask, kl_coef=0.1)
    with pytest.raises(SpecRLError):
        clipped_surrogate_loss(logp, logp[:, :1], torch.zeros(1), mask)


def test_token_mult_prob_error():
    gen = torch.tensor([[-1.0, -2.0, 0.0]])
    train = torch.tensor([[-1.0, -2.5, 5.0]])
    mask = torch.tensor([[1, 1, 0]], dtype=torch.bool)
    assert abs(token_mult_prob_error(gen, train, mask) - (1 + math.exp(0.5)) / 2) < 1e-9
    assert token_mult_prob_error(gen, gen, mask) == 1.0
    assert token_mult_prob_error(gen, train, torch.zeros_like(mask)) == 1.0


def test_masked_mean_empty():
    assert masked_mean(torch.ones(3), torch.zeros(3, dtype=torch.bool)).item() == 0.0


def test_truncated_importance_sampling():
    """TIS: off is bit-identical; weights min(pi_old / mu, cap) scale each token's pg term (gradient included)."""
    torch.manual_seed(0)
    old = torch.randn(3, 5) * 0.3 - 1.0
    logp = (old + 0.05 * torch.randn(3, 5)).requires_grad_(True)
    adv = torch.tensor([1.0, -0.5, 2.0])
    mask = torch.ones(3, 5, dtype=torch.bool)
    mask[2, 3:] = False
    plain = clipped_surrogate_loss(logp, old, adv, mask)
    g_plain, = torch.autograd.grad(plain.loss, logp)
    same = clipped_surrogate_loss(logp, old, adv, mask, behavior_logp=old)  # mu == pi_old: weights 1
    assert torch.equal(same.loss, plain.loss) and same.is_weight_max == 1.0 and same.is_clipped_tokens == 0
    assert plain.is_weight_sum == 0.0  # off: no statistics
    # mu puts more mass on token (0,0) than pi_old (weight 0.5), less on (1,1) (weight 3 -> capped at 2)
    behavior = old.clone()
    behavior[0, 0] += math.log(2.0)
    behavior[1, 1] -= math.log(3.0)
    out = clipped_surrogate_loss(logp, old, adv, mask, behavior_logp=behavior, is_cap=2.0)
    g, = torch.autograd.grad(out.loss, logp)
    w = torch.ones(3, 5)
    w[0, 0], w[1, 1] = 0.5, 2.0
    assert torch.allclose(g, g_plain * w, atol=1e-6)
    assert out.is_clipped_tokens == 1 and out.is_weight_max == pytest.approx(2.0)
    assert out.is_weight_sum == pytest.approx(float(w[mask].sum()), abs=1e-5)
    with pytest.raises(SpecRLError, match="is_cap must be >= 1"):
        clipped_surrogate_loss(logp, old, adv, mask, behavior_logp=behavior, is_cap=0.5)
    with pytest.raises(SpecRLError, match=r"behavior_logp.*shape of logp"):
        clipped_surrogate_loss(logp, old, adv, mask, behavior_logp=behavior[:, :4])

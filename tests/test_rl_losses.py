"""The loss registry: each loss against hand-computed values on a small batch, the normalisers, bad input."""

import math

import pytest
import torch

from specrl.algorithms.grpo import clipped_surrogate_loss
from specrl.algorithms.losses import LOSSES, get_loss, loss_normalizer, register_loss
from specrl.errors import SpecRLError
from specrl.trainer.config_check import validate_config

# Two sequences. Sequence 0: two response tokens with ratios 1.1 and 1.2 (inside [0.8, 1.28]), advantage +1.
# Sequence 1: one response token with ratio 0.5 (below 0.8: clipped), advantage -2, then padding.
# Token terms pg = -min(r A, clip(r) A): -1.1, -1.2 and -min(-1.0, -1.6) = +1.6.
RATIOS = torch.tensor([[1.1, 1.2], [0.5, 1.0]])
MASK = torch.tensor([[True, True], [True, False]])
ADV = torch.tensor([1.0, -2.0])
KW = {"clip_low": 0.2, "clip_high": 0.28}


def batch():
    old = torch.tensor([[-1.0, -2.0], [-0.5, -3.0]])
    logp = (old + RATIOS.log()).requires_grad_(True)
    return logp, old


@pytest.mark.parametrize("name,normalizer,expected", [
    ("dapo", 3.0, (-1.1 - 1.2 + 1.6) / 3),  # token mean over the 3 tokens
    ("grpo", 2.0, ((-1.1 - 1.2) / 2 + 1.6) / 2),  # each sequence's token mean, then the mean of the 2
    ("dr_grpo", 2.0 * 4, (-1.1 - 1.2 + 1.6) / 8),  # summed tokens / (2 sequences x max_new_tokens 4)
    # sequence ratio of sequence 0: exp(mean(log 1.1, log 1.2)) = sqrt(1.32), unclipped; sequence 1: 0.5, clipped
    ("gspo", 2.0, (-math.sqrt(1.32) + 1.6) / 2),
])
def test_loss_values(name, normalizer, expected):
    logp, old = batch()
    loss = get_loss(name)
    assert loss_normalizer(loss.normalizer, MASK, max_new_tokens=4) == normalizer
    out = loss(logp, old, ADV, MASK, normalizer=normalizer, **KW)
    assert float(out.loss.detach()) == pytest.approx(expected, abs=1e-6)
    assert out.num_tokens == 3.0
    assert out.clipped_tokens == 1.0  # sequence 1's one token (gspo: its sequence, of one token)


def test_loss_gradients():
    """d loss / d logp by hand: a clipped token (or sequence) has none."""
    logp, old = batch()
    get_loss("grpo")(logp, old, ADV, MASK, normalizer=2.0, **KW).loss.backward()
    # -r A / (len 2) / (2 sequences), for the unclipped tokens of sequence 0
    assert torch.allclose(logp.grad, torch.tensor([[-1.1 / 4, -1.2 / 4], [0.0, 0.0]]), atol=1e-6)
    logp, old = batch()
    get_loss("gspo")(logp, old, ADV, MASK, normalizer=2.0, **KW).loss.backward()
    # d(-s A)/d logp_t = -A s / len, over 2 sequences
    s = math.sqrt(1.32)
    assert torch.allclose(logp.grad, torch.tensor([[-s / 4, -s / 4], [0.0, 0.0]]), atol=1e-6)


def test_gspo_clips_the_sequence_not_the_token():
    """Ratios 1.5 and 1.0: token-level clipping caps the first token only; GSPO's sequence ratio sqrt(1.5) =
    1.22 is inside [0.8, 1.28], so nothing is clipped and both tokens keep their gradient."""
    old = torch.zeros(1, 2)
    logp = torch.tensor([[math.log(1.5), 0.0]], requires_grad=True)
    mask, adv = torch.ones(1, 2, dtype=torch.bool), torch.ones(1)
    tok = get_loss("dapo")(logp, old, adv, mask, normalizer=2.0, **KW)
    seq = get_loss("gspo")(logp, old, adv, mask, normalizer=1.0, **KW)
    assert tok.clipped_tokens == 1.0 and seq.clipped_tokens == 0.0
    assert float(seq.loss.detach()) == pytest.approx(-math.sqrt(1.5), abs=1e-6)


def test_gspo_importance_weight_is_per_sequence():
    logp, old = batch()
    behavior = old - torch.tensor([[math.log(2.0), 0.0], [math.log(4.0), 0.0]])  # old / behaviour: 2,1 and 4
    out = get_loss("gspo")(logp, old, ADV, MASK, normalizer=2.0, behavior_logp=behavior, is_cap=2.0, **KW)
    # w_0 = exp(mean(log 2, log 1)) = sqrt(2); w_1 = min(4, cap 2) = 2
    assert float(out.loss) == pytest.approx((-math.sqrt(1.32) * math.sqrt(2) + 1.6 * 2) / 2, abs=1e-6)
    assert out.is_clipped_tokens == 1.0 and out.is_weight_max == pytest.approx(2.0)


def test_dapo_is_the_clipped_surrogate_bit_for_bit():
    g = torch.Generator().manual_seed(0)
    logp = torch.randn(4, 6, generator=g).requires_grad_(True)
    old, ref = torch.randn(4, 6, generator=g), torch.randn(4, 6, generator=g)
    mask = torch.rand(4, 6, generator=g) > 0.3
    adv, behavior = torch.randn(4, generator=g), torch.randn(4, 6, generator=g)
    a = clipped_surrogate_loss(logp, old, adv, mask, 0.2, 0.28, ref, 0.1, normalizer=17.0, behavior_logp=behavior)
    (ga,) = torch.autograd.grad(a.loss, logp)
    b = get_loss("dapo")(logp, old, adv, mask, normalizer=17.0, clip_low=0.2, clip_high=0.28, ref_logp=ref,
                         kl_coef=0.1, behavior_logp=behavior)
    (gb,) = torch.autograd.grad(b.loss, logp)
    assert torch.equal(a.loss, b.loss) and torch.equal(ga, gb)
    assert {k: v for k, v in vars(a).items() if k != "loss"} == {k: v for k, v in vars(b).items() if k != "loss"}


def test_kl_term_per_loss():
    logp, old = batch()
    ref = logp.detach().clone()  # k3 = 0 where ref == logp
    ref[0, 0] -= 1.0  # k3 at one token: exp(r) - r - 1 with r = ref - logp
    r = float(ref[0, 0] - logp[0, 0])
    k3 = math.exp(r) - r - 1
    base = float(get_loss("grpo")(logp, old, ADV, MASK, normalizer=2.0, **KW).loss)
    with_kl = float(get_loss("grpo")(logp, old, ADV, MASK, normalizer=2.0, ref_logp=ref, kl_coef=0.5, **KW).loss)
    assert with_kl - base == pytest.approx(0.5 * k3 / 2 / 2, abs=1e-6)  # token of a 2-token sequence, 2 sequences


def test_register_a_loss_and_select_it_by_name():
    @register_loss("test_sum", normalizer="sequences")
    def summed(logp, old_logp, advantages, mask, *, normalizer, clip_low, clip_high, ref_logp=None, kl_coef=0.0,
               behavior_logp=None, is_cap=2.0):
        return get_loss("dapo")(logp, old_logp, advantages, mask, normalizer=normalizer, clip_low=clip_low,
                                clip_high=clip_high)

    try:
        assert get_loss("test_sum").normalizer == "sequences"
        assert validate_config({"grpo": {"loss_type": "test_sum"}}).grpo.loss_type == "test_sum"
    finally:
        del LOSSES["test_sum"]


def test_bad_loss_inputs():
    with pytest.raises(SpecRLError, match=rf"loss_type:.*'ppo'.*losses: {', '.join(sorted(LOSSES))}"):
        get_loss("ppo")
    with pytest.raises(SpecRLError, match=r"normalizer.*sequences, max_tokens.*'batch'"):
        register_loss("x", normalizer="batch")
    logp, old = batch()
    with pytest.raises(SpecRLError, match=r"normalizer.*> 0, got 0"):
        get_loss("grpo")(logp, old, ADV, MASK, normalizer=0, **KW)
    with pytest.raises(SpecRLError, match=r"gspo.*\[2\].*\(2, 2\)"):
        get_loss("gspo")(logp, old, ADV[:, None].expand(2, 2), MASK, normalizer=2.0, **KW)


@pytest.mark.parametrize("over,msg", [
    ({"loss_type": "ppo"}, r"grpo.loss_type: unknown loss 'ppo'; allowed: dapo, dr_grpo, grpo, gspo"),
    ({"num_iterations": 0}, r"grpo.num_iterations: must be an integer >= 1 \(passes over each batch"),
    ({"mini_batches": True}, r"grpo.mini_batches: must be an integer >= 1 \(optimizer steps per pass"),
    ({"mini_batches": 3}, r"grpo.mini_batches \(3\) must divide .* = 8 .*valid values: \[1, 2, 4, 8\]"),
    ({"loss_type": "dr_grpo", "normalize_rewards": True},
     r"loss_type=dr_grpo does not divide advantages by the group std, but normalize_rewards=true"),
    ({"max_extra_prompt_draws": -1}, r"grpo.max_extra_prompt_draws: Input should be greater than or equal to 0"),
])
def test_bad_config(over, msg):
    base = {"num_prompts_per_step": 2, "num_generations": 4}
    with pytest.raises(SpecRLError, match=msg):
        validate_config({"grpo": {**base, **over}, "policy": {"train_micro_batch_size": 4}})


def test_std_scaling_follows_the_loss():
    from specrl.algorithms.losses import scales_by_std

    def cfg(**g):
        c = validate_config({"grpo": g}).grpo
        return scales_by_std(c.loss_type, c.normalize_rewards)

    assert cfg() and cfg(loss_type="gspo")
    assert not cfg(loss_type="dr_grpo")
    assert not cfg(loss_type="dapo", normalize_rewards=False)
    assert cfg(loss_type="grpo", normalize_rewards=True)


def test_on_stale_needs_refresh_updates():
    base = {"speculative": {"drafter": "eagle:x"}, "drafter": {"online": True, "online_mode": "on_stale",
                                                                 "refresh_steps": 0}}
    with pytest.raises(SpecRLError, match=r"online_mode=on_stale.*refresh_steps.*now 0"):
        validate_config(base)
    # without an online drafter the mode is moot: examples/short.yaml with --set drafter.online=false (and the
    # autoregressive arm of --compare) stays valid
    assert validate_config({"drafter": {"online": False, "online_mode": "on_stale"}}).drafter.online_mode == "on_stale"
    with pytest.raises(SpecRLError, match=r"online_mode:.*'every_step' or 'on_stale'"):
        validate_config({"drafter": {"online_mode": "sometimes"}})


def test_each_loss_has_its_own_default_clip_range_and_the_config_overrides_it():
    from specrl.trainer.config_check import load_config

    got = {lt: (c.grpo.clip_low, c.grpo.clip_high) for lt in ("dapo", "grpo", "dr_grpo", "gspo")
           for c in [load_config(None, [f"grpo.loss_type={lt}"])]}
    assert got == {"dapo": (0.2, 0.28), "grpo": (0.2, 0.2), "dr_grpo": (0.2, 0.2), "gspo": (3e-4, 4e-4)}
    c = load_config(None, ["grpo.loss_type=gspo", "grpo.clip_high=0.001"])
    assert (c.grpo.clip_low, c.grpo.clip_high) == (3e-4, 1e-3)
    with pytest.raises(SpecRLError, match="clip must be"):
        register_loss("bad_clip", clip=(1.5, 0.2))

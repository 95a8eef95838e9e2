"""The policy losses by name: one registry, one signature, the normaliser as an explicit input.

`LOSSES` maps a `grpo.loss_type` name to a `Loss`: the function, the normaliser it divides by and whether its
advantages are divided by the group std. Every loss function has the signature of `LossFn`: per-token
log-probabilities of the current policy (`logp`, with gradient), of the proximal policy (`old_logp`), the
advantages, the response mask, and keyword arguments `normalizer` (computed by the learner for the whole
optimizer step, see `loss_normalizer`), the clip range, the KL term and the truncated importance-sampling
inputs; it returns a `specrl.algorithms.grpo.LossOutput` whose loss is this micro-batch's share of the step's loss, so
micro-batch losses add up to the step's. Because the normaliser is an input, a learner sharded over ranks
passes the global token or sequence count and every rank's share stays exact. A user adds a loss with
`@register_loss("name", normalizer=...)` and selects it with `grpo.loss_type=name`; the learner never changes.
Each loss carries its default clip range (`DEFAULT_CLIP`, `PPO_CLIP`, `GSPO_CLIP`), which `grpo.clip_low` /
`grpo.clip_high` override.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Protocol

import torch
from torch import Tensor

from specrl.algorithms.grpo import LossOutput, check_loss_inputs, clipped_surrogate_loss, kl_k3, surrogate_terms
from specrl.errors import SpecRLError

NORMALIZERS = ("tokens", "sequences", "max_tokens")
# Default ratio clip ranges (clip_low, clip_high) per loss, used when grpo.clip_low / clip_high are unset:
# token-level ratios with DAPO's clip-higher (0.2, 0.28); GRPO / Dr. GRPO the symmetric PPO range; GSPO's
# sequence ratio is a geometric mean over hundreds of tokens and moves ~1000x less, so its paper clips at
# (3e-4, 4e-4): a token-level range there would clip nothing.
DEFAULT_CLIP = (0.2, 0.28)
PPO_CLIP = (0.2, 0.2)
GSPO_CLIP = (3e-4, 4e-4)


class LossFn(Protocol):
    def __call__(self, logp: Tensor, old_logp: Tensor, advantages: Tensor, mask: Tensor, *, normalizer: float,
                 clip_low: float, clip_high: float, ref_logp: Tensor | None = None, kl_coef: float = 0.0,
                 behavior_logp: Tensor | None = None, is_cap: float = 2.0) -> LossOutput: ...


@dataclass(frozen=True)
class Loss:
    """A registered loss: `fn`, the normaliser kind it expects and whether advantages are std-scaled."""

    name: str
    fn: LossFn
    normalizer: str = "tokens"
    scale_by_std: bool = True
    clip: tuple[float, float] = DEFAULT_CLIP  # (clip_low, clip_high) when the config leaves them unset

    def __call__(self, *args, **kwargs) -> LossOutput:
        return self.fn(*args, **kwargs)


LOSSES: dict[str, Loss] = {}


def register_loss(name: str, *, normalizer: str = "tokens", scale_by_std: bool = True,
                  clip: tuple[float, float] = DEFAULT_CLIP) -> Callable[[LossFn], LossFn]:
    """Decorator: register `fn` as `grpo.loss_type=name`.

    `normalizer`: what the learner divides the step's summed loss by (`loss_normalizer`): "tokens" (response
    tokens of the optimizer step), "sequences" (its sequences) or "max_tokens" (sequences x
    generation.max_new_tokens). `scale_by_std`: whether advantages are divided by the group std (when
    `grpo.normalize_rewards` is left unset). `clip`: the default (clip_low, clip_high) of the ratio, used when
    `grpo.clip_low` / `grpo.clip_high` are left unset: the range depends on what the ratio is (a token's, or a
    sequence's geometric mean, which moves ~1000x less per update)."""
    if normalizer not in NORMALIZERS:
        raise SpecRLError(f"register_loss({name!r}): normalizer must be one of {', '.join(NORMALIZERS)}, "
                          f"got {normalizer!r}")

    if not (len(clip) == 2 and 0 <= clip[0] < 1 and clip[1] >= 0):  # noqa: PLR2004 - a (low, high) pair
        raise SpecRLError(f"register_loss({name!r}): clip must be (low, high) with 0 <= low < 1 and high >= 0, "
                          f"got {clip!r}")

    def wrap(fn: LossFn) -> LossFn:
        LOSSES[name] = Loss(name, fn, normalizer, scale_by_std, (float(clip[0]), float(clip[1])))
        return fn

    return wrap


def get_loss(name: str) -> Loss:
    """The registered loss `name`; a SpecRLError listing the registered names otherwise."""
    if name not in LOSSES:
        raise SpecRLError(f"grpo.loss_type: unknown loss {name!r}; registered losses: {', '.join(sorted(LOSSES))} "
                          "(add one with specrl.algorithms.losses.register_loss)")
    return LOSSES[name]


def check_loss_name(name: str) -> Loss:
    """The registered loss `name`, for the config check (`grpo.loss_type`); a SpecRLError listing the allowed names
    otherwise."""
    if name not in LOSSES:
        raise SpecRLError(f"unknown loss {name!r}; allowed: {', '.join(sorted(LOSSES))} (more with "
                          "specrl.algorithms.losses.register_loss)")
    return LOSSES[name]


def clip_range(loss_type: str, clip_low: float | None, clip_high: float | None) -> tuple[float, float]:
    """The ratio clip range of a step: `grpo.clip_low` / `grpo.clip_high`, each the loss's default where unset."""
    low, high = get_loss(loss_type).clip
    return (low if clip_low is None else clip_low, high if clip_high is None else clip_high)


def scales_by_std(loss_type: str, normalize_rewards: bool | None) -> bool:
    """Whether advantages are divided by the group std: `grpo.normalize_rewards`, or the loss's own default."""
    if normalize_rewards is not None:
        return normalize_rewards
    return get_loss(loss_type).scale_by_std


def loss_normalizer(kind: str, mask: Tensor, max_new_tokens: int) -> float:
    """The normaliser of one optimizer step whose response mask is `mask` [N, T-1] (all its micro-batches).

    tokens: the number of response tokens (at least 1); sequences: N; max_tokens: N x max_new_tokens. A learner
    sharded over ranks sums these over ranks before calling the loss."""
    n = mask.shape[0]
    if kind == "tokens":
        return max(float(mask.sum()), 1.0)
    if kind == "sequences":
        return float(max(n, 1))
    if kind == "max_tokens":
        return float(max(n, 1) * max_new_tokens)
    raise SpecRLError(f"unknown normaliser {kind!r}; one of {', '.join(NORMALIZERS)}")


def _check_normalizer(normalizer: float) -> float:
    norm = float(normalizer)
    if not norm > 0:
        raise SpecRLError(f"normalizer must be > 0, got {normalizer}")
    return norm


@register_loss("dapo", normalizer="tokens")
def dapo_loss(logp, old_logp, advantages, mask, *, normalizer, clip_low, clip_high, ref_logp=None, kl_coef=0.0,
              behavior_logp=None, is_cap=2.0) -> LossOutput:
    """DAPO's token-level mean: every response token of the optimizer step weighs the same.

    L = sum_i sum_t [ -min(r_it A_i, clip(r_it, 1-eps_low, 1+eps_high) A_i) w_it + beta k3_it ] / sum_i |o_i|
    with r_it = exp(logp_it - old_logp_it), w_it = min(exp(old_logp_it - behavior_logp_it), is_cap) (1 without
    behaviour log-probs) and k3 the KL estimator to the reference; `normalizer` = sum_i |o_i| over the step.
    This is `specrl.algorithms.grpo.clipped_surrogate_loss`, bit for bit."""
    return clipped_surrogate_loss(logp, old_logp, advantages, mask, clip_low, clip_high, ref_logp, kl_coef,
                                  normalizer=_check_normalizer(normalizer), behavior_logp=behavior_logp,
                                  is_cap=is_cap)


@register_loss("grpo", normalizer="sequences", clip=PPO_CLIP)
def grpo_loss(logp, old_logp, advantages, mask, *, normalizer, clip_low, clip_high, ref_logp=None, kl_coef=0.0,
              behavior_logp=None, is_cap=2.0) -> LossOutput:
    """The GRPO paper's sequence mean: each sequence's token mean, then the mean over sequences.

    L = (1/G) sum_i (1/|o_i|) sum_t [ -min(r_it A_i, clip(r_it, 1-eps_low, 1+eps_high) A_i) w_it + beta k3_it ]
    with the per-token terms of `dapo_loss`; `normalizer` = G, the number of sequences of the optimizer step.
    A long response's tokens weigh less than a short one's."""
    t = surrogate_terms(logp, old_logp, advantages, mask, clip_low, clip_high, ref_logp, kl_coef, behavior_logp,
                        is_cap)
    lengths = t.mask.sum(1).clamp_min(1.0)
    return t.output(((t.per_token * t.mask).sum(1) / lengths).sum() / _check_normalizer(normalizer))


@register_loss("dr_grpo", normalizer="max_tokens", scale_by_std=False, clip=PPO_CLIP)
def dr_grpo_loss(logp, old_logp, advantages, mask, *, normalizer, clip_low, clip_high, ref_logp=None, kl_coef=0.0,
                 behavior_logp=None, is_cap=2.0) -> LossOutput:
    """Dr. GRPO: the summed token terms over a constant, and advantages not divided by the group std.

    L = sum_i sum_t [ -min(r_it A_i, clip(r_it, 1-eps_low, 1+eps_high) A_i) w_it + beta k3_it ] / (G * L_max)
    with A_i = R_i - mean(R_group) (no std division: the learner collates without it), G the sequences of the
    optimizer step and L_max = generation.max_new_tokens; `normalizer` = G * L_max. Neither the response length
    nor the group's reward spread rescales a sequence's gradient."""
    t = surrogate_terms(logp, old_logp, advantages, mask, clip_low, clip_high, ref_logp, kl_coef, behavior_logp,
                        is_cap)
    return t.output((t.per_token * t.mask).sum() / _check_normalizer(normalizer))


@register_loss("gspo", normalizer="sequences", clip=GSPO_CLIP)
def gspo_loss(logp, old_logp, advantages, mask, *, normalizer, clip_low, clip_high, ref_logp=None, kl_coef=0.0,
              behavior_logp=None, is_cap=2.0) -> LossOutput:
    """GSPO: one importance ratio per sequence, the geometric mean of its token ratios, clipped per sequence.

    s_i = exp((1/|o_i|) sum_t (logp_it - old_logp_it));  L = (1/G) sum_i [ -min(s_i A_i, clip(s_i, 1-eps_low,
    1+eps_high) A_i) w_i + beta (1/|o_i|) sum_t k3_it ] with w_i = min(exp((1/|o_i|) sum_t (old_logp_it -
    behavior_logp_it)), is_cap) (1 without behaviour log-probs); `normalizer` = G. `advantages` is one per
    sequence [B]. The GSPO paper uses much narrower clip ranges than the token-level losses (e.g. 3e-4 / 4e-4).
    Statistics count tokens: a clipped sequence clips all its tokens, ratio_sum is sum_i s_i |o_i|."""
    check_loss_inputs(logp, old_logp, mask, clip_low, clip_high, ref_logp, kl_coef, behavior_logp, is_cap)
    if advantages.dim() != 1 or advantages.shape[0] != logp.shape[0]:
        raise SpecRLError(f"gspo needs one advantage per sequence, shape [{logp.shape[0]}], got "
                          f"{tuple(advantages.shape)}")
    m = mask.to(logp.dtype)
    lengths = m.sum(1)
    per_len = lengths.clamp_min(1.0)
    adv = advantages.to(logp.dtype)
    ratio = torch.exp(((logp - old_logp.detach()) * m).sum(1) / per_len)
    surr1 = ratio * adv
    surr2 = torch.clamp(ratio, 1.0 - clip_low, 1.0 + clip_high) * adv
    pg = -torch.minimum(surr1, surr2)
    is_stats = {}
    if behavior_logp is not None:
        raw_w = torch.exp(((old_logp.detach() - behavior_logp.detach()) * m).sum(1) / per_len)
        is_w = raw_w.clamp(max=is_cap)
        pg = pg * is_w
        has = lengths > 0
        is_stats = {"is_weight_sum": float((is_w * lengths).sum()),
                    "is_weight_max": float(is_w[has].max()) if bool(has.any()) else 0.0,
                    "is_clipped_tokens": float(((raw_w > is_cap).to(logp.dtype) * lengths).sum())}
    per_seq = pg
    kl_sum = 0.0
    if ref_logp is not None and kl_coef > 0:
        kl = kl_k3(logp, ref_logp.detach()) * m
        per_seq = per_seq + kl_coef * kl.sum(1) / per_len
        kl_sum = float(kl.detach().sum())
    loss = (per_seq * (lengths > 0).to(logp.dtype)).sum() / _check_normalizer(normalizer)
    with torch.no_grad():
        clipped = (surr2 < surr1).to(logp.dtype)
    return LossOutput(loss=loss, num_tokens=float(lengths.sum()), clipped_tokens=float((clipped * lengths).sum()),
                      kl_sum=kl_sum, ratio_sum=float((ratio.detach() * lengths).sum()),
                      pg_loss_sum=float(pg.detach().sum()), **is_stats)

"""GRPO mathematics as pure tensor functions: no model, no optimizer, no I/O.

This module owns group-normalised advantages (with the option to skip the std division, as in Dr. GRPO),
per-token log-probabilities from logits, the token-level clipped surrogate with separate low/high clip ranges
(DAPO) and optional truncated importance sampling against behaviour log-probs, the k3 KL estimator to a
reference policy, masking of padded tokens, and the `token_mult_prob_error` diagnostic that compares the rollout
engine's log-probabilities with the trainer's recomputation. Everything here is deterministic and unit-tested
against hand-computed values.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from specrl.errors import SpecRLError


def group_signal(rewards: torch.Tensor, group_size: int, dynamic_sampling: dict | None = None) -> dict[str, int]:
    """How many of a step's groups carry a learning signal: {"groups", "groups_nonzero_advantage"}, a group counting
    when its rewards are not all equal. With dynamic sampling's counts (`groups_trained`, `groups_filtered`), the
    groups generated, of which those kept had a non-zero advantage."""
    if dynamic_sampling:
        kept = int(dynamic_sampling["groups_trained"])
        return {"groups": kept + int(dynamic_sampling["groups_filtered"]), "groups_nonzero_advantage": kept}
    if group_size < 1 or rewards.numel() % group_size:
        raise SpecRLError(f"{rewards.numel()} rewards do not split into groups of {group_size}")
    grouped = rewards.reshape(-1, group_size)
    mixed = int((grouped != grouped[:, :1]).any(dim=1).sum())
    return {"groups": int(grouped.shape[0]), "groups_nonzero_advantage": mixed}


def group_advantages(
    rewards: torch.Tensor, group_size: int, normalize_std: bool = True, eps: float = 1e-6
) -> torch.Tensor:
    """Advantage of each sample relative to its group: (r - mean_group) [/ (std_group + eps)].

    `rewards` is flat [num_prompts * group_size] with the samples of one prompt contiguous. The std is the
    unbiased sample std (as in TRL / NeMo-RL). A group whose rewards are all equal gets zero advantage.
    """
    if rewards.dim() != 1:
        raise SpecRLError(f"rewards must be a 1-D tensor, got shape {tuple(rewards.shape)}")
    if group_size < 2:
        raise SpecRLError(f"group_size must be >= 2 (GRPO compares samples within a group), got {group_size}")
    if rewards.numel() % group_size != 0:
        raise SpecRLError(
            f"number of rewards ({rewards.numel()}) must be a multiple of group_size ({group_size})"
        )
    grouped = rewards.float().view(-1, group_size)
    centred = grouped - grouped.mean(dim=1, keepdim=True)
    if normalize_std:
        centred = centred / (grouped.std(dim=1, keepdim=True) + eps)
    return centred.reshape(-1)


def filtered(top_p: float, top_k: int) -> bool:
    """Whether the sampler's top-p / top-k filter changes the distribution (top_p < 1 or top_k > 0)."""
    return top_p < 1.0 or top_k > 0


def sampler_support(scaled: torch.Tensor, targets: torch.Tensor, top_p: float, top_k: int) -> torch.Tensor:
    """Bool [..., V]: the tokens the sampler's top-k / top-p filter keeps for tempered logits `scaled` (the one
    definition, `specrl.rollout.sampling.scaled_logits`), plus each row's target: a token sampled at the filter's
    boundary that the trainer's rounding puts just outside keeps a finite log-probability."""
    from specrl.rollout.sampling import scaled_logits

    lead, dev = scaled.shape[:-1], scaled.device
    kept = scaled_logits(scaled.detach(), torch.ones(lead, device=dev), torch.full(lead, float(top_p), device=dev),
                         torch.full(lead, int(top_k), dtype=torch.long, device=dev))
    return torch.isfinite(kept).scatter_(-1, targets.unsqueeze(-1), True)


def token_logprobs(logits: torch.Tensor, targets: torch.Tensor, temperature: float = 1.0, top_p: float = 1.0,
                   top_k: int = 0) -> torch.Tensor:
    """log p(target) under the sampler's distribution: softmax(logits / temperature) restricted to its top-k /
    top-p set and renormalised (`sampler_support`); logits [B,T,V], targets [B,T] -> [B,T].

    This is the behaviour distribution the rollout engine sampled from and reports the log-probability under, so
    the importance ratio is 1 at lag 0 whatever the filter. The gradient treats the kept set as fixed (it flows
    to the kept tokens' logits only), as the filter is a step function of the logits.
    """
    if temperature <= 0:
        raise SpecRLError(f"temperature must be > 0 to compute log-probabilities, got {temperature}")
    logits = logits.float()
    if temperature != 1.0:
        logits = logits / temperature
    if filtered(top_p, top_k):
        logits = logits.masked_fill(~sampler_support(logits, targets, top_p, top_k), float("-inf"))
    logz = torch.logsumexp(logits, dim=-1)
    picked = torch.gather(logits, -1, targets.unsqueeze(-1)).squeeze(-1)
    return picked - logz


def masked_sum(x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """Sum of x over positions where mask is true (mask is bool or 0/1)."""
    return (x * mask.to(x.dtype)).sum()


def masked_mean(x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """Mean of x over masked positions; 0 when the mask is empty."""
    m = mask.to(x.dtype)
    return (x * m).sum() / m.sum().clamp_min(1.0)


def kl_k3(logp: torch.Tensor, ref_logp: torch.Tensor) -> torch.Tensor:
    """Per-token k3 estimator of KL(pi || pi_ref): exp(r) - r - 1 with r = ref_logp - logp (>= 0)."""
    r = ref_logp - logp
    return torch.exp(r) - r - 1.0


@dataclass
class LossOutput:
    """The scalar loss to backpropagate and detached per-batch statistics (sums, for exact aggregation)."""

    loss: torch.Tensor
    num_tokens: float
    clipped_tokens: float
    kl_sum: float
    ratio_sum: float
    pg_loss_sum: float
    is_weight_sum: float = 0.0  # truncated importance weights (0 when the correction is off)
    is_weight_max: float = 0.0
    is_clipped_tokens: float = 0.0  # tokens whose weight was truncated at the cap


@dataclass
class SurrogateTerms:
    """Per-token pieces of the clipped surrogate, before any normalisation (see `surrogate_terms`)."""

    per_token: torch.Tensor  # pg (* IS weight) + kl_coef * kl, [B,T], with gradient
    mask: torch.Tensor  # the mask in logp's dtype
    ratio: torch.Tensor
    surr1: torch.Tensor
    surr2: torch.Tensor
    pg: torch.Tensor
    kl_sum: float
    is_stats: dict

    def output(self, loss: torch.Tensor) -> LossOutput:
        """The LossOutput of `loss` with this batch's token-level statistics."""
        m = self.mask
        with torch.no_grad():
            was_clipped = (self.surr2 < self.surr1).to(m.dtype)
        return LossOutput(
            loss=loss,
            num_tokens=float(m.sum().item()),
            clipped_tokens=float(masked_sum(was_clipped, m).item()),
            kl_sum=self.kl_sum,
            ratio_sum=float(masked_sum(self.ratio.detach(), m).item()),
            pg_loss_sum=float(masked_sum(self.pg.detach(), m).item()),
            **self.is_stats,
        )


def check_loss_inputs(logp: torch.Tensor, old_logp: torch.Tensor, mask: torch.Tensor, clip_low: float,
                      clip_high: float, ref_logp: torch.Tensor | None, kl_coef: float,
                      behavior_logp: torch.Tensor | None, is_cap: float) -> None:
    """The shape and range checks every loss of `specrl.algorithms.losses` shares (SpecRLError naming the input)."""
    if clip_low < 0 or clip_high < 0:
        raise SpecRLError(f"clip_low and clip_high must be >= 0, got {clip_low} and {clip_high}")
    if logp.shape != old_logp.shape or logp.shape != mask.shape:
        raise SpecRLError(
            f"logp {tuple(logp.shape)}, old_logp {tuple(old_logp.shape)} and mask {tuple(mask.shape)} "
            "must have the same [batch, tokens] shape"
        )
    if kl_coef > 0 and ref_logp is None:
        raise SpecRLError("kl_coef > 0 needs ref_logp (reference-policy log-probabilities)")
    if behavior_logp is not None:
        if behavior_logp.shape != logp.shape:
            raise SpecRLError(f"behavior_logp {tuple(behavior_logp.shape)} must have the shape of logp "
                              f"{tuple(logp.shape)}")
        if not is_cap >= 1.0:
            raise SpecRLError(f"is_cap must be >= 1 (a truncation cap on importance weights), got {is_cap}")


def surrogate_terms(
    logp: torch.Tensor,
    old_logp: torch.Tensor,
    advantages: torch.Tensor,
    mask: torch.Tensor,
    clip_low: float = 0.2,
    clip_high: float = 0.28,
    ref_logp: torch.Tensor | None = None,
    kl_coef: float = 0.0,
    behavior_logp: torch.Tensor | None = None,
    is_cap: float = 2.0,
) -> SurrogateTerms:
    """Per token: ratio = exp(logp - old_logp); pg = -min(ratio*A, clip(ratio, 1-clip_low, 1+clip_high)*A),
    times the truncated IS weight min(exp(old_logp - behavior_logp), is_cap) when `behavior_logp` is given, plus
    kl_coef * k3(logp, ref_logp). The token-level losses reduce `per_token` with their own normaliser."""
    check_loss_inputs(logp, old_logp, mask, clip_low, clip_high, ref_logp, kl_coef, behavior_logp, is_cap)
    adv = advantages.to(logp.dtype)
    if adv.dim() == 1:
        adv = adv.unsqueeze(1).expand_as(logp)
    m = mask.to(logp.dtype)
    ratio = torch.exp(logp - old_logp.detach())
    clipped_ratio = torch.clamp(ratio, 1.0 - clip_low, 1.0 + clip_high)
    surr1 = ratio * adv
    surr2 = clipped_ratio * adv
    pg = -torch.minimum(surr1, surr2)
    is_stats = {}
    if behavior_logp is not None:
        raw_w = torch.exp(old_logp.detach() - behavior_logp.detach())
        is_w = raw_w.clamp(max=is_cap)
        pg = pg * is_w
        is_stats = {"is_weight_sum": float(masked_sum(is_w, m).item()),
                    "is_weight_max": float(is_w[mask.bool()].max().item()) if bool(mask.any()) else 0.0,
                    "is_clipped_tokens": float(masked_sum((raw_w > is_cap).to(logp.dtype), m).item())}
    per_token = pg
    kl_sum = 0.0
    if ref_logp is not None and kl_coef > 0:
        kl = kl_k3(logp, ref_logp.detach())
        per_token = per_token + kl_coef * kl
        kl_sum = float(masked_sum(kl.detach(), m).item())
    return SurrogateTerms(per_token, m, ratio, surr1, surr2, pg, kl_sum, is_stats)


def clipped_surrogate_loss(
    logp: torch.Tensor,
    old_logp: torch.Tensor,
    advantages: torch.Tensor,
    mask: torch.Tensor,
    clip_low: float = 0.2,
    clip_high: float = 0.28,
    ref_logp: torch.Tensor | None = None,
    kl_coef: float = 0.0,
    normalizer: float | None = None,
    behavior_logp: torch.Tensor | None = None,
    is_cap: float = 2.0,
) -> LossOutput:
    """Token-level clipped surrogate (DAPO) plus optional k3 KL penalty and truncated importance sampling.

    Per token: ratio = exp(logp - old_logp); pg = -min(ratio*A, clip(ratio, 1-clip_low, 1+clip_high)*A);
    loss = sum_tokens(pg + kl_coef*kl) / normalizer, where normalizer defaults to the number of unmasked
    tokens here. Pass the token count of the whole batch as `normalizer` when accumulating micro-batches so
    every token of the batch weighs the same (token-level, not sequence-level, averaging).
    `logp`, `old_logp`, `ref_logp`, `mask`: [B,T]; `advantages`: [B] (one per sequence) or [B,T].

    Truncated importance sampling (off unless `behavior_logp` is given): the rollouts were sampled from a
    behaviour distribution mu (the rollout backend's processed distribution, possibly an older policy version)
    while the surrogate is built around pi_old (the learner's recomputation). Each token's pg term is weighted by
    w = min(exp(old_logp - behavior_logp), is_cap), detached, so the gradient estimates the expectation under
    pi_old. With `behavior_logp=None` the loss is bit-identical to the uncorrected one.
    """
    t = surrogate_terms(logp, old_logp, advantages, mask, clip_low, clip_high, ref_logp, kl_coef, behavior_logp,
                        is_cap)
    n_tokens = float(t.mask.sum().item())
    norm = float(normalizer) if normalizer is not None else max(n_tokens, 1.0)
    if norm <= 0:
        raise SpecRLError(f"normalizer must be > 0, got {normalizer}")
    return t.output((t.per_token * t.mask).sum() / norm)


def token_mult_prob_error(gen_logp: torch.Tensor, train_logp: torch.Tensor, mask: torch.Tensor) -> float:
    """Mean over unmasked tokens of exp(|logp_gen - logp_train|); 1.0 means the two agree exactly."""
    if gen_logp.shape != train_logp.shape or gen_logp.shape != mask.shape:
        raise SpecRLError(
            f"gen_logp {tuple(gen_logp.shape)}, train_logp {tuple(train_logp.shape)} and mask "
            f"{tuple(mask.shape)} must have the same shape"
        )
    if not bool(mask.any()):
        return 1.0
    err = torch.exp((gen_logp.double() - train_logp.double()).abs())
    return float(masked_mean(err, mask).item())

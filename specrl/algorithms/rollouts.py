"""One step's rollouts: what the producer hands the learner (per sample: prompt, response, behaviour log-probs,
reward, policy versions), and how the parts of one step are merged and a step's groups selected.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
from torch import Tensor

from specrl.errors import SpecRLError
from specrl.rollout.generation_metrics import merge_metrics


@dataclass
class Rollouts:
    """What `gen` produced for one step: N = num_prompts_per_step * num_generations samples."""

    problem_indices: list[int]
    prompts: list[list[int]]
    responses: list[list[int]]
    gen_logprobs: list[list[float]]  # behaviour log-probs (see specrl.rollout.protocol)
    finish_reasons: list[str]
    rewards: Tensor
    correct: list[bool]
    formatted: list[bool | None]  # an answer could be read back (built-in tasks); None for user rewards
    engine_metrics: dict = field(default_factory=dict)
    policy_versions: list[int] = field(default_factory=list)  # per sample: the weights that generated it
    step_index: int = 0  # 0-based index of the step these rollouts were generated for
    request_ids: list[int] = field(default_factory=list)  # per sample: unique across the run (step, group, sample)
    reward_components: dict[str, list[float]] = field(default_factory=dict)  # per reward function, per sample
    # per sample, per response token: the policy version that produced it (with in-flight updates a sample may
    # span two versions; policy_versions holds each sample's oldest)
    token_versions: list[list[int]] = field(default_factory=list)
    # dynamic sampling's counts for the step (`fill_groups`): groups_trained, groups_filtered, extra_prompts_drawn,
    # reward_mean_generated; empty when it is off
    dynamic_sampling: dict = field(default_factory=dict)

    @property
    def policy_version(self) -> int:
        """The oldest policy version among the samples (what a lag bound must check)."""
        return min(self.policy_versions) if self.policy_versions else 0


def merge_rollouts(parts: list[Rollouts], wall_seconds: float | None = None) -> Rollouts:
    """One step's `Rollouts` from its parts (in group order), generation metrics merged."""
    if not parts or len({p.step_index for p in parts}) != 1:
        raise SpecRLError("merge_rollouts needs the parts of exactly one step")
    if len(parts) == 1:
        return parts[0]

    def cat(name: str) -> list:
        return [x for p in parts for x in getattr(p, name)]

    return Rollouts(cat("problem_indices"), cat("prompts"), cat("responses"), cat("gen_logprobs"),
                    cat("finish_reasons"), torch.cat([p.rewards for p in parts]), cat("correct"), cat("formatted"),
                    merge_metrics([p.engine_metrics for p in parts], wall_seconds), cat("policy_versions"),
                    parts[0].step_index, cat("request_ids"),
                    {k: [x for p in parts for x in p.reward_components[k]] for k in parts[0].reward_components},
                    cat("token_versions"))


def select_groups(r: Rollouts, groups: list[int], group_size: int) -> Rollouts:
    """The samples of `groups` (indices of r's groups, in that order); generation metrics are kept whole."""
    rows = [g * group_size + j for g in groups for j in range(group_size)]

    def pick(xs: list) -> list:
        return [xs[i] for i in rows] if xs else xs

    return Rollouts(pick(r.problem_indices), pick(r.prompts), pick(r.responses), pick(r.gen_logprobs),
                    pick(r.finish_reasons), r.rewards[rows], pick(r.correct), pick(r.formatted), r.engine_metrics,
                    pick(r.policy_versions), r.step_index, pick(r.request_ids),
                    {k: pick(v) for k, v in r.reward_components.items()}, pick(r.token_versions))

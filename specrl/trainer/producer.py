"""The rollout side of an RL step: task data and generation -> `Rollouts` tagged with their policy version.

`RolloutProducer` owns the task's train/validation data, the prompt formatting, the data cursor and the reward
scoring, and reaches the rollout backend only through the protocol (`specrl.rollout.protocol`): `generate` for the
samples and `policy_version` for the tag. `stage_data` and `stage_gen` are two of the five timed stages of a
step. The sync trainer
composes it with the learner in one process; the async pipeline runs the same producer in each rollout worker.
Request ids are derived from the step index, so a step's samples replay exactly whatever ran before them.
Each sample carries its policy version (the oldest among its tokens) and each token its own (`token_versions`).

Dynamic sampling (`grpo.filter_zero_advantage_groups`, DAPO): `fill_groups` drops the groups whose rewards are
all equal (zero advantage: no policy gradient) and generates groups for extra prompts until the step has
`grpo.num_prompts_per_step` groups or `grpo.max_extra_prompt_draws` extra prompts were drawn; then it trains on
what it has. Extra prompts are a pure function of (run seed, step, round) (`extra_prompts`), not of the data
cursor, so the sync trainer and the async driver draw the same ones and a resumed run draws them again; their
request ids live in their own range (`request_ids`). Speculation cannot change which groups are kept:
a group's rewards depend only on its tokens, which speculative decoding leaves distributed (or, with
seed_exact, identical) as plain decoding.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy as np
import torch
from torch import Tensor

from specrl.algorithms.rollouts import Rollouts, merge_rollouts, select_groups
from specrl.config.schema import TrainConfig
from specrl.data.datasets import DATASET_TASK, make_dataset_task
from specrl.data.rewards import builtin_rewards, user_rewards
from specrl.data.tasks import (
    ANSWER_FORMATS,
    PromptFormatter,
    PromptSampler,
    extract_answer,
    make_task,
    resolve_answer_format,
)
from specrl.errors import SpecRLError
from specrl.rollout.protocol import RolloutBackend, RolloutRequest
from specrl.rollout.sampling import SamplingParams

VAL_REQUEST_BASE = 10**12  # validation request ids: far from any training step's ids
EXTRA_REQUEST_BASE = 5 * 10**11  # dynamic sampling's extra groups: their own id range (see `request_ids`)


def informative_groups(rewards: Tensor, group_size: int) -> list[int]:
    """Indices of the groups whose rewards are not all equal (the ones with a non-zero advantage)."""
    grouped = rewards.view(-1, group_size)
    return [g for g in range(grouped.shape[0]) if bool((grouped[g] != grouped[g, 0]).any())]


def extra_prompts(seed: int, train_size: int, step_index: int, round_: int, count: int,
                  exclude: set[int]) -> list[int]:
    """`count` train prompt indices for dynamic sampling's round `round_` of a step: drawn from a generator seeded
    with (run seed, step, round), skipping `exclude` (the step's prompts so far) while others remain."""
    rng = np.random.default_rng([seed % 2**32, 0x5EED, step_index, round_])
    out: list[int] = []
    while len(out) < count:
        i = int(rng.integers(train_size))
        if (i in exclude or i in out) and len(exclude) + len(out) < train_size:
            continue
        out.append(i)
    return out


def fill_groups(cfg: TrainConfig, train_size: int, step_index: int, r: Rollouts,
                generate: Callable[[list[int], int], Rollouts]) -> Rollouts:
    """Dynamic sampling (a no-op unless grpo.filter_zero_advantage_groups): keep r's groups whose rewards are not
    all equal and call `generate(prompt_indices, first_group)` (-> their Rollouts, scored) for extra prompts until
    the step has num_prompts_per_step such groups or max_extra_prompt_draws prompts were drawn; surplus groups of
    the last round are dropped. When no group is informative, the step's own groups are trained as they are (zero
    advantage: only a KL term moves the weights). The counts go into `Rollouts.dynamic_sampling`; generation
    metrics cover every group generated."""
    g = cfg.grpo
    if not g.filter_zero_advantage_groups:
        return r
    n, want = g.num_generations, g.num_prompts_per_step
    parts, kept = [r], [(0, k) for k in informative_groups(r.rewards, n)]
    used, drawn, round_ = set(r.problem_indices), 0, 0
    while len(kept) < want and drawn < g.max_extra_prompt_draws:
        idx = extra_prompts(cfg.run.seed, train_size, step_index, round_,
                            min(want - len(kept), g.max_extra_prompt_draws - drawn), used)
        extra = generate(idx, want + drawn)
        parts.append(extra)
        kept += [(len(parts) - 1, k) for k in informative_groups(extra.rewards, n)][: want - len(kept)]
        used.update(idx)
        drawn += len(idx)
        round_ += 1
    generated = merge_rollouts(parts)
    offsets = np.cumsum([0] + [len(p.prompts) // n for p in parts])
    groups = [int(offsets[part]) + k for part, k in kept] or list(range(len(r.prompts) // n))
    out = select_groups(generated, groups, n)
    out.dynamic_sampling = {"groups_trained": len(kept), "groups_filtered": len(generated.prompts) // n - len(kept),
                            "extra_prompts_drawn": drawn, "reward_mean_generated": float(generated.rewards.mean())}
    return out


class RolloutProducer:
    """Task data + a rollout backend -> scored `Rollouts` for a given step."""

    def __init__(self, cfg: TrainConfig, tokenizer: Any, backend: RolloutBackend, stop_ids: tuple[int, ...]):
        if not stop_ids:
            raise SpecRLError("the tokenizer/model define no end-of-sequence token; generation could not stop")
        self.cfg = cfg
        self.backend = backend
        self.stop_ids = tuple(stop_ids)
        t = cfg.task
        if t.name == DATASET_TASK:  # the user's rows; their prompts are used as written unless a format is asked
            self.train_data, self.val_data = make_dataset_task(t)
            self.answer_format = None if t.answer_format == "auto" else t.answer_format
        else:
            self.train_data, self.val_data = make_task(t.name, t.difficulty, t.options, t.train_size, t.val_size,
                                                       t.seed)
            self.answer_format = resolve_answer_format(t.name, t.answer_format)
        instruction = ANSWER_FORMATS[self.answer_format] if self.answer_format else ""
        self.formatter = PromptFormatter(tokenizer, t.system_prompt, instruction)
        if cfg.reward.functions:
            self.rewards = {"train": user_rewards(cfg.reward.functions, cfg.reward.weights)}
            self.rewards["val"] = self.rewards["train"]
        else:
            self.rewards = {split: builtin_rewards(data, self.answer_format, t.format_weight)
                            for split, data in (("train", self.train_data), ("val", self.val_data))}
        self.sampler = PromptSampler(len(self.train_data), seed=cfg.run.seed)
        self._prompt_cache: dict[tuple[str, int], tuple[list[int], str]] = {}

    @property
    def num_samples(self) -> int:
        return self.cfg.grpo.num_prompts_per_step * self.cfg.grpo.num_generations

    def prompt(self, split: str, index: int) -> list[int]:
        return self._prompt(split, index)[0]

    def _prompt(self, split: str, index: int) -> tuple[list[int], str]:
        key = (split, index)
        if key not in self._prompt_cache:
            data = self.train_data if split == "train" else self.val_data
            text = self.formatter.text(data[index].question)
            ids = list(self.formatter.tokenizer.encode(text, add_special_tokens=False))
            budget = self.cfg.model.max_seq_len - self.cfg.generation.max_new_tokens
            if len(ids) > budget:
                row = f" (row {data[index].entry['_row']} of {self.cfg.task.path})" if data.name == DATASET_TASK \
                    else ""
                raise SpecRLError(
                    f"a {split} prompt{row} has {len(ids)} tokens but model.max_seq_len "
                    f"({self.cfg.model.max_seq_len}) "
                    f"- generation.max_new_tokens ({self.cfg.generation.max_new_tokens}) leaves {budget}; raise "
                    f"model.max_seq_len to >= {len(ids) + self.cfg.generation.max_new_tokens} or lower "
                    "generation.max_new_tokens"
                )
            self._prompt_cache[key] = ids, text
        return self._prompt_cache[key]

    def sampling(self, greedy: bool = False) -> SamplingParams:
        g = self.cfg.generation
        return SamplingParams(temperature=0.0 if greedy else g.temperature, top_p=1.0 if greedy else g.top_p,
                              top_k=0 if greedy else g.top_k, max_new_tokens=g.max_new_tokens,
                              stop_token_ids=self.stop_ids, seed=self.cfg.run.seed)

    # ------------------------------------------------------------------ stages
    def stage_data(self) -> list[int]:
        """Indices of the next step's prompts in the train split (advances the data cursor)."""
        idx = self.sampler.next(self.cfg.grpo.num_prompts_per_step)
        for i in idx:
            self.prompt("train", i)
        return idx

    def stage_gen(self, step_index: int, prompt_indices: list[int], first_group: int = 0) -> Rollouts:
        """num_generations samples per prompt, scored; ids depend on the step so steps differ but replay.

        `prompt_indices` may be a slice of the step's groups starting at group `first_group` (a rollout worker's
        share): request and group ids are the step's global ones, so the parts merge into the whole step."""
        n = self.cfg.grpo.num_generations
        problems = [i for i in prompt_indices for _ in range(n)]
        base = self.request_ids(step_index, first_group)
        # no group id: the engine groups requests by prompt, so a prompt's samples are siblings and a prompt that
        # comes back in a later epoch finds its earlier rollouts in a history-keeping drafter's index
        requests = [RolloutRequest(self.prompt("train", i), base + j) for j, i in enumerate(problems)]
        result = self.backend.generate(requests, self.sampling())
        rewards, correct, formatted, components = self._score("train", problems, result)
        return Rollouts(problems, [r.prompt_token_ids for r in requests], [list(o.token_ids) for o in result],
                        [list(o.logprobs) for o in result], [o.finish_reason for o in result],
                        torch.tensor(rewards, dtype=torch.float32), correct, formatted, dict(result.metrics),
                        result.policy_versions, step_index, [r.request_id for r in requests], components,
                        [list(o.token_versions) if o.token_versions is not None else
                         [o.policy_version] * len(o.token_ids) for o in result])

    def request_ids(self, step_index: int, group: int) -> int:
        """The first request id of group `group` of a step. Groups 0 .. num_prompts_per_step - 1 are the step's
        own; higher ones are dynamic sampling's extra groups, numbered in a range of their own (up to
        max_extra_prompt_draws per step), so no id is shared with another step's or a validation request."""
        g = self.cfg.grpo
        n, p = g.num_generations, g.num_prompts_per_step
        if group < p:
            return step_index * self.num_samples + group * n
        extra = step_index * max(1, g.max_extra_prompt_draws) + group - p
        return EXTRA_REQUEST_BASE + extra * n

    def fill_groups(self, step_index: int, r: Rollouts, generate: Callable[[list[int], int], Rollouts]) -> Rollouts:
        """`fill_groups` with this producer's config and train split."""
        return fill_groups(self.cfg, len(self.train_data), step_index, r, generate)

    def _score(self, split: str, problems: list[int], outputs) -> tuple[list, list, list, dict]:
        """Rewards (weighted totals), correct, formatted and per-function values of each output."""
        data, rs = (self.train_data, self.rewards["train"]) if split == "train" else (self.val_data,
                                                                                      self.rewards["val"])
        rewards, correct, formatted = [], [], []
        components: dict[str, list[float]] = {name: [] for name in rs.names}
        for i, o in zip(problems, outputs, strict=True):
            completion = self.formatter.decode(o.token_ids)
            problem = data[i]
            where = f"{split} row {problem.entry.get('_row', problem.index)}"
            s = rs.score(self._prompt(split, i)[1], completion, problem.entry, where)
            rewards.append(s.reward)
            correct.append(s.correct)
            formatted.append(None if self.cfg.reward.functions else
                             extract_answer(completion, self.answer_format) is not None)
            for name, v in s.components.items():
                components[name].append(v)
        return rewards, correct, formatted, components

    def validate(self) -> dict[str, Any]:
        """Greedy accuracy on the held-out split with the weights the backend holds now."""
        if len(self.val_data) == 0:
            return {"accuracy": None, "val_reward": None, "val_format_rate": None}
        requests = [RolloutRequest(self.prompt("val", i), VAL_REQUEST_BASE + i) for i in range(len(self.val_data))]
        outs = self.backend.generate(requests, self.sampling(greedy=True))
        rewards, correct, formatted, _ = self._score("val", list(range(len(self.val_data))), outs)
        return {"accuracy": float(np.mean(correct)), "val_questions": len(correct),
                "val_reward": float(np.mean(rewards)),
                "val_format_rate": None if None in formatted else float(np.mean(formatted))}

    # ------------------------------------------------------------------ state
    def state_dict(self) -> dict:
        return {"sampler": self.sampler.state_dict()}

    def load_state_dict(self, state: dict) -> None:
        self.sampler.load_state_dict(state["sampler"])

"""Synchronous GRPO: the one step definition (data → prepare → gen → logprob → train) and the run loop.

`GRPOTrainer.step()` runs the five stages, each timed with `time.perf_counter`, and returns the step's
`metrics.jsonl` record. The trainer owns the policy (and, with `drafter.online`, a trainable drafter); the
rollout engine owns its own copy of the weights and is reached only through a `WeightSync` (`prepare`), so
the async pipeline can move the engine into another actor and reuse `step` unchanged. Log-probabilities for
the loss are recomputed by the trainer in `logprob`; the engine's are only compared
(`token_mult_prob_error`). `run_training` adds validation, checkpoints, resume, metrics, the live display and
the final report; `train_main` is the entry point the `specrl train` CLI calls. After `train`, the staleness
control loop (`DrafterHealth`) compares the step's acceptance length with the reference AL and, for a stale
trainable drafter, spends `drafter.refresh_steps` extra drafter-only updates on the step's captured rollouts
(timed as part of `train`); a drafter stuck near AL 1 raises a `DrafterCollapseWarning`.
"""

from __future__ import annotations

import contextlib
import copy
import math
import os
import random
import signal
import time
import warnings
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch import Tensor

from specrl.errors import SpecRLError
from specrl.rl.config import TrainConfig
from specrl.rl.draft_online import DrafterCollapseWarning, DrafterHealth, check_trainable, draft_batch, draft_loss
from specrl.rl.grpo import clipped_surrogate_loss, group_advantages, token_logprobs, token_mult_prob_error
from specrl.rl.metrics import STAGES
from specrl.rl.tasks import (
    ANSWER_FORMATS,
    PromptFormatter,
    PromptSampler,
    make_task,
    resolve_answer_format,
    score_response,
)
from specrl.rl.weight_sync import LocalWeightSync, WeightSync, policy_state

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}
# Test hook: SIGKILL this process at the start of the train stage of this step (resume tests).
KILL_ENV = "SPECRL_TEST_SIGKILL_AT_STEP"
MIN_DRAFTS_FOR_HEALTH = 32  # drafted tokens a step needs before its acceptance length counts for staleness/collapse


class NonFiniteError(SpecRLError):
    """Loss, logits or gradients became NaN/inf; the step's update was not applied."""


@dataclass
class Rollouts:
    """What `gen` produced for one step: N = num_prompts_per_step * num_generations samples."""

    problem_indices: list[int]
    prompts: list[list[int]]
    responses: list[list[int]]
    gen_logprobs: list[list[float]]
    finish_reasons: list[str]
    rewards: Tensor
    correct: list[bool]
    formatted: list[bool]
    engine_metrics: dict = field(default_factory=dict)


@dataclass
class Batch:
    """Right-padded training tensors; position t of `mask`/`*_logp` scores token t+1 of `tokens`."""

    tokens: Tensor  # [N, T]
    mask: Tensor  # [N, T-1] bool: target token is a response token
    gen_logp: Tensor  # [N, T-1]
    advantages: Tensor  # [N]
    old_logp: Tensor | None = None
    ref_logp: Tensor | None = None
    captured: list[dict] = field(default_factory=list)  # per micro-batch, detached hidden states


def build_drafter(spec: str, model: Any, tokenizer: Any) -> Any:
    """A drafter from a `speculative.drafter` string via `specrl.drafters.make_drafter`; None for "none"."""
    if spec == "none":
        return None
    from specrl.drafters import make_drafter

    return make_drafter(spec, target=model)


def lr_factor(step: int, warmup: int, total: int, schedule: str, min_ratio: float) -> float:
    """Multiplier of the base learning rate for optimizer step `step` (0-based)."""
    if warmup > 0 and step < warmup:
        return (step + 1) / warmup
    if schedule == "constant" or total <= warmup:
        return 1.0
    progress = min(1.0, (step - warmup) / max(1, total - warmup))
    if schedule == "linear":
        return 1.0 - (1.0 - min_ratio) * progress
    return min_ratio + (1.0 - min_ratio) * 0.5 * (1.0 + math.cos(math.pi * progress))


def response_logprobs(model: Any, toks: Tensor, mask: Tensor, temperature: float,
                      capture: tuple = (), keep_logits: bool = False) -> tuple[Tensor, dict]:
    """Log-probabilities [B, T-1] of toks[:, 1:] (0 where mask is false) and the captured hidden states.

    The LM head (a large share of a small model's FLOPs) runs only on the response positions of `mask`;
    with keep_logits those logits [mask.sum(), V] are returned as captured["response_logits"].
    """
    if hasattr(model, "forward_hidden") and hasattr(model, "logits"):
        hidden, captured = model.forward_hidden(toks, capture=capture)
        captured["final"] = hidden
        logits = model.logits(hidden[:, :-1][mask])
        flat = token_logprobs(logits.unsqueeze(0), toks[:, 1:][mask].unsqueeze(0), temperature)[0]
        if keep_logits:
            captured["response_logits"] = logits.detach()
        return torch.zeros(mask.shape, dtype=flat.dtype).masked_scatter(mask, flat), captured
    logits, captured = model(toks, capture=capture)
    if keep_logits:
        captured["response_logits"] = logits[:, :-1][mask].detach()
    return token_logprobs(logits[:, :-1], toks[:, 1:], temperature) * mask, captured


def _chunks(n: int, size: int) -> list[list[int]]:
    return [list(range(i, min(n, i + size))) for i in range(0, n, size)]


class GRPOTrainer:
    """Policy, optimizer, task data and the five stages of one synchronous GRPO step."""

    def __init__(self, cfg: TrainConfig, policy: torch.nn.Module, tokenizer: Any, engine: Any,
                 weight_sync: WeightSync, trainer_drafter: Any = None):
        self.cfg = cfg
        self.policy = policy
        self.tokenizer = tokenizer
        self.engine = engine
        self.weight_sync = weight_sync
        self.drafter = trainer_drafter if cfg.drafter.online else None
        if cfg.drafter.online:
            check_trainable(self.drafter)
        t = cfg.task
        self.train_data, self.val_data = make_task(t.name, t.difficulty, t.options, t.train_size, t.val_size,
                                                   t.seed)
        self.answer_format = resolve_answer_format(t.name, t.answer_format)
        self.formatter = PromptFormatter(tokenizer, t.system_prompt, ANSWER_FORMATS[self.answer_format])
        self.sampler = PromptSampler(len(self.train_data), seed=cfg.run.seed)
        from specrl.model.tokenizer import stop_token_ids

        self.stop_ids = stop_token_ids(tokenizer, getattr(policy, "args", None))
        if not self.stop_ids:
            raise SpecRLError("the tokenizer/model define no end-of-sequence token; generation could not stop")
        self.ref = None
        if cfg.grpo.kl_coef > 0:
            self.ref = copy.deepcopy(policy).eval()
            for p in self.ref.parameters():
                p.requires_grad_(False)
        pc = cfg.policy
        groups = [{"params": [p for p in policy.parameters() if p.requires_grad], "lr": pc.learning_rate}]
        if self.drafter is not None:
            dlr = cfg.drafter.learning_rate or pc.learning_rate * 100
            groups.append({"params": [p for p in self.drafter.parameters() if p.requires_grad], "lr": dlr})
        self.optimizer = torch.optim.AdamW(groups, betas=pc.adam_betas, weight_decay=pc.weight_decay)
        total = cfg.run.steps
        self.scheduler = torch.optim.lr_scheduler.LambdaLR(
            self.optimizer, lambda s: lr_factor(s, pc.warmup_steps, total, pc.lr_schedule, pc.min_lr_ratio))
        self.step_count = 0
        self._prompt_cache: dict[tuple[str, int], list[int]] = {}
        self.last_rollouts: Rollouts | None = None
        self._capture = tuple(getattr(self.drafter, "target_layers", ()) or ()) if self.drafter else ()
        d = cfg.drafter
        self.health = DrafterHealth(d.staleness_fraction, d.collapse_threshold, d.collapse_patience)
        # where the trainer's event lines go; the run loop points it at its progress display
        self.log: Callable[[str], None] = lambda msg: print(msg, flush=True)

    # ------------------------------------------------------------------ construction
    @classmethod
    def from_config(cls, cfg: TrainConfig) -> GRPOTrainer:
        """Load the model, build the rollout engine (own weight copy), drafters and the weight sync."""
        from specrl import RolloutEngine, load_model

        policy, tokenizer = load_model(cfg.model.name, dtype=_DTYPES[cfg.model.dtype])
        if tokenizer is None:
            raise SpecRLError(f"model {cfg.model.name!r} has no tokenizer files; GRPO needs one to build prompts")
        ctx = policy.args.max_position_embeddings
        if cfg.model.max_seq_len > ctx:
            raise SpecRLError(f"model.max_seq_len ({cfg.model.max_seq_len}) exceeds the model's context "
                              f"({ctx} positions); set model.max_seq_len <= {ctx}")
        rollout_model = copy.deepcopy(policy).to(_DTYPES[cfg.model.rollout_dtype]).eval()
        for p in rollout_model.parameters():
            p.requires_grad_(False)
        sc = cfg.speculative
        engine_drafter = build_drafter(sc.drafter, rollout_model, tokenizer) if sc.enabled else None
        trainer_drafter = build_drafter(sc.drafter, policy, tokenizer) if cfg.drafter.online else None
        engine = RolloutEngine(rollout_model, max_batch_size=cfg.generation.max_batch_size,
                               max_seq_len=cfg.model.max_seq_len, drafter=engine_drafter,
                               num_draft_tokens=sc.num_draft_tokens if sc.enabled else 0, verify=sc.verify)
        policy.train()
        return cls(cfg, policy, tokenizer, engine, LocalWeightSync(engine), trainer_drafter)

    # ------------------------------------------------------------------ helpers
    def _prompt(self, split: str, index: int) -> list[int]:
        key = (split, index)
        if key not in self._prompt_cache:
            data = self.train_data if split == "train" else self.val_data
            ids = self.formatter.encode(data[index].question)
            budget = self.cfg.model.max_seq_len - self.cfg.generation.max_new_tokens
            if len(ids) > budget:
                raise SpecRLError(
                    f"a {split} prompt has {len(ids)} tokens but model.max_seq_len ({self.cfg.model.max_seq_len}) "
                    f"- generation.max_new_tokens ({self.cfg.generation.max_new_tokens}) leaves {budget}; raise "
                    f"model.max_seq_len to >= {len(ids) + self.cfg.generation.max_new_tokens} or lower "
                    "generation.max_new_tokens"
                )
            self._prompt_cache[key] = ids
        return self._prompt_cache[key]

    def _sampling(self, greedy: bool = False):
        from specrl import SamplingParams

        g = self.cfg.generation
        return SamplingParams(temperature=0.0 if greedy else g.temperature, top_p=1.0 if greedy else g.top_p,
                              top_k=0 if greedy else g.top_k, max_new_tokens=g.max_new_tokens,
                              stop_token_ids=self.stop_ids, seed=self.cfg.run.seed)

    def _autocast(self) -> contextlib.AbstractContextManager:
        if self.cfg.policy.precision == "bf16-mixed":
            return torch.autocast("cpu", dtype=torch.bfloat16)
        return contextlib.nullcontext()

    @property
    def num_samples(self) -> int:
        return self.cfg.grpo.num_prompts_per_step * self.cfg.grpo.num_generations

    # ------------------------------------------------------------------ the five stages
    def stage_data(self) -> list[int]:
        """Indices of this step's prompts in the train split (advances the data cursor)."""
        idx = self.sampler.next(self.cfg.grpo.num_prompts_per_step)
        for i in idx:
            self._prompt("train", i)
        return idx

    def stage_prepare(self) -> None:
        """Push the trainer's policy (and drafter, when the trainer trains it) into the rollout engine."""
        dstate = self.drafter.state_dict() if self.drafter is not None else None
        self.weight_sync.push(policy_state(self.policy), dstate)

    def stage_gen(self, prompt_indices: list[int]) -> Rollouts:
        """num_generations samples per prompt; ids are step-dependent so steps differ but replay exactly."""
        n = self.cfg.grpo.num_generations
        problems = [i for i in prompt_indices for _ in range(n)]
        prompts = [self._prompt("train", i) for i in problems]
        base = self.step_count * self.num_samples  # step_count is the 0-based index of this step here
        request_ids = [base + j for j in range(len(prompts))]
        group_ids = [self.step_count * len(prompt_indices) + j // n for j in range(len(prompts))]
        outs = self.engine.generate(prompts, self._sampling(), request_ids=request_ids, group_ids=group_ids)
        rewards, correct, formatted = [], [], []
        for i, o in zip(problems, outs, strict=True):
            s = score_response(self.train_data, self.train_data[i], self.formatter.decode(o.token_ids),
                               self.cfg.task.format_weight, self.answer_format)
            rewards.append(s.reward)
            correct.append(s.correct)
            formatted.append(s.formatted)
        return Rollouts(problems, prompts, [list(o.token_ids) for o in outs], [list(o.logprobs) for o in outs],
                        [o.finish_reason for o in outs], torch.tensor(rewards, dtype=torch.float32), correct,
                        formatted, dict(getattr(self.engine, "last_metrics", {}) or {}))

    def collate(self, r: Rollouts) -> Batch:
        n = len(r.prompts)
        lengths = [len(p) + len(x) for p, x in zip(r.prompts, r.responses, strict=True)]
        t = max(lengths)
        tokens = torch.zeros(n, t, dtype=torch.long)
        mask = torch.zeros(n, t - 1, dtype=torch.bool)
        gen_logp = torch.zeros(n, t - 1, dtype=torch.float32)
        for b, (p, x, lp) in enumerate(zip(r.prompts, r.responses, r.gen_logprobs, strict=True)):
            tokens[b, : len(p) + len(x)] = torch.tensor(p + x, dtype=torch.long)
            mask[b, len(p) - 1: len(p) - 1 + len(x)] = True
            gen_logp[b, len(p) - 1: len(p) - 1 + len(x)] = torch.tensor(lp, dtype=torch.float32)
        adv = group_advantages(r.rewards, self.cfg.grpo.num_generations, self.cfg.grpo.normalize_rewards)
        return Batch(tokens, mask, gen_logp, adv)

    def _micro(self, batch: Batch, idx: list[int]) -> tuple[Tensor, Tensor]:
        """Tokens and mask of a micro-batch, trimmed to its longest sequence."""
        m = batch.mask[idx]
        last = int(m.any(0).nonzero().max()) + 2 if bool(m.any()) else 2
        return batch.tokens[idx, :last], m[:, : last - 1]

    @torch.no_grad()
    def stage_logprob(self, r: Rollouts) -> Batch:
        """Recompute the policy's (and reference's) log-probabilities; capture hidden states for the drafter."""
        batch = self.collate(r)
        temp = self.cfg.generation.temperature
        old = torch.zeros_like(batch.gen_logp)
        ref = torch.zeros_like(batch.gen_logp) if self.ref is not None else None
        for idx in _chunks(len(r.prompts), self.cfg.policy.train_micro_batch_size):
            toks, m = self._micro(batch, idx)
            with self._autocast():
                lp, captured = response_logprobs(self.policy, toks, m, temp, self._capture,
                                                 keep_logits=self.drafter is not None)
            if not bool(torch.isfinite(lp[m]).all()):
                raise NonFiniteError(f"step {self.step_count + 1}: the policy produced non-finite logits in the "
                                     "logprob stage")
            old[idx, : lp.shape[1]] = lp
            if ref is not None:
                with self._autocast():
                    ref[idx, : lp.shape[1]] = response_logprobs(self.ref, toks, m, temp)[0]
            if self.drafter is not None:
                batch.captured.append(draft_batch(self.drafter, toks, m, captured, captured["response_logits"]))
        batch.old_logp, batch.ref_logp = old, ref
        return batch

    def stage_train(self, batch: Batch) -> dict[str, float]:
        """GRPO loss (+ loss_weight * draft loss) over micro-batches, one clipped AdamW step."""
        g, temp = self.cfg.grpo, self.cfg.generation.temperature
        step_no = self.step_count + 1
        self.optimizer.zero_grad(set_to_none=True)
        total_tokens = float(batch.mask.sum())
        stats = {"tokens": 0.0, "clipped": 0.0, "kl": 0.0, "ratio": 0.0, "loss": 0.0, "draft": 0.0}
        chunks = _chunks(batch.tokens.shape[0], self.cfg.policy.train_micro_batch_size)
        for c, idx in enumerate(chunks):
            toks, m = self._micro(batch, idx)
            w = m.shape[1]
            with self._autocast():
                logp, _ = response_logprobs(self.policy, toks, m, temp)
            out = clipped_surrogate_loss(
                logp, batch.old_logp[idx, :w], batch.advantages[idx], m, g.clip_low, g.clip_high,
                None if batch.ref_logp is None else batch.ref_logp[idx, :w], g.kl_coef,
                normalizer=max(total_tokens, 1.0))
            if not torch.isfinite(out.loss):
                self.optimizer.zero_grad(set_to_none=True)
                raise NonFiniteError(f"step {step_no}: non-finite GRPO loss ({out.loss.item()}); update skipped")
            out.loss.backward()
            stats["tokens"] += out.num_tokens
            stats["clipped"] += out.clipped_tokens
            stats["kl"] += out.kl_sum
            stats["ratio"] += out.ratio_sum
            stats["loss"] += float(out.loss.detach())
            if self.drafter is not None:
                dl = draft_loss(self.drafter, batch.captured[c])
                if not torch.isfinite(dl):
                    self.optimizer.zero_grad(set_to_none=True)
                    raise NonFiniteError(f"step {step_no}: non-finite drafter loss; update skipped")
                (self.cfg.drafter.loss_weight * dl / len(chunks)).backward()
                stats["draft"] += float(dl.detach()) / len(chunks)
        params = [p for p in self.policy.parameters() if p.requires_grad]
        gn = torch.nn.utils.clip_grad_norm_(params, self.cfg.policy.max_grad_norm)
        if not torch.isfinite(gn):
            self.optimizer.zero_grad(set_to_none=True)
            raise NonFiniteError(f"step {step_no}: non-finite gradient norm; update skipped")
        if self.drafter is not None:
            torch.nn.utils.clip_grad_norm_(list(self.drafter.parameters()), self.cfg.policy.max_grad_norm)
        lr = self.optimizer.param_groups[0]["lr"]
        self.optimizer.step()
        self.scheduler.step()
        ntok = max(stats["tokens"], 1.0)
        return {"loss": stats["loss"], "grad_norm": float(gn), "lr": lr, "clip_fraction": stats["clipped"] / ntok,
                "kl": stats["kl"] / ntok if self.ref is not None else None, "ratio_mean": stats["ratio"] / ntok,
                "draft_loss": stats["draft"] if self.drafter is not None else None}

    def refresh_drafter(self, batch: Batch) -> int:
        """`drafter.refresh_steps` drafter-only AdamW updates on this step's captured batches; returns the count.

        Each update backpropagates the draft loss of every captured micro-batch. The captures are detached
        from the policy graph, so only drafter parameters receive gradients; AdamW skips parameters without a
        gradient, so the policy's weights and optimizer state stay bit-identical. The scheduler is not
        stepped. The refreshed drafter reaches the engine in the next `prepare`, like online updates.
        """
        if self.drafter is None or not batch.captured:
            return 0
        params = [p for p in self.drafter.parameters() if p.requires_grad]
        for i in range(self.cfg.drafter.refresh_steps):
            self.optimizer.zero_grad(set_to_none=True)
            for c in batch.captured:
                dl = draft_loss(self.drafter, c)
                if not torch.isfinite(dl):
                    self.optimizer.zero_grad(set_to_none=True)
                    raise NonFiniteError(f"step {self.step_count + 1}: non-finite drafter loss in drafter refresh "
                                         f"update {i + 1}; that update was skipped (the step's policy update and "
                                         "earlier refresh updates were applied)")
                (dl / len(batch.captured)).backward()
            if any(p.grad is not None for p in self.policy.parameters()):
                raise RuntimeError("drafter refresh produced policy gradients; the drafter loss must be detached "
                                   "from the policy")
            torch.nn.utils.clip_grad_norm_(params, self.cfg.policy.max_grad_norm)
            self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        return self.cfg.drafter.refresh_steps

    def _drafter_control(self, batch: Batch, al: float | None) -> dict[str, Any]:
        """The staleness loop and collapse check after `train`; the step record's drafter fields."""
        step_no, d = self.step_count + 1, self.cfg.drafter
        stale, collapsed = self.health.observe(al)
        reference = self.health.reference
        updates = 1 if self.drafter is not None else 0
        refreshed = False
        if stale and self.drafter is not None and d.refresh_steps > 0:
            updates += self.refresh_drafter(batch)
            refreshed = True
            self.health.refreshed()
            self.log(f"[specrl] step {step_no}: drafter stale (acceptance length {al:.2f} < "
                     f"{d.staleness_fraction:g} x reference {reference:.2f}); refreshed it with {d.refresh_steps} "
                     "extra drafter updates on this step's rollouts")
        if collapsed and self.health.streak == d.collapse_patience:
            spec = self.cfg.speculative.drafter
            why = ("finds almost nothing to copy from in these rollouts" if spec in ("ngram", "suffix") else
                   "looks broken or unsynced with the policy (check its weights and the weight sync)")
            msg = (f"step {step_no}: acceptance length <= {d.collapse_threshold:g} for {d.collapse_patience} "
                   f"consecutive steps (now {al:.3f}): the drafter {spec!r} {why}, and generation is running at "
                   "about autoregressive speed; consider another drafter or speculative.drafter=none")
            warnings.warn(msg, DrafterCollapseWarning, stacklevel=3)
            self.log(f"[specrl] warning: {msg}")
        return {"draft_updates": updates, "draft_refreshed": refreshed, "drafter_collapsed": collapsed,
                "acceptance_length_reference": reference}

    # ------------------------------------------------------------------ one step
    def step(self) -> dict[str, Any]:
        """Run data → prepare → gen → logprob → train; return the step's metrics record."""
        times: dict[str, float] = {}
        t0 = time.perf_counter()
        prompt_idx = self.stage_data()
        t1 = time.perf_counter()
        self.stage_prepare()
        t2 = time.perf_counter()
        r = self.stage_gen(prompt_idx)
        t3 = time.perf_counter()
        batch = self.stage_logprob(r)
        t4 = time.perf_counter()
        if os.environ.get(KILL_ENV) == str(self.step_count + 1):
            os.kill(os.getpid(), signal.SIGKILL)
        train = self.stage_train(batch)
        em = r.engine_metrics
        spec = self.engine.drafter is not None if hasattr(self.engine, "drafter") else False
        # AL from a handful of drafts (auto k probing once at a large batch) is noise, not drafter health
        spec_on = spec and em.get("acceptance_length") is not None and em.get("verify_steps", 0) > 0 and \
            em.get("draft_tokens", 0) >= MIN_DRAFTS_FOR_HEALTH
        control = self._drafter_control(batch, em["acceptance_length"] if spec_on else None)
        t5 = time.perf_counter()
        times = dict(zip(STAGES, (t1 - t0, t2 - t1, t3 - t2, t4 - t3, t5 - t4), strict=True))
        self.step_count += 1
        self.last_rollouts = r
        total = t5 - t0
        gen_tokens = int(em.get("generated_tokens", sum(len(x) for x in r.responses)))
        lengths = [len(x) for x in r.responses]
        return {
            "step": self.step_count,
            "reward_mean": float(r.rewards.mean()),
            "reward_std": float(r.rewards.std()) if len(r.rewards) > 1 else 0.0,
            "accuracy": None,
            "response_length_mean": float(np.mean(lengths)),
            "stage_seconds": times,
            "step_seconds": total,
            "gen_share": times["gen"] / total if total > 0 else None,
            "acceptance_length": em.get("acceptance_length") if spec else None,
            "acceptance_rate": em.get("acceptance_rate") if spec else None,
            "acceptance_rate_per_position": em.get("acceptance_rate_per_position", []) if spec else [],
            "num_draft_tokens_mean": em.get("num_draft_tokens_mean") if spec else None,
            "token_mult_prob_error": token_mult_prob_error(batch.gen_logp, batch.old_logp, batch.mask),
            "draft_loss": train["draft_loss"],
            **control,
            "generated_tokens": gen_tokens,
            "gen_tokens_per_second": gen_tokens / times["gen"] if times["gen"] > 0 else None,
            "train_accuracy": float(np.mean(r.correct)),
            "format_rate": float(np.mean(r.formatted)),
            "truncated_fraction": float(np.mean([f == "length" for f in r.finish_reasons])),
            **{k: v for k, v in train.items() if k != "draft_loss"},
        }

    # ------------------------------------------------------------------ validation
    def validate(self) -> dict[str, Any]:
        """Greedy accuracy on the held-out split (with the weights the engine currently holds)."""
        if len(self.val_data) == 0:
            return {"accuracy": None, "val_reward": None, "val_format_rate": None}
        self.stage_prepare()
        prompts = [self._prompt("val", i) for i in range(len(self.val_data))]
        outs = self.engine.generate(prompts, self._sampling(greedy=True),
                                    request_ids=[10**12 + i for i in range(len(prompts))])
        scores = [score_response(self.val_data, self.val_data[i], self.formatter.decode(o.token_ids),
                                 self.cfg.task.format_weight, self.answer_format) for i, o in enumerate(outs)]
        return {"accuracy": float(np.mean([s.correct for s in scores])),
                "val_reward": float(np.mean([s.reward for s in scores])),
                "val_format_rate": float(np.mean([s.formatted for s in scores]))}

    # ------------------------------------------------------------------ checkpoint state
    def state_parts(self) -> dict[str, Any]:
        parts: dict[str, Any] = {
            "policy": {k: v.detach().clone() for k, v in self.policy.state_dict().items()},
            "optimizer": self.optimizer.state_dict(),
            "trainer": {
                "step": self.step_count,
                "sampler": self.sampler.state_dict(),
                "drafter_health": self.health.state_dict(),
                "scheduler": self.scheduler.state_dict(),
                "rng": {"torch": torch.get_rng_state(), "numpy": np.random.get_state(),
                        "python": random.getstate()},
            },
        }
        if self.drafter is not None:
            parts["drafter"] = {k: v.detach().clone() for k, v in self.drafter.state_dict().items()}
        return parts

    def load_parts(self, parts: dict[str, Any]) -> None:
        self.policy.load_state_dict(parts["policy"])
        self.optimizer.load_state_dict(parts["optimizer"])
        st = parts["trainer"]
        self.step_count = int(st["step"])
        self.sampler.load_state_dict(st["sampler"])
        self.scheduler.load_state_dict(st["scheduler"])
        self.health.load_state_dict(st.get("drafter_health", {}))
        torch.set_rng_state(st["rng"]["torch"])
        np.random.set_state(st["rng"]["numpy"])
        random.setstate(st["rng"]["python"])
        if self.drafter is not None:
            if "drafter" not in parts:
                raise SpecRLError("the checkpoint has no drafter weights but drafter.online=true; resume with the "
                                  "config the run was started with")
            self.drafter.load_state_dict(parts["drafter"])


def seed_everything(seed: int) -> None:
    random.seed(seed)
    np.random.seed(seed % 2**32)
    torch.manual_seed(seed)


def train_main(config_path: str | None, sets: list[str] | None = None, resume: str | None = None,
               out: str | None = None, compare: bool = False) -> Path:
    """Entry point of `specrl train`: returns the run directory (which holds report.md or compare.md)."""
    from specrl.rl.run import run_compare, run_training, setup_run

    if compare:
        if resume:
            raise SpecRLError("--compare and --resume cannot be combined; compare runs start from scratch")
        cfg, run_dir = setup_run(config_path, sets or [], None, out)
        return run_compare(cfg, run_dir)
    cfg, run_dir = setup_run(config_path, sets or [], resume, out)
    return run_training(cfg, run_dir, resume=resume is not None)

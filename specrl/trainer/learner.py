"""The learner side of an RL step: (logprob +) train (+ online drafter training) -> the step's metrics record.

`Learner` owns the policy, the optional trainable drafter, the optimizer and schedule, the reference model and
the drafter's staleness loop (`DrafterHealth`). `learn(rollouts, seconds)` trains on one step's `Rollouts` and
returns the `metrics.jsonl` record; `named_weights()` is what a weight sync publishes (policy tensors under HF
checkpoint names, the drafter under its own checkpoint names, and the version = the number of RL steps (batches)
trained; the schedule also advances once per batch). A batch takes `grpo.num_iterations` x `grpo.mini_batches`
optimizer steps with the loss `grpo.loss_type` (`specrl.algorithms.losses`). Three policies meet in a step: the
behaviour policy that generated the rollouts (its log-probs come with them; in the async pipeline it may be up to
`pipeline.max_trajectory_age_steps` versions old), the proximal policy (the weights at the start of this learner
step, whose log-probs are `old_logp`) and the current policy (after each optimizer step). The optional truncated
importance-sampling weight min(pi_prox / pi_behaviour, cap) corrects for rollouts from a lagging or numerically
different sampler; the clip keeps each update within [1 - clip_low, 1 + clip_high] of the proximal policy.
With one optimizer step per batch the proximal and current policies coincide at the forward, so `old_logp`
is the train forward's own detached output and no `logprob` forward runs (`logprob_skipped` in the record,
its stage time ~0): the hidden states for the online drafter, the reference forward (kl_coef > 0) and
`token_mult_prob_error` come from that forward too. With more, the `logprob` stage computes them first.
`check_weights` (`specrl.trainer.weight_check`) runs before every checkpoint. The sync trainer composes it with the
producer in one process; the async pipeline runs the same learner, and the same check, in its learner actor.
"""

from __future__ import annotations

import contextlib
import copy
import math
import random
import time
import warnings
from collections.abc import Callable
from typing import Any

import numpy as np
import torch
from torch import Tensor

from specrl.algorithms.batch import Batch, collate, micro, response_logprobs, update_plan
from specrl.algorithms.grpo import token_mult_prob_error
from specrl.algorithms.losses import get_loss, loss_normalizer
from specrl.algorithms.rollouts import Rollouts
from specrl.config.hardware import hardware_fields, resolve_hardware
from specrl.config.schema import TrainConfig
from specrl.cpu import release_free_memory
from specrl.drafters.training.online import (
    TOPK,
    DrafterCollapseWarning,
    DrafterHealth,
    check_trainable,
    draft_batch,
    draft_loss,
)
from specrl.errors import SpecRLError
from specrl.model.hf_checkpoint import hf_named_tensors
from specrl.observability.metrics import STAGES
from specrl.observability.step_record import StepRecord
from specrl.trainer.weight_check import DrafterNonFiniteError, NonFiniteError, check_weights

__all__ = ["Batch", "DrafterNonFiniteError", "Learner", "NonFiniteError", "check_weights", "lr_factor",
           "response_logprobs"]

MIN_DRAFTS_FOR_HEALTH = 32  # drafted tokens a step needs before its acceptance length counts for staleness/collapse
_SUMS = ("tokens", "clipped", "kl", "ratio", "loss", "draft", "is_sum", "is_clipped", "grad_norm")


def lr_factor(step: int, warmup: int, total: int, schedule: str, min_ratio: float) -> float:
    """Multiplier of the base learning rate for RL step `step` (0-based)."""
    if warmup > 0 and step < warmup:
        return (step + 1) / warmup
    if schedule == "constant" or total <= warmup:
        return 1.0
    progress = min(1.0, (step - warmup) / max(1, total - warmup))
    if schedule == "linear":
        return 1.0 - (1.0 - min_ratio) * progress
    return min_ratio + (1.0 - min_ratio) * 0.5 * (1.0 + math.cos(math.pi * progress))


class Learner:
    """Policy, optimizer, drafter training and the logprob/train stages of a GRPO step."""

    share_prefixes = True  # a group's samples run their common prompt once in every scoring forward

    def __init__(self, cfg: TrainConfig, policy: torch.nn.Module, drafter: Any = None, max_policy_lag: int = 0):
        cfg = resolve_hardware(cfg)  # idempotent; a config straight from Python may still say auto
        self.cfg = cfg
        self.device = next(policy.parameters()).device  # batches are built here; autocast follows it
        self.hardware = hardware_fields(cfg)  # every step record says what auto resolved to
        self.max_policy_lag = max_policy_lag  # sync: rollouts come from the current weights
        self.policy = policy
        self.drafter = drafter if cfg.drafter.online else None
        if cfg.drafter.online:
            check_trainable(self.drafter)
        self.loss = get_loss(cfg.grpo.loss_type)
        self.ref = self._make_ref(policy) if cfg.grpo.kl_coef > 0 else None
        pc = cfg.policy
        groups = [{"params": [p for p in policy.parameters() if p.requires_grad], "lr": pc.learning_rate}]
        if self.drafter is not None:
            dlr = cfg.drafter.learning_rate or pc.learning_rate * 100
            groups.append({"params": [p for p in self.drafter.parameters() if p.requires_grad], "lr": dlr})
        # fused: one kernel over all parameters (measured 0.53 -> 0.06 s per step for 135M on one thread,
        # benchmarks/trainer_speed.py); the same AdamW up to float rounding
        self.optimizer = torch.optim.AdamW(groups, betas=pc.adam_betas, weight_decay=pc.weight_decay, fused=True)
        total = cfg.run.steps
        self.scheduler = torch.optim.lr_scheduler.LambdaLR(
            self.optimizer, lambda s: lr_factor(s, pc.warmup_steps, total, pc.lr_schedule, pc.min_lr_ratio))
        self.step_count = 0  # RL steps (batches) trained = the version of the weights `named_weights` returns
        self._capture = tuple(getattr(self.drafter, "target_layers", ()) or ()) if self.drafter else ()
        d = cfg.drafter
        # whether this step's policy forward keeps the drafter's inputs (on_stale: only a step about to refresh)
        self.capture_drafter = self.drafter is not None and d.online_mode == "every_step"
        self.health = DrafterHealth(d.staleness_fraction, d.collapse_threshold, d.collapse_patience)
        # where the learner's event lines go; the run loop points it at its progress display
        self.log: Callable[[str], None] = lambda msg: print(msg, flush=True)

    @property
    def version(self) -> int:
        return self.step_count

    def _make_ref(self, policy: torch.nn.Module) -> torch.nn.Module:
        """The frozen reference model (kl_coef > 0): a copy of the initial policy."""
        ref = copy.deepcopy(policy).eval()
        for p in ref.parameters():
            p.requires_grad_(False)
        return ref

    def _global_normalizer(self, local: float) -> float:
        """The loss normaliser of an optimizer step from this learner's share of it (one process: all of it; a
        data-parallel rank sums the ranks' shares and scales for the gradient average)."""
        return local

    def check_weights(self, step: int) -> None:
        """Before checkpoint `step`: `check_weights` on this learner's policy and drafter (NaN/inf scan, then the
        16-token probe forward + backward). Raises NonFiniteError / DrafterNonFiniteError naming the cause."""
        parts = {"policy": self.policy.state_dict()}
        if self.drafter is not None:
            parts["drafter"] = self.drafter.state_dict()
        check_weights(parts, self.policy, step)

    def named_weights(self) -> tuple[int, dict[str, Tensor], dict[str, Tensor] | None]:
        """(version, policy tensors by HF name, drafter tensors by checkpoint name or None): what a sync sends."""
        drafter = None
        if self.drafter is not None:
            drafter = {k: v.detach() for k, v in self.drafter.state_dict().items()}
        return self.version, hf_named_tensors(self.policy), drafter

    def _autocast(self) -> contextlib.AbstractContextManager:
        if self.cfg.policy.precision == "bf16-mixed":
            return torch.autocast(self.device.type, dtype=torch.bfloat16)
        return contextlib.nullcontext()

    # ------------------------------------------------------------------ stages
    def collate(self, r: Rollouts) -> Batch:
        g = self.cfg.grpo
        batch = collate(r, g.num_generations, g.scale_advantages_by_std).to(self.device)
        batch.plan = update_plan(len(r.prompts), g.mini_batches, self.cfg.policy.train_micro_batch_size)
        return batch

    @property
    def skips_logprob(self) -> bool:
        """One optimizer step per batch: the proximal log-probs come from the train forward itself."""
        return self.cfg.grpo.optimizer_steps == 1

    @torch.no_grad()
    def _proximal(self, batch: Batch, idx: list[int], toks: Tensor, m: Tensor, lp: Tensor, captured: dict,
                  where: str) -> None:
        """Record micro-batch `idx`'s proximal log-probs `lp` (detached), its reference log-probs and drafter
        inputs; `lp` and `captured` come from the current weights' forward (logprob stage or fused train)."""
        if not bool(torch.isfinite(lp[m]).all()):
            raise NonFiniteError(f"step {self.step_count + 1}: the policy produced non-finite logits in the {where}")
        w = lp.shape[1]
        batch.old_logp[idx, :w] = lp.detach()
        if batch.ref_logp is not None:
            with self._autocast():
                batch.ref_logp[idx, :w] = response_logprobs(self.ref, toks, m, self.cfg.generation.temperature,
                                                            share_prefixes=self.share_prefixes,
                                                            **self._sampler_filter)[0]
        if self.capture_drafter:
            batch.captured.append(draft_batch(self.drafter, toks, m, captured, captured["response_top"]))

    @property
    def _sampler_filter(self) -> dict[str, Any]:
        """The sampler's top-p / top-k: the trainer scores tokens under the distribution they were sampled from."""
        return {"top_p": self.cfg.generation.top_p, "top_k": self.cfg.generation.top_k}

    def _start_proximal(self, batch: Batch) -> None:
        batch.old_logp = torch.zeros_like(batch.gen_logp)
        batch.ref_logp = torch.zeros_like(batch.gen_logp) if self.ref is not None else None
        batch.captured = []

    @torch.no_grad()
    def stage_logprob(self, r: Rollouts) -> Batch:
        """Collate; the proximal (current) policy's and the reference's log-probabilities in a no-grad forward;
        the drafter's inputs when this step captures them."""
        batch = self.collate(r)
        self._start_proximal(batch)
        for idx in batch.micro_batches:
            toks, m = micro(batch, idx)
            with self._autocast():
                lp, captured = response_logprobs(self.policy, toks, m, self.cfg.generation.temperature,
                                                 self._capture if self.capture_drafter else (),
                                                 top=TOPK if self.capture_drafter else 0,
                                                 share_prefixes=self.share_prefixes, **self._sampler_filter)
            self._proximal(batch, idx, toks, m, lp, captured, "logprob stage")
        return batch

    def stage_train(self, batch: Batch) -> dict[str, Any]:
        """`grpo.num_iterations` passes over the batch's mini-batches, one clipped AdamW step each (loss
        `grpo.loss_type`, + loss_weight * draft loss with drafter.online_mode=every_step); the schedule then
        advances once. Without `batch.old_logp` (one optimizer step per batch) the train forward supplies it."""
        g = self.cfg.grpo
        fused = batch.old_logp is None
        if fused:
            if g.optimizer_steps != 1:
                raise SpecRLError(f"the batch has no proximal log-probs but takes {g.optimizer_steps} optimizer "
                                  "steps (grpo.num_iterations x grpo.mini_batches); run stage_logprob first")
            self._start_proximal(batch)
        stats = dict.fromkeys(_SUMS, 0.0)
        stats["is_max"] = 0.0
        lr = self.optimizer.param_groups[0]["lr"]
        n_steps = draft_updates = 0
        for _ in range(g.num_iterations):
            c = 0
            for mini in batch.plan:
                n_steps += 1
                draft_updates += self._optimizer_step(batch, mini, c, fused, stats, n_steps)
                c += len(mini)
        self.scheduler.step()
        ntok = max(stats["tokens"], 1.0)
        is_on = g.importance_sampling_correction
        return {"loss": stats["loss"] / n_steps, "grad_norm": stats["grad_norm"] / n_steps, "lr": lr,
                "clip_fraction": stats["clipped"] / ntok,
                "kl": stats["kl"] / ntok if self.ref is not None else None, "ratio_mean": stats["ratio"] / ntok,
                "draft_loss": stats["draft"] / draft_updates if draft_updates else None,
                "draft_updates": draft_updates, "optimizer_steps": n_steps,
                "is_ratio_mean": stats["is_sum"] / ntok if is_on else None,
                "is_ratio_max": stats["is_max"] if is_on else None,
                "is_clipped_fraction": stats["is_clipped"] / ntok if is_on else None}

    def _optimizer_step(self, batch: Batch, mini: list[list[int]], c0: int, fused: bool, stats: dict,
                        k: int) -> int:
        """One AdamW step on mini-batch `mini` (micro-batches c0.. of the plan); 1 if the drafter trained."""
        g, temp = self.cfg.grpo, self.cfg.generation.temperature
        step_no = self.step_count + 1
        of = f" (optimizer step {k} of {g.optimizer_steps}; earlier ones were applied)" if k > 1 else ""
        self.optimizer.zero_grad(set_to_none=True)
        mask = batch.mask if len(batch.plan) == 1 else batch.mask[[i for idx in mini for i in idx]]
        norm = self._global_normalizer(loss_normalizer(self.loss.normalizer, mask, self.cfg.generation.max_new_tokens))
        train_drafter = self.drafter is not None and self.cfg.drafter.online_mode == "every_step"
        for j, idx in enumerate(mini):
            toks, m = micro(batch, idx)
            w = m.shape[1]
            keep = fused and self.capture_drafter
            with self._autocast():
                logp, captured = response_logprobs(self.policy, toks, m, temp, self._capture if keep else (),
                                                   top=TOPK if keep else 0, share_prefixes=self.share_prefixes,
                                                   **self._sampler_filter)
            if fused:
                self._proximal(batch, idx, toks, m, logp, captured, "train forward")
            out = self.loss(
                logp, batch.old_logp[idx, :w], batch.advantages[idx], m, normalizer=norm, clip_low=g.clip_low,
                clip_high=g.clip_high, ref_logp=None if batch.ref_logp is None else batch.ref_logp[idx, :w],
                kl_coef=g.kl_coef, behavior_logp=batch.gen_logp[idx, :w] if g.importance_sampling_correction
                else None, is_cap=g.importance_sampling_cap)
            if not torch.isfinite(out.loss):
                self.optimizer.zero_grad(set_to_none=True)
                raise NonFiniteError(f"step {step_no}: non-finite GRPO loss ({out.loss.item()}); update skipped{of}")
            out.loss.backward()
            for key, v in (("tokens", out.num_tokens), ("clipped", out.clipped_tokens), ("kl", out.kl_sum),
                           ("ratio", out.ratio_sum), ("loss", float(out.loss.detach())),
                           ("is_sum", out.is_weight_sum), ("is_clipped", out.is_clipped_tokens)):
                stats[key] += v
            stats["is_max"] = max(stats["is_max"], out.is_weight_max)
            if train_drafter:
                dl = draft_loss(self.drafter, batch.captured[c0 + j])
                if not torch.isfinite(dl):
                    self.optimizer.zero_grad(set_to_none=True)
                    raise DrafterNonFiniteError(
                        f"step {step_no}: non-finite drafter loss of the online drafter "
                        f"{self.cfg.speculative.drafter!r} (drafter learning rate "
                        f"{self.optimizer.param_groups[1]['lr']:g}; the policy is not the cause); update skipped{of}")
                (self.cfg.drafter.loss_weight * dl / len(mini)).backward()
                stats["draft"] += float(dl.detach()) / len(mini)
        params = [p for p in self.policy.parameters() if p.requires_grad]
        gn = torch.nn.utils.clip_grad_norm_(params, self.cfg.policy.max_grad_norm)
        if not torch.isfinite(gn):
            self.optimizer.zero_grad(set_to_none=True)
            raise NonFiniteError(f"step {step_no}: non-finite gradient norm; update skipped{of}")
        if train_drafter:
            torch.nn.utils.clip_grad_norm_(list(self.drafter.parameters()), self.cfg.policy.max_grad_norm)
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)  # no gradients held between steps (the policy's size again)
        stats["grad_norm"] += float(gn)
        return int(train_drafter)
    def refresh_drafter(self, batch: Batch) -> int:
        """`drafter.refresh_steps` drafter-only AdamW updates on this step's captured batches; returns the count.

        Each update backpropagates the draft loss of every captured micro-batch. The captures are detached
        from the policy graph, so only drafter parameters receive gradients; AdamW skips parameters without a
        gradient, so the policy's weights and optimizer state stay bit-identical. The scheduler is not
        stepped. The refreshed drafter reaches the backend with the next weight publication, like online updates.
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
                    raise DrafterNonFiniteError(
                        f"step {self.step_count + 1}: non-finite drafter loss in drafter refresh update {i + 1} of the "
                        f"online drafter {self.cfg.speculative.drafter!r}; that update was skipped (the step's policy "
                        "update and earlier refresh updates were applied)")
                (dl / len(batch.captured)).backward()
            if any(p.grad is not None for p in self.policy.parameters()):
                raise RuntimeError("drafter refresh produced policy gradients; the drafter loss must be detached "
                                   "from the policy")
            torch.nn.utils.clip_grad_norm_(params, self.cfg.policy.max_grad_norm)
            self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        return self.cfg.drafter.refresh_steps

    def drafter_control(self, batch: Batch, al: float | None, updates: int = 0) -> dict[str, Any]:
        """The staleness loop and collapse check after `train` (which gave the drafter `updates` updates); the
        step record's drafter fields."""
        step_no, d = self.step_count + 1, self.cfg.drafter
        stale, collapsed = self.health.observe(al, step_no, refit=updates > 0)
        reference = self.health.reference
        refreshed = False
        if stale and self.drafter is not None and d.refresh_steps > 0:
            updates += self.refresh_drafter(batch)
            refreshed = True
            self.health.refreshed(step_no)
            self.log(f"[specrl] step {step_no}: drafter stale (acceptance length {al:.2f} < "
                     f"{d.staleness_fraction:g} x reference {reference:.2f}); refreshed it with {d.refresh_steps} "
                     "extra drafter updates on this step's rollouts")
        if collapsed and self.health.streak == d.collapse_patience:
            spec = self.cfg.speculative.drafter
            why = ("finds almost nothing to copy from in these rollouts" if spec in ("ngram", "suffix") else
                   "looks broken or unsynced with the policy (check its weights and the weight sync)")
            msg = (f"step {step_no}: acceptance length <= {d.collapse_threshold:g} for {d.collapse_patience} "
                   f"consecutive steps (now {al:.3f}): the drafter {spec!r} {why}, and generation is running at "
                   "about autoregressive speed; consider another drafter or speculative.drafter=none"
                   + self.health.collapse_cause())
            warnings.warn(msg, DrafterCollapseWarning, stacklevel=4)
            self.log(f"[specrl] warning: {msg}")
        return {"draft_updates": updates, "draft_refreshed": refreshed, "drafter_collapsed": collapsed,
                "acceptance_length_reference": reference}

    # ------------------------------------------------------------------ one step
    def learn(self, r: Rollouts, seconds: dict[str, float]) -> tuple[StepRecord, Batch]:
        """(logprob +) train (+ drafter control) on one step's rollouts; `seconds` holds the producer-side stage
        times (data, prepare, gen) and gains logprob and train. Returns the step's record and its batch."""
        lag = self.version - r.policy_version
        if not 0 <= lag <= self.max_policy_lag:
            raise SpecRLError(f"step {self.step_count + 1}: rollouts of policy version {r.policy_version} for a "
                              f"learner at version {self.version} (lag {lag}; this pipeline allows 0.."
                              f"{self.max_policy_lag}): the weight sync did not deliver the learner's weights")
        em = r.engine_metrics
        spec = self.cfg.speculative.enabled
        # AL from a handful of drafts (auto k probing once at a large batch) is noise, not drafter health
        spec_on = spec and em.get("acceptance_length") is not None and em.get("verify_steps", 0) > 0 and \
            em.get("draft_tokens", 0) >= MIN_DRAFTS_FOR_HEALTH
        al = em["acceptance_length"] if spec_on else None
        d = self.cfg.drafter
        self.capture_drafter = self.drafter is not None and (
            d.online_mode == "every_step" or (d.refresh_steps > 0 and self.health.is_stale(al)))
        t3 = time.perf_counter()
        skipped = self.skips_logprob
        batch = self.collate(r) if skipped else self.stage_logprob(r)
        t4 = time.perf_counter()
        train = self.stage_train(batch)
        control = self.drafter_control(batch, al, train.pop("draft_updates"))
        release_free_memory()  # the step's temporaries back to the kernel (charged to train)
        t5 = time.perf_counter()
        times = {**seconds, "logprob": t4 - t3, "train": t5 - t4}
        times = {s: times[s] for s in STAGES}
        self.step_count += 1
        total = sum(times.values())
        gen_tokens = int(em.get("generated_tokens", sum(len(x) for x in r.responses)))
        lengths = [len(x) for x in r.responses]
        ds = r.dynamic_sampling
        rec = StepRecord(
            step=self.step_count,
            reward_mean=float(r.rewards.mean()),
            reward_std=float(r.rewards.std()) if len(r.rewards) > 1 else 0.0,
            accuracy=None,
            response_length_mean=float(np.mean(lengths)),
            response_lengths=lengths,
            batch_trace=em.get("batch_trace", []),
            stage_seconds=times,
            step_seconds=total,
            gen_share=times["gen"] / total if total > 0 else None,
            logprob_skipped=skipped,
            acceptance_length=em.get("acceptance_length") if spec else None,
            acceptance_rate=em.get("acceptance_rate") if spec else None,
            acceptance_rate_per_position=em.get("acceptance_rate_per_position", []) if spec else [],
            num_draft_tokens_mean=em.get("num_draft_tokens_mean") if spec else None,
            draft_tokens=em.get("draft_tokens") if spec else None,
            accepted_tokens=em.get("accepted_tokens") if spec else None,
            verify_steps=em.get("verify_steps") if spec else None,
            sequence_steps=em.get("sequence_steps") if spec else None,
            token_mult_prob_error=token_mult_prob_error(batch.gen_logp, batch.old_logp, batch.mask),
            draft_loss=train["draft_loss"],
            **control,
            generated_tokens=gen_tokens,
            gen_tokens_per_second=gen_tokens / times["gen"] if times["gen"] > 0 else None,
            train_accuracy=float(np.mean(r.correct)),
            format_rate=None if None in r.formatted else float(np.mean(r.formatted)),
            reward_components={name: float(np.mean(v)) for name, v in r.reward_components.items()},
            truncated_fraction=float(np.mean([f == "length" for f in r.finish_reasons])),
            policy_version=r.policy_version,
            policy_lag=lag,
            **self.hardware,
            **{k: ds.get(k) for k in ("groups_trained", "groups_filtered", "extra_prompts_drawn",
                                      "reward_mean_generated")},
            **{k: v for k, v in train.items() if k != "draft_loss"},
        )
        return rec, batch

    def _apply_config_hyperparams(self) -> None:
        """After loading optimizer and scheduler state: use this config's learning rates, betas and weight decay.

        The loaded state carries the values of the run that wrote it, so `--resume RUN --set
        policy.learning_rate=X` would otherwise keep the old rate while config.yaml says X. The schedule's
        position (steps taken) is kept; an unchanged config gives bit-identical rates.
        """
        pc, d = self.cfg.policy, self.cfg.drafter
        bases = [pc.learning_rate]
        if self.drafter is not None:
            bases.append(d.learning_rate or pc.learning_rate * 100)
        names = ("policy.learning_rate", "drafter.learning_rate")
        for i, (group, base) in enumerate(zip(self.optimizer.param_groups, bases, strict=False)):
            old = self.scheduler.base_lrs[i]
            if old != base:
                self.log(f"[specrl] resume: {names[i]} {old:g} -> {base:g} (the optimizer uses the new value "
                         f"from step {self.step_count + 1})")
            self.scheduler.base_lrs[i] = base
            group["initial_lr"] = base
            group["lr"] = base * self.scheduler.lr_lambdas[i](self.scheduler.last_epoch)
            if tuple(group["betas"]) != tuple(pc.adam_betas) or group["weight_decay"] != pc.weight_decay:
                if i == 0:
                    self.log(f"[specrl] resume: policy.adam_betas / weight_decay now {tuple(pc.adam_betas)} / "
                             f"{pc.weight_decay:g}")
                group["betas"], group["weight_decay"] = tuple(pc.adam_betas), pc.weight_decay

    # ------------------------------------------------------------------ checkpoint state
    def state_parts(self) -> dict[str, Any]:
        parts: dict[str, Any] = {
            "policy": {k: v.detach().clone() for k, v in self.policy.state_dict().items()},
            "optimizer": self.optimizer.state_dict(),
            "learner": {
                "step": self.step_count,
                "drafter_health": self.health.state_dict(),
                "scheduler": self.scheduler.state_dict(),
                "rng": {"torch": torch.get_rng_state(), "numpy": np.random.get_state(),
                        "python": random.getstate()},
            },
        }
        if self.drafter is not None:
            parts["drafter"] = {k: v.detach().clone() for k, v in self.drafter.state_dict().items()}
        return parts

    def load_parts(self, parts: dict[str, Any], st: dict[str, Any]) -> None:
        """Restore from checkpoint parts; `st` is the learner's bookkeeping (step, scheduler, health, rng)."""
        self.policy.load_state_dict(parts["policy"])
        self.optimizer.load_state_dict(parts["optimizer"])
        if self.drafter is not None:
            if "drafter" not in parts:
                raise SpecRLError("the checkpoint has no drafter weights but drafter.online=true; resume with the "
                                  "config the run was started with")
            self.drafter.load_state_dict(parts["drafter"])
        self.load_bookkeeping(st)

    def load_bookkeeping(self, st: dict[str, Any]) -> None:
        """Restore step, scheduler, this config's hyperparameters, drafter health and RNG states."""
        self.step_count = int(st["step"])
        self.scheduler.load_state_dict(st["scheduler"])
        self._apply_config_hyperparams()
        self.health.load_state_dict(st.get("drafter_health", {}))
        torch.set_rng_state(st["rng"]["torch"])
        np.random.set_state(st["rng"]["numpy"])
        random.setstate(st["rng"]["python"])

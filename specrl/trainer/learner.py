"""The learner side of an RL step: (logprob +) train, then the drafter trainer's part -> the step's metrics record.

`Learner` owns the policy, its optimizer and schedule and the reference model, and optimises the policy and
nothing else. The online drafter belongs to a `DrafterTrainer` (`specrl.drafters.training.trainer`: the drafter's
own optimizer, loss, clipping, refresh schedule and health checks), which `learn` calls explicitly: before the
step's policy forward, `wants_capture(al)` decides whether that forward keeps the drafter's inputs (so there is no
second forward); after the policy's optimizer steps, `after_policy_update` trains the drafter on them and runs the
staleness loop. `learn(rollouts, seconds)` trains on one step's `Rollouts` and returns the `metrics.jsonl` record;
`named_weights()` is what a weight sync publishes (policy tensors under HF checkpoint names, the drafter under its
own checkpoint names, and the version = the number of RL steps (batches) trained; the schedule also advances once
per batch). A batch takes `grpo.num_iterations` x `grpo.mini_batches` optimizer steps with the loss
`grpo.loss_type` (`specrl.algorithms.losses`). Three policies meet in a step: the behaviour policy that generated
the rollouts (its log-probs come with them; in the async pipeline it may be up to
`pipeline.max_trajectory_age_steps` versions old), the proximal policy (the weights at the start of this learner
step, whose log-probs are `old_logp`) and the current policy (after each optimizer step). The optional truncated
importance-sampling weight min(pi_prox / pi_behaviour, cap) corrects for rollouts from a lagging or numerically
different sampler; the clip keeps each update within [1 - clip_low, 1 + clip_high] of the proximal policy.
With one optimizer step per batch the proximal and current policies coincide at the forward, so `old_logp`
is the train forward's own detached output and no `logprob` forward runs (`logprob_skipped` in the record,
its stage time ~0): the drafter's inputs, the reference forward (kl_coef > 0) and `token_mult_prob_error` come
from that forward too. With more, the `logprob` stage computes them first. The train stage's seconds include
the drafter trainer's updates. `check_weights` (`specrl.trainer.weight_check`) runs before every checkpoint. The
sync trainer composes it with the producer in one process; the async pipeline runs the same learner, and the
same check, in its learner actor.
"""

from __future__ import annotations

import contextlib
import copy
import random
import time
from collections.abc import Callable
from typing import Any

import numpy as np
import torch
from torch import Tensor

from specrl.algorithms.batch import Batch, CollateSpec, collate
from specrl.algorithms.grpo import group_signal, token_mult_prob_error
from specrl.algorithms.losses import clip_range, get_loss, scales_by_std
from specrl.algorithms.rollouts import Rollouts
from specrl.checkpoint.sharded_state import DCP_PART, DcpPart, dcp_dir, load_dcp
from specrl.config.hardware import hardware_fields, resolve_hardware
from specrl.config.schema import TrainConfig
from specrl.cpu import release_free_memory
from specrl.drafters.training.trainer import DrafterTrainer
from specrl.errors import SpecRLError
from specrl.model.hf_checkpoint import hf_named_tensors
from specrl.observability.metrics import STAGES
from specrl.observability.step_record import StepRecord
from specrl.trainer.optim import apply_config_hyperparams, build_optimizer, build_scheduler, lr_schedule
from specrl.trainer.protocol import LearnerProtocol
from specrl.trainer.scoring import response_logprobs
from specrl.trainer.weight_check import DrafterNonFiniteError, NonFiniteError, check_weights

__all__ = ["Batch", "DrafterNonFiniteError", "Learner", "NonFiniteError", "check_weights",
           "response_logprobs"]

MIN_DRAFTS_FOR_HEALTH = 32  # drafted tokens a step needs before its acceptance length counts for staleness/collapse
_SUMS = ("tokens", "clipped", "kl", "ratio", "loss", "is_sum", "is_clipped", "grad_norm")


class Learner(LearnerProtocol):
    """Policy, its optimizer and the logprob/train stages of a GRPO step; calls the drafter trainer."""

    share_prefixes = True  # a group's samples run their common prompt once in every scoring forward
    rank, world_size = 0, 1  # this learner's share of a step: all of it (a data-parallel rank sets its own)

    def __init__(self, cfg: TrainConfig, policy: torch.nn.Module, drafter: Any = None, max_policy_lag: int = 0):
        cfg = resolve_hardware(cfg)  # idempotent; a config straight from Python may still say auto
        self.cfg = cfg
        self.device = next(policy.parameters()).device  # batches are built here; autocast follows it
        self.hardware = hardware_fields(cfg)  # every step record says what auto resolved to
        self.max_policy_lag = max_policy_lag  # sync: rollouts come from the current weights
        self.policy = policy
        self.loss = get_loss(cfg.grpo.loss_type)
        self.ref = self._make_ref(policy) if cfg.grpo.kl_coef > 0 else None
        schedule = lr_schedule(cfg)  # the policy's optimizer only: the drafter trainer has its own, same schedule
        self.optimizer = build_optimizer(cfg, policy)
        self.scheduler = build_scheduler(self.optimizer, schedule)
        self.step_count = 0  # RL steps (batches) trained = the version of the weights `named_weights` returns
        # the online drafter (None without drafter.online: then it runs the drafter health checks only)
        self.drafter_trainer = DrafterTrainer.from_config(cfg, drafter, schedule)
        # where the learner's event lines go; the run loop points it at its progress display
        self.log = lambda msg: print(msg, flush=True)

    @property
    def drafter(self) -> Any:
        """The trainable online drafter (the drafter trainer's), or None."""
        return self.drafter_trainer.drafter

    @property
    def optimizers(self) -> list[torch.optim.Optimizer]:
        """The policy's optimizer, then the drafter trainer's when a drafter trains (what a DCP checkpoint holds)."""
        d = self.drafter_trainer.optimizer
        return [self.optimizer] if d is None else [self.optimizer, d]

    @property
    def log(self) -> Callable[[str], None]:
        return self._log

    @log.setter
    def log(self, fn: Callable[[str], None]) -> None:
        self._log = fn
        self.drafter_trainer.log = fn

    def _make_ref(self, policy: torch.nn.Module) -> torch.nn.Module:
        """The frozen reference model (kl_coef > 0): a copy of the initial policy."""
        ref = copy.deepcopy(policy).eval()
        for p in ref.parameters():
            p.requires_grad_(False)
        return ref

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
    @property
    def collate_spec(self) -> CollateSpec:
        """How `specrl.algorithms.batch.collate` builds this learner's share of a step's `Batch`."""
        g = self.cfg.grpo
        return CollateSpec(g.num_generations, scales_by_std(g.loss_type, g.normalize_rewards), g.mini_batches,
                           self.cfg.policy.train_micro_batch_size, self.loss.normalizer,
                           self.cfg.generation.max_new_tokens, self.rank, self.world_size, self.device)

    @property
    def skips_logprob(self) -> bool:
        """One optimizer step per batch: the proximal log-probs come from the train forward itself."""
        return self.cfg.grpo.optimizer_steps == 1

    @property
    def _sampler_filter(self) -> dict[str, Any]:
        """The sampler's top-p / top-k: the trainer scores tokens under the distribution they were sampled from."""
        return {"top_p": self.cfg.generation.top_p, "top_k": self.cfg.generation.top_k}

    def _capture(self, capture: bool | None) -> bool:
        """This forward keeps the drafter's inputs: `capture`, or (None) what the drafter trainer wants on a step
        without acceptance-length evidence (every_step: yes; on_stale: no)."""
        return self.drafter_trainer.wants_capture(None) if capture is None else capture

    def _forward(self, batch: Batch, idx: list[int], keep: bool, proximal: str | None) -> tuple[Tensor, Tensor]:
        """Micro-batch `idx`, trimmed to its longest sequence, through the policy (`specrl.trainer.scoring`):
        its response log-probs (with gradient under grad mode) and mask. With `proximal` (the stage's name)
        these log-probs are the proximal ones: recorded in the batch (detached) with the reference's, and the
        drafter trainer keeps the forward's captures with `keep`."""
        last = max(2, *(batch.ends[i] for i in idx))
        toks, m = batch.tokens[idx, :last], batch.mask[idx, : last - 1]
        dt = self.drafter_trainer
        with self._autocast():
            lp, captured = response_logprobs(self.policy, toks, m, self.cfg.generation.temperature,
                                             share_prefixes=self.share_prefixes, **self._sampler_filter,
                                             **({"capture": dt.capture_layers, "top": dt.top} if keep else {}))
        if proximal is None:
            return lp, m
        with torch.no_grad():
            if batch.old_logp is None:  # the step's first proximal forward: its tensors, the drafter's captures
                batch.old_logp = torch.zeros_like(batch.gen_logp)
                batch.ref_logp = torch.zeros_like(batch.gen_logp) if self.ref is not None else None
                dt.start_step()
            if not bool(torch.isfinite(lp[m]).all()):
                raise NonFiniteError(f"step {self.step_count + 1}: the policy produced non-finite logits in the "
                                     f"{proximal}")
            w = lp.shape[1]
            batch.old_logp[idx, :w] = lp.detach()
            if batch.ref_logp is not None:
                with self._autocast():
                    batch.ref_logp[idx, :w] = response_logprobs(self.ref, toks, m, self.cfg.generation.temperature,
                                                                share_prefixes=self.share_prefixes,
                                                                **self._sampler_filter)[0]
            if keep:
                dt.keep(toks, m, captured)
        return lp, m

    @torch.no_grad()
    def stage_logprob(self, batch: Batch, capture: bool | None = None) -> None:
        """The proximal (current) policy's and the reference's log-probabilities of a collated batch in a no-grad
        forward, into the batch (`old_logp`, `ref_logp`); the drafter's inputs with `capture` (None: `_capture`)."""
        capture = self._capture(capture)
        batch.old_logp = None  # recomputed here
        for idx in batch.micro_batches:
            self._forward(batch, idx, capture, "logprob stage")

    def stage_train(self, batch: Batch, capture: bool | None = None) -> dict[str, Any]:
        """`grpo.num_iterations` passes over the batch's mini-batches, one clipped AdamW step of the policy each
        (loss `grpo.loss_type`); the schedule then advances once. Without `batch.old_logp` (one optimizer step per
        batch) the train forward supplies it, and keeps the drafter's inputs with `capture` (None: `_capture`)."""
        g = self.cfg.grpo
        capture = self._capture(capture)
        fused = batch.old_logp is None  # the train forward supplies the proximal log-probs
        if fused and g.optimizer_steps != 1:
            raise SpecRLError(f"the batch has no proximal log-probs but takes {g.optimizer_steps} optimizer "
                              "steps (grpo.num_iterations x grpo.mini_batches); run stage_logprob first")
        stats = dict.fromkeys(_SUMS, 0.0)
        stats["is_max"] = 0.0
        lr = self.optimizer.param_groups[0]["lr"]
        clip_low, clip_high = clip_range(g.loss_type, g.clip_low, g.clip_high)
        n_steps = 0
        for _ in range(g.num_iterations):
            for mini, norm in zip(batch.plan, batch.norms, strict=True):
                n_steps += 1
                of = f" (optimizer step {n_steps} of {g.optimizer_steps}; earlier ones were applied)" \
                    if n_steps > 1 else ""
                self.optimizer.zero_grad(set_to_none=True)
                for idx in mini:
                    logp, m = self._forward(batch, idx, fused and capture, "train forward" if fused else None)
                    w = m.shape[1]
                    out = self.loss(
                        logp, batch.old_logp[idx, :w], batch.advantages[idx], m, normalizer=norm,
                        clip_low=clip_low, clip_high=clip_high,
                        ref_logp=None if batch.ref_logp is None else batch.ref_logp[idx, :w], kl_coef=g.kl_coef,
                        behavior_logp=batch.gen_logp[idx, :w] if g.importance_sampling_correction else None,
                        is_cap=g.importance_sampling_cap)
                    if not torch.isfinite(out.loss):
                        self.optimizer.zero_grad(set_to_none=True)
                        raise NonFiniteError(f"step {self.step_count + 1}: non-finite GRPO loss "
                                             f"({out.loss.item()}); update skipped{of}")
                    out.loss.backward()
                    for key, v in (("tokens", out.num_tokens), ("clipped", out.clipped_tokens), ("kl", out.kl_sum),
                                   ("ratio", out.ratio_sum), ("loss", float(out.loss.detach())),
                                   ("is_sum", out.is_weight_sum), ("is_clipped", out.is_clipped_tokens)):
                        stats[key] += v
                    stats["is_max"] = max(stats["is_max"], out.is_weight_max)
                params = [p for p in self.policy.parameters() if p.requires_grad]
                gn = torch.nn.utils.clip_grad_norm_(params, self.cfg.policy.max_grad_norm)
                if not torch.isfinite(gn):
                    self.optimizer.zero_grad(set_to_none=True)
                    raise NonFiniteError(f"step {self.step_count + 1}: non-finite gradient norm; update skipped{of}")
                self.optimizer.step()
                self.optimizer.zero_grad(set_to_none=True)  # no gradients held between steps (the policy's size)
                stats["grad_norm"] += float(gn)
        self.scheduler.step()
        ntok = max(stats["tokens"], 1.0)
        is_on = g.importance_sampling_correction
        return {"loss": stats["loss"] / n_steps, "grad_norm": stats["grad_norm"] / n_steps, "lr": lr,
                "clip_fraction": stats["clipped"] / ntok,
                "kl": stats["kl"] / ntok if self.ref is not None else None, "ratio_mean": stats["ratio"] / ntok,
                "optimizer_steps": n_steps,
                "is_ratio_mean": stats["is_sum"] / ntok if is_on else None,
                "is_ratio_max": stats["is_max"] if is_on else None,
                "is_clipped_fraction": stats["is_clipped"] / ntok if is_on else None}

    # ------------------------------------------------------------------ one step
    def learn(self, r: Rollouts, seconds: dict[str, float]) -> StepRecord:
        """One step's record (`learn_batch` without the batch): the learner contract's `learn`."""
        return self.learn_batch(r, seconds)[0]

    def learn_batch(self, r: Rollouts, seconds: dict[str, float]) -> tuple[StepRecord, Batch]:
        """(logprob +) train, then the drafter trainer's part, on one step's rollouts; `seconds` holds the
        producer-side stage times (data, prepare, gen) and gains logprob and train (the drafter's updates count in
        train). Returns the step's record and its batch."""
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
        capture = self.drafter_trainer.wants_capture(al)  # this step's policy forward keeps the drafter's inputs
        t3 = time.perf_counter()
        skipped = self.skips_logprob
        batch = collate(r, self.collate_spec)
        if not skipped:
            self.stage_logprob(batch, capture)
        t4 = time.perf_counter()
        train = self.stage_train(batch, capture)
        # the drafter trainer's part, after the policy's optimizer steps: its online updates on the step's captures
        # (micro-batch c of the plan is capture c), the staleness loop, the collapse check -> the record's fields
        drafter = self.drafter_trainer.after_policy_update(batch.plan, self.cfg.grpo.num_iterations, al,
                                                           self.step_count + 1)
        if any(p.grad is not None for p in self.policy.parameters()):  # none are held between optimizer steps
            raise RuntimeError("the drafter's update produced policy gradients; the drafter loss must be detached "
                               "from the policy")
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
            **({"history_rows": em.get("history_rows"), "history_drafted": em.get("history_drafted"),
                "history_accepted": em.get("history_accepted"), "history_index_tokens": em.get("history_tokens")}
               if spec and em.get("history_tokens") else {}),
            prompt_indices=list(r.problem_indices[:: self.cfg.grpo.num_generations]),
            token_mult_prob_error=token_mult_prob_error(batch.gen_logp, batch.old_logp, batch.mask),
            **drafter,
            generated_tokens=gen_tokens,
            gen_tokens_per_second=gen_tokens / times["gen"] if times["gen"] > 0 else None,
            train_accuracy=float(np.mean(r.correct)),
            format_rate=None if None in r.formatted else float(np.mean(r.formatted)),
            reward_components={name: float(np.mean(v)) for name, v in r.reward_components.items()},
            truncated_fraction=float(np.mean([f == "length" for f in r.finish_reasons])),
            policy_version=r.policy_version,
            policy_lag=lag,
            **self.hardware,
            **group_signal(r.rewards, self.cfg.grpo.num_generations, ds),
            **{k: ds.get(k) for k in ("groups_trained", "groups_filtered", "extra_prompts_drawn",
                                      "reward_mean_generated")},
            **train,
        )
        return rec, batch

    # ------------------------------------------------------------------ checkpoint state
    def bookkeeping(self) -> dict[str, Any]:
        """The checkpoint's learner part: step, scheduler, the drafter trainer's health and the RNG states."""
        return {
            "step": self.step_count,
            "drafter_health": self.drafter_trainer.health.state_dict(),
            "scheduler": self.scheduler.state_dict(),
            "rng": {"torch": torch.get_rng_state(), "numpy": np.random.get_state(), "python": random.getstate()},
        }

    def state_parts(self) -> dict[str, Any]:
        """Checkpoint parts: the `learner` bookkeeping and `DCP_PART`, the policy, its optimizer and (with an online
        drafter) the drafter and its optimizer, written as one DCP directory when the checkpoint is saved."""
        return {DCP_PART: DcpPart(self.policy, self.drafter, self.optimizers), "learner": self.bookkeeping()}

    def load_parts(self, parts: dict[str, Any], st: dict[str, Any]) -> None:
        """Restore from checkpoint parts (a DCP directory written by any number of ranks: DCP reshards it); `st` is
        the learner's bookkeeping (step, scheduler, health, rng)."""
        load_dcp(dcp_dir(parts), self.policy, self.drafter, self.optimizers)
        self.drafter_trainer.apply_hyperparams()
        self.load_bookkeeping(st)

    def load_bookkeeping(self, st: dict[str, Any]) -> None:
        """Restore step, scheduler, this config's hyperparameters, drafter health and RNG states."""
        self.step_count = int(st["step"])
        self.scheduler.load_state_dict(st["scheduler"])
        apply_config_hyperparams(self.optimizer, self.scheduler, self.cfg, self.step_count, self.log)
        self.drafter_trainer.health.load_state_dict(st.get("drafter_health") or {})
        torch.set_rng_state(st["rng"]["torch"])
        np.random.set_state(st["rng"]["numpy"])
        random.setstate(st["rng"]["python"])

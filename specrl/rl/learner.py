"""The learner side of an RL step: logprob + train (+ online drafter training) -> the step's metrics record.

`Learner` owns the policy, the optional trainable drafter, the optimizer and schedule, the reference model and
the drafter's staleness loop (`DrafterHealth`). `learn(rollouts, seconds)` runs the `logprob` and `train`
stages on one step's `Rollouts` and returns the `metrics.jsonl` record; `named_weights()` is what a weight sync
publishes (policy tensors under HF checkpoint names, the drafter under its own checkpoint names, and the
version = the number of optimizer steps applied). Log-probabilities for the loss are recomputed here; the
rollouts' behaviour log-probs feed the optional truncated importance-sampling correction and the
`token_mult_prob_error` diagnostic. `check_weights` (a NaN/inf scan, then a 16-token probe forward + backward
that must stay finite) runs before every checkpoint. The sync trainer composes it with the producer in one
process; the async pipeline runs the same learner, and the same check, in its learner actor.
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
from typing import Any

import numpy as np
import torch
from torch import Tensor

from specrl.errors import SpecRLError
from specrl.model.checkpoint import hf_named_tensors
from specrl.rl.config import TrainConfig
from specrl.rl.draft_online import DrafterCollapseWarning, DrafterHealth, check_trainable, draft_batch, draft_loss
from specrl.rl.grpo import clipped_surrogate_loss, group_advantages, token_logprobs, token_mult_prob_error
from specrl.rl.hardware import hardware_fields, resolve_hardware
from specrl.rl.metrics import STAGES
from specrl.rl.producer import Rollouts

# Test hook: SIGKILL this process at the start of the train stage of this step (resume tests).
KILL_ENV = "SPECRL_TEST_SIGKILL_AT_STEP"
MIN_DRAFTS_FOR_HEALTH = 32  # drafted tokens a step needs before its acceptance length counts for staleness/collapse


class NonFiniteError(SpecRLError):
    """Loss, logits or gradients became NaN/inf; the step's update was not applied."""

    component = "policy"


class DrafterNonFiniteError(NonFiniteError):
    """The online drafter's loss or weights became NaN/inf (the policy is not the cause)."""

    component = "drafter"


@dataclass
class Batch:
    """Right-padded training tensors; position t of `mask`/`*_logp` scores token t+1 of `tokens`."""

    tokens: Tensor  # [N, T]
    mask: Tensor  # [N, T-1] bool: target token is a response token
    gen_logp: Tensor  # [N, T-1] behaviour log-probs from the rollout backend
    advantages: Tensor  # [N]
    old_logp: Tensor | None = None
    ref_logp: Tensor | None = None
    captured: list[dict] = field(default_factory=list)  # per micro-batch, detached hidden states
    # the GRPO normaliser's token count when these rows are a share of the step (a data-parallel rank): the
    # whole step's response tokens, scaled for the gradient reduction (specrl.rl.data_parallel); None: mask.sum()
    loss_tokens: float | None = None


def _nonfinite(state: dict[str, Any]) -> tuple[str, int, int] | None:
    """(name, non-finite count, numel) of the first floating tensor holding NaN/inf, else None."""
    for name, t in state.items():
        if isinstance(t, torch.Tensor) and t.is_floating_point() and t.numel():
            if bool(torch.isfinite(t.amax()) & torch.isfinite(t.amin())):  # NaN propagates, +-inf shows
                continue
            bad = int((~torch.isfinite(t)).sum())
            if bad:
                return name, bad, t.numel()
    return None


def check_weights(parts: dict[str, Any], policy: torch.nn.Module | None, step: int) -> None:
    """Refuse to checkpoint weights that are not usable: NaN/inf in the policy or drafter, or a policy whose
    forward pass gives non-finite logits (weights blown up to ~1e10 by a huge learning rate are finite, yet
    the next step's forward overflows). Raises NonFiniteError naming the part, so no checkpoint holds them."""
    for part, err in (("policy", NonFiniteError), ("drafter", DrafterNonFiniteError)):
        state = parts.get(part)
        hit = _nonfinite(state) if isinstance(state, dict) else None
        if hit:
            name, bad, n = hit
            raise err(f"step {step}: after the update, the {part}'s tensor {name!r} holds {bad} NaN/inf values "
                      f"(of {n}); the step-{step} checkpoint was not written")
    if policy is not None and hasattr(policy, "forward_hidden") and hasattr(policy, "logits"):
        # A probe forward + backward on 16 tokens: the next step must be able to train from these weights.
        vocab = policy.args.vocab_size
        toks = (torch.arange(16) * 7919 % vocab).unsqueeze(0)
        params = [p for p in policy.parameters() if p.requires_grad]
        with torch.enable_grad():
            logits = policy.logits(policy.forward_hidden(toks)[0][:, :-1])
            what = "logits in a forward pass"
            ok = bool(torch.isfinite(logits).all())
            if ok and params:
                lp = torch.log_softmax(logits.float(), -1).gather(-1, toks[:, 1:, None]).sum()
                grads = [g for g in torch.autograd.grad(lp, params, allow_unused=True) if g is not None]
                what = "gradients"
                ok = bool(torch.isfinite(torch.linalg.vector_norm(
                    torch.stack([torch.linalg.vector_norm(g.float()) for g in grads])))) if grads else True
        if not ok:
            raise NonFiniteError(f"step {step}: after the update the policy gives non-finite {what} (largest "
                                 f"weight magnitude {_max_abs(policy):.3g}: the update blew the weights up, e.g. "
                                 f"a learning rate far too high); the step-{step} checkpoint was not written")


def _max_abs(m: torch.nn.Module) -> float:
    return max(float(p.detach().abs().max()) for p in m.parameters())


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
        return torch.zeros(mask.shape, dtype=flat.dtype, device=flat.device).masked_scatter(mask, flat), captured
    logits, captured = model(toks, capture=capture)
    if keep_logits:
        captured["response_logits"] = logits[:, :-1][mask].detach()
    return token_logprobs(logits[:, :-1], toks[:, 1:], temperature) * mask, captured


def _chunks(n: int, size: int) -> list[list[int]]:
    return [list(range(i, min(n, i + size))) for i in range(0, n, size)]


class Learner:
    """Policy, optimizer, drafter training and the logprob/train stages of a GRPO step."""

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
        self.step_count = 0  # optimizer steps applied = the version of the weights `named_weights` returns
        self._capture = tuple(getattr(self.drafter, "target_layers", ()) or ()) if self.drafter else ()
        d = cfg.drafter
        self.health = DrafterHealth(d.staleness_fraction, d.collapse_threshold, d.collapse_patience)
        # where the learner's event lines go; the run loop points it at its progress display
        self.log: Callable[[str], None] = lambda msg: print(msg, flush=True)

    def _make_ref(self, policy: torch.nn.Module) -> torch.nn.Module:
        """The frozen reference model (kl_coef > 0): a copy of the initial policy."""
        ref = copy.deepcopy(policy).eval()
        for p in ref.parameters():
            p.requires_grad_(False)
        return ref

    @property
    def version(self) -> int:
        return self.step_count

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
        d = self.device
        return Batch(tokens.to(d), mask.to(d), gen_logp.to(d), adv.to(d))

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
        for idx in _chunks(batch.tokens.shape[0], self.cfg.policy.train_micro_batch_size):
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
        total_tokens = float(batch.mask.sum()) if batch.loss_tokens is None else batch.loss_tokens
        stats = {"tokens": 0.0, "clipped": 0.0, "kl": 0.0, "ratio": 0.0, "loss": 0.0, "draft": 0.0,
                 "is_sum": 0.0, "is_max": 0.0, "is_clipped": 0.0}
        chunks = _chunks(batch.tokens.shape[0], self.cfg.policy.train_micro_batch_size)
        for c, idx in enumerate(chunks):
            toks, m = self._micro(batch, idx)
            w = m.shape[1]
            with self._autocast():
                logp, _ = response_logprobs(self.policy, toks, m, temp)
            out = clipped_surrogate_loss(
                logp, batch.old_logp[idx, :w], batch.advantages[idx], m, g.clip_low, g.clip_high,
                None if batch.ref_logp is None else batch.ref_logp[idx, :w], g.kl_coef,
                normalizer=max(total_tokens, 1.0),
                behavior_logp=batch.gen_logp[idx, :w] if g.importance_sampling_correction else None,
                is_cap=g.importance_sampling_cap)
            if not torch.isfinite(out.loss):
                self.optimizer.zero_grad(set_to_none=True)
                raise NonFiniteError(f"step {step_no}: non-finite GRPO loss ({out.loss.item()}); update skipped")
            out.loss.backward()
            stats["tokens"] += out.num_tokens
            stats["clipped"] += out.clipped_tokens
            stats["kl"] += out.kl_sum
            stats["ratio"] += out.ratio_sum
            stats["loss"] += float(out.loss.detach())
            stats["is_sum"] += out.is_weight_sum
            stats["is_max"] = max(stats["is_max"], out.is_weight_max)
            stats["is_clipped"] += out.is_clipped_tokens
            if self.drafter is not None:
                dl = draft_loss(self.drafter, batch.captured[c])
                if not torch.isfinite(dl):
                    self.optimizer.zero_grad(set_to_none=True)
                    raise DrafterNonFiniteError(
                        f"step {step_no}: non-finite drafter loss of the online drafter "
                        f"{self.cfg.speculative.drafter!r} (drafter learning rate "
                        f"{self.optimizer.param_groups[1]['lr']:g}; the policy is not the cause); update skipped")
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
        is_on = g.importance_sampling_correction
        return {"loss": stats["loss"], "grad_norm": float(gn), "lr": lr, "clip_fraction": stats["clipped"] / ntok,
                "kl": stats["kl"] / ntok if self.ref is not None else None, "ratio_mean": stats["ratio"] / ntok,
                "draft_loss": stats["draft"] if self.drafter is not None else None,
                "is_ratio_mean": stats["is_sum"] / ntok if is_on else None,
                "is_ratio_max": stats["is_max"] if is_on else None,
                "is_clipped_fraction": stats["is_clipped"] / ntok if is_on else None}

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

    def drafter_control(self, batch: Batch, al: float | None) -> dict[str, Any]:
        """The staleness loop and collapse check after `train`; the step record's drafter fields."""
        step_no, d = self.step_count + 1, self.cfg.drafter
        stale, collapsed = self.health.observe(al, step_no, refit=self.drafter is not None)
        reference = self.health.reference
        updates = 1 if self.drafter is not None else 0
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
    def learn(self, r: Rollouts, seconds: dict[str, float]) -> tuple[dict[str, Any], Batch]:
        """logprob + train (+ drafter control) on one step's rollouts; `seconds` holds the producer-side stage
        times (data, prepare, gen) and gains logprob and train. Returns the step's record and its batch."""
        lag = self.version - r.policy_version
        if not 0 <= lag <= self.max_policy_lag:
            raise SpecRLError(f"step {self.step_count + 1}: rollouts of policy version {r.policy_version} for a "
                              f"learner at version {self.version} (lag {lag}; this pipeline allows 0.."
                              f"{self.max_policy_lag}): the weight sync did not deliver the learner's weights")
        t3 = time.perf_counter()
        batch = self.stage_logprob(r)
        t4 = time.perf_counter()
        if os.environ.get(KILL_ENV) == str(self.step_count + 1):
            os.kill(os.getpid(), signal.SIGKILL)
        train = self.stage_train(batch)
        em = r.engine_metrics
        spec = self.cfg.speculative.enabled
        # AL from a handful of drafts (auto k probing once at a large batch) is noise, not drafter health
        spec_on = spec and em.get("acceptance_length") is not None and em.get("verify_steps", 0) > 0 and \
            em.get("draft_tokens", 0) >= MIN_DRAFTS_FOR_HEALTH
        control = self.drafter_control(batch, em["acceptance_length"] if spec_on else None)
        t5 = time.perf_counter()
        times = {**seconds, "logprob": t4 - t3, "train": t5 - t4}
        times = {s: times[s] for s in STAGES}
        self.step_count += 1
        total = sum(times.values())
        gen_tokens = int(em.get("generated_tokens", sum(len(x) for x in r.responses)))
        lengths = [len(x) for x in r.responses]
        rec = {
            "step": self.step_count,
            "reward_mean": float(r.rewards.mean()),
            "reward_std": float(r.rewards.std()) if len(r.rewards) > 1 else 0.0,
            "accuracy": None,
            "response_length_mean": float(np.mean(lengths)),
            "response_lengths": lengths,
            "batch_trace": em.get("batch_trace", []),
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
            "format_rate": None if None in r.formatted else float(np.mean(r.formatted)),
            "reward_components": {name: float(np.mean(v)) for name, v in r.reward_components.items()},
            "truncated_fraction": float(np.mean([f == "length" for f in r.finish_reasons])),
            "policy_version": r.policy_version,
            "policy_lag": lag,
            **self.hardware,
            **{k: v for k, v in train.items() if k != "draft_loss"},
        }
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

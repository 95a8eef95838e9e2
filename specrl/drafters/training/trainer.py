"""The online drafter's trainer: its optimizer, loss, gradient clipping, refresh schedule and health checks.

`DrafterTrainer` owns everything the drafter learns from inside an RL step; the policy's learner
(`specrl.trainer.learner.Learner`) optimises the policy and nothing else, and calls it explicitly:

1. before the step's policy forward, `wants_capture(al)` says whether that forward keeps the drafter's inputs
   (`drafter.online_mode=every_step`: every step; `on_stale`: only a step the staleness loop is about to refresh),
   and `pack(toks, mask, captured)` turns one micro-batch's captures into the drafter's padded, detached batch
   (`draft_batch`), so the drafter never costs a second policy forward;
2. after the policy's optimizer steps, `after_policy_update(captures, plan, iterations, al, step)` runs the drafter's
   updates: with `every_step`, one AdamW update per mini-batch of the plan and per iteration (the policy's
   optimizer step count), each on that mini-batch's captured micro-batches with the loss
   `drafter.loss_weight x draft_loss`; then the staleness loop (`DrafterHealth`: an acceptance length below
   `drafter.staleness_fraction` x the reference spends `drafter.refresh_steps` extra drafter-only updates on all the
   step's captures) and the collapse check (a `DrafterCollapseWarning` when acceptance stays near 1). It returns
   the step record's drafter fields.

The drafter has an AdamW of its own (learning rate `drafter.learning_rate`, or the policy's x 100; the policy's
betas and weight decay; the policy's learning-rate schedule factor of the step), and clips its own gradient norm
(`max_grad_norm`), never together with the policy's: the two norms are on different scales, and one clip over
both would let one set the other's step size. The captures are detached and the drafter reads the policy's
embedding (and MTP its LM head) detached, so nothing reaches the policy's parameters. Without a trainable drafter
(`drafter.online=false`: a frozen learned drafter, or an n-gram or suffix drafter) it runs the health checks only.
Its checkpoint state (`state_dict`) is the drafter's weights, its optimizer state and the health bookkeeping.

This module is in layer `specrl.drafters`: it takes the training config as a value (`from_config` reads its
fields) and never imports the config or trainer packages.
"""

from __future__ import annotations

import warnings
from collections.abc import Callable
from typing import Any

import torch
from torch import Tensor

from specrl.drafters.training.online import (
    TOPK,
    DrafterCollapseWarning,
    DrafterHealth,
    check_trainable,
    draft_batch,
    draft_loss,
)
from specrl.errors import DrafterNonFiniteError, SpecRLError
from specrl.rollout.drafter_spec import parse_drafter_spec

__all__ = ["DrafterTrainer"]


class DrafterTrainer:
    """The online drafter's optimizer, loss, clipping, refresh schedule and health checks (module docstring)."""

    def __init__(self, drafter: Any, *, spec: str, learning_rate: float, lr_factor: Callable[[int], float],
                 betas: tuple[float, float] = (0.9, 0.999), weight_decay: float = 0.0, max_grad_norm: float = 1.0,
                 loss_weight: float = 1.0, mode: str = "every_step", refresh_steps: int = 0,
                 staleness_fraction: float = 0.85, collapse_threshold: float = 1.05, collapse_patience: int = 2,
                 log: Callable[[str], None] | None = None):
        """`drafter`: the trainable drafter (None: health checks only); `spec`: its `speculative.drafter` spec (for
        messages); `lr_factor(step)`: the learning-rate schedule's multiplier at RL step `step` (0-based)."""
        if mode not in ("every_step", "on_stale"):
            raise SpecRLError(f"drafter online mode must be every_step or on_stale, got {mode!r}")
        if drafter is not None:
            check_trainable(drafter)
        self.drafter = drafter
        self.spec = spec
        self.learning_rate = learning_rate
        self.lr_factor = lr_factor
        self.betas, self.weight_decay = tuple(betas), weight_decay
        self.max_grad_norm = max_grad_norm
        self.loss_weight = loss_weight
        self.mode = mode
        self.refresh_steps = refresh_steps
        self.collapse_threshold, self.collapse_patience = collapse_threshold, collapse_patience
        self.staleness_fraction = staleness_fraction
        self.health = DrafterHealth(staleness_fraction, collapse_threshold, collapse_patience)
        # where the event lines go; the learner points it at its own log
        self.log: Callable[[str], None] = log or (lambda msg: print(msg, flush=True))
        self.grad_norms: list[float] = []  # the last step's drafter gradient norms, before clipping
        self.captures: list[dict] = []  # this step's drafter inputs, one per micro-batch of the plan (`keep`)
        self.params: list[torch.nn.Parameter] = []
        self.optimizer: torch.optim.Optimizer | None = None
        if drafter is not None:
            self.params = [p for p in drafter.parameters() if p.requires_grad]
            # fused: one kernel over the drafter's parameters; `base_lr` is the unscheduled rate (checkpointed
            # with the optimizer, so a resume can say when the config changed it)
            self.optimizer = torch.optim.AdamW([{"params": self.params, "lr": learning_rate * lr_factor(0),
                                                 "base_lr": learning_rate}],
                                               betas=self.betas, weight_decay=weight_decay, fused=True)

    @classmethod
    def from_config(cls, cfg: Any, drafter: Any, lr_factor: Callable[[int], float],
                    log: Callable[[str], None] | None = None) -> DrafterTrainer:
        """From a `TrainConfig` value (its `drafter`, `policy` and `speculative` sections; not imported here)."""
        d, pc = cfg.drafter, cfg.policy
        return cls(drafter if d.online else None, spec=cfg.speculative.drafter,
                   learning_rate=d.learning_rate or pc.learning_rate * 100, lr_factor=lr_factor,
                   betas=tuple(pc.adam_betas), weight_decay=pc.weight_decay, max_grad_norm=pc.max_grad_norm,
                   loss_weight=d.loss_weight, mode=d.online_mode, refresh_steps=d.refresh_steps,
                   staleness_fraction=d.staleness_fraction, collapse_threshold=d.collapse_threshold,
                   collapse_patience=d.collapse_patience, log=log)

    # ------------------------------------------------------------------ what the policy forward keeps
    @property
    def capture_layers(self) -> tuple:
        """The policy layers whose hidden states the drafter reads (EAGLE's fused layers; () for MTP, which reads
        the final-norm output every forward returns)."""
        return tuple(getattr(self.drafter, "target_layers", ()) or ()) if self.drafter is not None else ()

    top = TOPK  # the policy's top-K next-token distribution the draft loss distils

    def wants_capture(self, al: float | None) -> bool:
        """Whether this step's policy forward keeps the drafter's inputs, for a step whose generation had
        acceptance length `al` (None: no speculation, or too few drafts to count)."""
        if self.drafter is None:
            return False
        return self.mode == "every_step" or (self.refresh_steps > 0 and self.health.is_stale(al))

    def pack(self, toks: Tensor, mask: Tensor, captured: dict) -> dict:
        """One micro-batch's captures as the drafter's padded, detached training batch."""
        return draft_batch(self.drafter, toks, mask, captured, captured["response_top"])

    def start_step(self) -> None:
        """A new RL step: forget the last step's captures."""
        self.captures = []

    def keep(self, toks: Tensor, mask: Tensor, captured: dict) -> None:
        """Keep one micro-batch's drafter inputs (from the policy forward at the step's start weights), in plan
        order, for this step's updates (`after_policy_update`)."""
        self.captures.append(self.pack(toks, mask, captured))

    # ------------------------------------------------------------------ updates
    @property
    def lr(self) -> float | None:
        return None if self.optimizer is None else self.optimizer.param_groups[0]["lr"]

    def _update(self, captures: list[dict], scale: float, step: int, what: str, after: str) -> float:
        """One AdamW update on the mean draft loss of `captures` (x `scale`), its gradient norm clipped to
        `max_grad_norm`; returns the mean draft loss."""
        opt = self.optimizer
        opt.zero_grad(set_to_none=True)
        total = 0.0
        for c in captures:
            dl = draft_loss(self.drafter, c)
            if not torch.isfinite(dl):
                opt.zero_grad(set_to_none=True)
                raise DrafterNonFiniteError(
                    f"step {step}: non-finite drafter loss{what} of the online drafter {self.spec!r} (drafter "
                    f"learning rate {self.lr:g}; the policy is not the cause); that update was skipped {after}")
            (scale * dl / len(captures)).backward()
            total += float(dl.detach()) / len(captures)
        gn = torch.nn.utils.clip_grad_norm_(self.params, self.max_grad_norm)
        if not torch.isfinite(gn):
            opt.zero_grad(set_to_none=True)
            raise DrafterNonFiniteError(f"step {step}: non-finite drafter gradient norm{what} of the online drafter "
                                        f"{self.spec!r}; that update was skipped {after}")
        self.grad_norms.append(float(gn))
        opt.step()
        opt.zero_grad(set_to_none=True)
        return total

    def _set_lr(self, step: int) -> None:
        """The learning rate of RL step `step` (1-based): the base rate x the policy schedule's factor."""
        self.optimizer.param_groups[0]["lr"] = self.learning_rate * self.lr_factor(step - 1)

    def train_online(self, captures: list[dict], plan: list[list[list[int]]], iterations: int,
                     step: int) -> tuple[int, float | None]:
        """`every_step`: `iterations` passes over the plan's mini-batches, one update each on the mini-batch's
        captured micro-batches (`captures` is in plan order); returns (updates, mean draft loss)."""
        if self.drafter is None or not captures:
            return 0, None
        self._set_lr(step)
        n, loss = iterations * len(plan), 0.0
        k = 0
        for _ in range(iterations):
            c = 0
            for mini in plan:
                k += 1
                loss += self._update(captures[c:c + len(mini)], self.loss_weight, step, "",
                                     f"(drafter update {k} of {n}; the step's policy update and earlier drafter "
                                     "updates were applied)")
                c += len(mini)
        return n, loss / n

    def refresh(self, captures: list[dict], step: int) -> int:
        """`refresh_steps` drafter-only updates, each on every one of the step's captured micro-batches; returns the
        count. The refreshed drafter reaches the backend with the next weight publication, like online updates."""
        if self.drafter is None or not captures:
            return 0
        self._set_lr(step)
        for i in range(self.refresh_steps):
            self._update(captures, 1.0, step, f" in drafter refresh update {i + 1}",
                         "(the step's policy update and earlier drafter updates were applied)")
        return self.refresh_steps

    def control(self, captures: list[dict], al: float | None, step: int, updates: int = 0) -> dict[str, Any]:
        """The staleness loop and collapse check of step `step` (1-based), whose online training gave the drafter
        `updates` updates; the step record's drafter fields."""
        stale, collapsed = self.health.observe(al, step, refit=updates > 0)
        reference = self.health.reference
        refreshed = False
        if stale and self.drafter is not None and self.refresh_steps > 0:
            updates += self.refresh(captures, step)
            refreshed = True
            self.health.refreshed(step)
            self.log(f"[specrl] step {step}: drafter stale (acceptance length {al:.2f} < "
                     f"{self.staleness_fraction:g} x reference {reference:.2f}); refreshed it with "
                     f"{self.refresh_steps} extra drafter updates on this step's rollouts")
        if collapsed and self.health.streak == self.collapse_patience:
            spec = self.spec
            copies = not parse_drafter_spec(spec).learned_part.info.learned  # n-gram / suffix: copies from context
            why = ("finds almost nothing to copy from in these rollouts" if copies else
                   "looks broken or unsynced with the policy (check its weights and the weight sync)")
            msg = (f"step {step}: acceptance length <= {self.collapse_threshold:g} for {self.collapse_patience} "
                   f"consecutive steps (now {al:.3f}): the drafter {spec!r} {why}, and generation is running at "
                   "about autoregressive speed; consider another drafter or speculative.drafter=none"
                   + self.health.collapse_cause())
            warnings.warn(msg, DrafterCollapseWarning, stacklevel=6)  # the caller of the trainer's step
            self.log(f"[specrl] warning: {msg}")
        return {"draft_updates": updates, "draft_refreshed": refreshed, "drafter_collapsed": collapsed,
                "acceptance_length_reference": reference}

    def after_policy_update(self, plan: list[list[list[int]]], iterations: int, al: float | None,
                            step: int) -> dict[str, Any]:
        """The drafter's part of RL step `step` (1-based), after the policy's optimizer steps, on the captures it
        kept this step: the `every_step` updates, then the staleness loop and the collapse check. Returns the
        record's drafter fields (`draft_loss`, `draft_updates`, `draft_refreshed`, `drafter_collapsed`,
        `acceptance_length_reference`)."""
        self.grad_norms = []
        captures = self.captures
        updates, loss = self.train_online(captures, plan, iterations, step) if self.mode == "every_step" else (0, None)
        return {"draft_loss": loss, **self.control(captures, al, step, updates)}

    def apply_hyperparams(self) -> None:
        """After loading optimizer state: this trainer's learning rate, betas and weight decay (the loaded state
        carries the values of the run that wrote it). Says so when the learning rate changed."""
        if self.optimizer is None:
            return
        group = self.optimizer.param_groups[0]
        old = group.get("base_lr", self.learning_rate)
        if old != self.learning_rate:
            self.log(f"[specrl] resume: drafter.learning_rate {old:g} -> {self.learning_rate:g} (the drafter's "
                     "optimizer uses the new value from the next update)")
        group["base_lr"] = self.learning_rate
        group["betas"], group["weight_decay"] = self.betas, self.weight_decay

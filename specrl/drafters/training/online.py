"""Online drafter training inside the RL step: turn the policy forward's captures into a drafter loss.

The learner already runs the policy over every rollout (the train forward when a batch takes one optimizer step, else
the logprob stage); with `drafter.online` that forward also keeps the hidden states the drafter reads (EAGLE: its three
fused layers; MTP: the final-norm output) and the policy's top-K next-token distribution at the response positions.
`draft_batch` packs them, detached, in the padded layout of `specrl.drafters.training.offline.batch_loss` (the same loss
offline drafter training uses), and `draft_loss` evaluates it in the drafter trainer's updates
(`specrl.drafters.training.trainer.DrafterTrainer`, after the policy's optimizer steps: every step with
`drafter.online_mode=every_step`, only in the refresh updates of a stale step with `on_stale`, which captures nothing on
other steps). Nothing reaches the policy graph, so the draft loss moves only the drafter's weights; the next `prepare`
pushes them to the engine's drafter. `DrafterHealth` is the staleness control loop's bookkeeping: it compares each
step's acceptance length with a reference AL to decide when the drafter trainer spends `drafter.refresh_steps` extra
drafter-only updates, and flags a collapsed drafter (AL near 1 for several steps) with a `DrafterCollapseWarning`.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor

from specrl.algorithms.batch import response_span
from specrl.errors import SpecRLError
from specrl.rollout.drafter_spec import DRAFTER_KINDS

TOPK = 32
CLEAR_DROP = 0.2  # AL above the collapse threshold that counts as "clearly higher" before a collapse


class DrafterCollapseWarning(UserWarning):
    """Acceptance length stayed near 1: the drafter looks broken or unsynced; generation runs at ~AR speed."""


@dataclass
class DrafterHealth:
    """Per-step acceptance-length bookkeeping of the staleness control loop and the collapse warning.

    Only steps whose generation verified at least one draft ("speculative steps") are observed. The
    reference AL starts as the AL of the first speculative step after the start of the run (or resume) or
    after the last refresh, i.e. the first step generated with the drafter as a refresh left it, and then
    follows improvements: it is raised to an exponential moving average of AL (weight `ema_weight` on the
    newest step) whenever that average exceeds it, so a drafter that online training made better is held to
    its better level, while one noisy step cannot raise the bar. The regular per-step online update does not
    reset it (it happens every step, so the loop could never see drift). A step is stale when its AL <
    `fraction` x reference; after a refresh (`refreshed()`) the next speculative step sets a new reference,
    so a refresh that did not help is not repeated every step.
    `streak` counts consecutive speculative steps with AL <= `collapse_threshold`; a step without
    speculation resets it. Where the steps are numbered (`observe(al, step, refit=True)`: the drafter's weights
    were refit before each step's generation), a streak that starts right after a step with AL clearly higher
    (at least `CLEAR_DROP` above the threshold) is attributed to that refit: `collapse_cause()` names it.
    """

    fraction: float
    collapse_threshold: float
    collapse_patience: int
    reference: float | None = None
    streak: int = 0
    ema: float | None = None
    ema_weight: float = 0.3
    prev_al: float | None = None  # the previous speculative step's AL
    cause: dict | None = None  # the refit the current streak followed: {"step", "version", "before", "refresh"}
    last_refresh: int | None = None  # the step whose staleness loop (DrafterTrainer.control) refreshed it last

    def observe(self, al: float | None, step: int | None = None, refit: bool = False) -> tuple[bool, bool]:
        """Record one step's AL (None: no speculation this step); return (stale, collapsed). `step` (1-based) and
        `refit` (the drafter's weights were refit before this step's generation) let a collapse name its refit."""
        if al is None:
            self.streak = 0
            self.cause = None
            return False, False
        if al > self.collapse_threshold:
            self.cause = None
        elif self.streak == 0 and refit and step is not None and self.prev_al is not None and \
                self.prev_al >= self.collapse_threshold + CLEAR_DROP:
            self.cause = {"step": step, "version": step - 1, "before": self.prev_al,
                          "refresh": self.last_refresh == step - 1}
        self.prev_al = al
        stale = self.is_stale(al)
        if self.reference is None:
            self.reference = self.ema = al
        else:
            self.ema = al if self.ema is None else (1 - self.ema_weight) * self.ema + self.ema_weight * al
            self.reference = max(self.reference, self.ema)
        self.streak = self.streak + 1 if al <= self.collapse_threshold else 0
        return stale, self.streak >= self.collapse_patience

    def is_stale(self, al: float | None) -> bool:
        """Whether a step with this AL is stale (what `observe` will say), without recording it."""
        return al is not None and self.reference is not None and al < self.fraction * self.reference

    def refreshed(self, step: int | None = None) -> None:
        self.reference = self.ema = None
        self.last_refresh = step

    def collapse_cause(self) -> str:
        """'' or a sentence naming the drafter refit the current collapse streak followed."""
        c = self.cause
        if not c:
            return ""
        what = (f"the drafter refit to version {c['version']} (step {c['step'] - 1}'s online update and "
                "refresh)") if c["refresh"] else f"the drafter refit to version {c['version']} (step " \
            f"{c['step'] - 1}'s online update)"
        return (f" It began at step {c['step']}, the first generation after {what}; step {c['step'] - 1} had "
                f"acceptance length {c['before']:.2f}, so that refit is the likely cause (a dropped, partial or "
                "diverged drafter update; the weight sync acknowledges what it loads, so look at the update)")

    def state_dict(self) -> dict:
        return {"reference": self.reference, "streak": self.streak, "ema": self.ema, "prev_al": self.prev_al,
                "cause": self.cause, "last_refresh": self.last_refresh}

    def load_state_dict(self, state: dict) -> None:
        self.reference, self.streak = state.get("reference"), int(state.get("streak", 0))
        self.ema = state.get("ema")
        self.prev_al, self.cause, self.last_refresh = state.get("prev_al"), state.get("cause"), \
            state.get("last_refresh")


def check_trainable(drafter: Any) -> None:
    kind = getattr(drafter, "kind", None)
    if kind not in DRAFTER_KINDS or not DRAFTER_KINDS[kind].trainable or not isinstance(drafter, torch.nn.Module):
        raise SpecRLError(f"drafter.online=true trains EAGLE or MTP drafters; the configured drafter is "
                          f"{kind!r}. Use speculative.drafter=eagle:PATH or mtp:PATH, or drafter.online=false")


@torch.no_grad()
def draft_batch(drafter: Any, toks: Tensor, mask: Tensor, captured: dict,
                response_top: tuple[Tensor, Tensor, Tensor]) -> dict:
    """The padded batch `batch_loss` expects, from one logprob micro-batch.

    `mask` [B, T-1] marks positions j whose next token j+1 is a response token; `response_top` is the policy's
    (top-TOPK probabilities, their ids, argmax ids) at those positions, in mask order
    (`response_logprobs(..., top=TOPK)`).
    """
    b, t = toks.shape
    # a train forward's captures carry the policy graph; response_top (a tuple) is passed separately
    captured = {k: v.detach() for k, v in captured.items() if isinstance(v, Tensor)}
    feats = drafter.training_features(captured, captured.get("final")).float()
    t2d = drafter.target_to_draft()
    top_p, top_i, top1 = response_top
    k = top_p.shape[-1]
    dev = toks.device  # every tensor of the batch lives with the policy's (a CUDA learner's device)
    full_mask = torch.zeros(b, t, dtype=torch.bool, device=dev)
    full_mask[:, : t - 1] = mask
    top_idx = torch.full((b, t, k), -1, dtype=torch.long, device=dev)
    top_idx[full_mask] = top_i if t2d is None else t2d[top_i]
    top_pp = torch.zeros(b, t, k, device=dev)
    top_pp[full_mask] = top_p
    top1_full = torch.zeros(b, t, dtype=torch.long, device=dev)
    top1_full[full_mask] = top1
    first, last = response_span(mask)
    return {"tokens": toks, "feats": feats, "top_idx": top_idx, "top_p": top_pp, "top1": top1_full,
            "len": last + 2, "loss_from": first + 1}


def draft_loss(drafter: Any, batch: dict) -> Tensor:
    """The drafter's training loss on one packed micro-batch (gradients reach the drafter only)."""
    from specrl.drafters.training.offline import batch_loss

    loss, _ = batch_loss(drafter, batch)
    return loss

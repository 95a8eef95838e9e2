"""What training, `specrl draft init` and drafter directories ask of a drafter with weights: `TrainableDrafter`.

The EAGLE head (`kinds/eagle.py`), the MTP heads (`kinds/mtp.py`) and the draft model (`kinds/draft_model.py`)
implement it, so the code that trains, builds, shards, saves and loads drafters (`training/`,
`training/build/from_rollouts.py`, `storage/io.py`, `specrl.parallel`) calls these methods instead of asking a
drafter for its kind:

* training: the target layers a training forward captures (`training_capture`), the features the drafter
  learns from (`training_features`), the map of target ids to its draft vocabulary (`target_to_draft`), the
  module whose parameters train (`training_module`), the methods its loss calls that a sharded learner must wrap
  (`training_methods`), the checks against the target (`prepare_training`) and the loss of one padded batch
  (`training_loss`, which scores each predicted distribution with `distill_loss`: the drafter's `objective`, soft
  cross-entropy against the target's top-K by default, plus the total-variation distance `tv_distance` with
  `Objective("ce+tv", weight)`);
* `specrl draft init`: a fresh drafter for a target (`check_build`, `untrained`), what training leaves to do
  (`after_training`), how the built drafter is saved (`save_built`) and what the build report records
  (`build_report`);
* drafter directories (`storage/io.py`, for kinds whose row in the kinds table has a `min_format_version`): the
  config fields a directory needs (`CONFIG_FIELDS`), the drafter a directory's config and weights make
  (`from_directory`) and the error for a directory of a format older than the kind reads (`old_format_error`).
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

from torch import Tensor, nn

from specrl.errors import SpecRLError


def _top_logq(logits: Tensor, top_idx: Tensor) -> Tensor:
    """log q at the target's top-K entries (q = softmax(logits); entries with idx -1 read index 0, masked later)."""
    import torch

    return torch.log_softmax(logits.float(), dim=-1).gather(-1, top_idx.clamp_min(0))


def _ce(logq: Tensor, top_idx: Tensor, top_p: Tensor) -> Tensor:
    return -(logq * top_p * (top_idx >= 0)).sum(-1)


def _tv(logq: Tensor, top_idx: Tensor, top_p: Tensor) -> Tensor:
    import torch

    ok = top_idx >= 0
    p = top_p.float()
    p = p / p.sum(-1, keepdim=True).clamp_min(torch.finfo(p.dtype).tiny)
    qk = logq.exp() * ok
    return 0.5 * (((p - qk).abs() * ok).sum(-1) + (1 - qk.sum(-1)).clamp_min(0) + (p * ~ok).sum(-1))


def soft_cross_entropy(logits: Tensor, top_idx: Tensor, top_p: Tensor) -> Tensor:
    """-sum_k p_k log softmax(logits)[idx_k] per position (entries with idx -1 are skipped)."""
    return _ce(_top_logq(logits, top_idx), top_idx, top_p)


def tv_distance(logits: Tensor, top_idx: Tensor, top_p: Tensor) -> Tensor:
    """0.5 * sum_v |p_v - q_v| per position over the draft vocabulary: q = softmax(logits), p = the target's top-K
    renormalised to sum 1 (its entries with idx -1, outside the draft vocabulary, keep their mass, which q cannot
    match). Off the top-K p is 0, so that part of the sum is q's mass there, 1 - sum_k q[idx_k]: q is needed at
    the top-K entries only. A draft from q is accepted with probability 1 - TV(p, q) under rejection sampling, so
    this is what the verifier pays for."""
    return _tv(_top_logq(logits, top_idx), top_idx, top_p)


LOSSES = ("ce", "ce+tv")  # the training objectives: soft cross-entropy, or that plus weight * TV distance


@dataclass(frozen=True)
class Objective:
    """What a drafter's training loss scores each predicted distribution with: `loss` "ce" (soft cross-entropy
    against the target's top-K) or "ce+tv" (that plus `tv_weight` * `tv_distance`)."""

    loss: str = "ce"
    tv_weight: float = 1.0

    def __post_init__(self):
        if self.loss not in LOSSES:
            raise SpecRLError(f"the training loss must be one of {', '.join(LOSSES)}, got {self.loss!r}")
        w = self.tv_weight
        if not isinstance(w, (int, float)) or isinstance(w, bool) or not w > 0 or w != w or w == float("inf"):
            raise SpecRLError(f"tv_weight must be a finite number > 0 (e.g. 1.0), got {w!r}")

    def __call__(self, logits: Tensor, top_idx: Tensor, top_p: Tensor) -> Tensor:
        logq = _top_logq(logits, top_idx)  # one log-softmax serves both terms
        ce = _ce(logq, top_idx, top_p)
        return ce if self.loss == "ce" else ce + self.tv_weight * _tv(logq, top_idx, top_p)

    def record(self) -> dict:
        return {"loss": self.loss, **({"tv_weight": float(self.tv_weight)} if self.loss != "ce" else {})}


class TrainableDrafter:
    """The training, build and directory methods of a drafter with weights (defaults: a head on the target)."""

    kind: str
    training_capture: tuple[int, ...] = ()  # target layers a training forward captures
    training_methods: tuple[str, ...] = ("forward_train",)  # what `training_loss` calls (sharded: gathered each)
    unrolls_steps = False  # the loss unrolls `ttt_steps` of training-time test (EAGLE)
    CONFIG_FIELDS: tuple[str, ...] = ()  # the fields a drafter directory's config.json must have
    objective: Objective = Objective()  # what `distill_loss` scores with (training sets it, `fit(objective=)`)
    builds_from_features = False  # `specrl draft build` trains it from the features stage (fused target layers)
    takes_markov = False  # a recipe's `markov` option applies (drafts after the first read the token before them)

    # ---------------------------------------------------------------- training
    @property
    def training_module(self) -> nn.Module:
        """The module whose parameters train: the drafter itself (a head on the target)."""
        return self  # type: ignore[return-value]

    def training_features(self, captured: dict, hidden: Tensor) -> Tensor:
        """The target features the drafter learns from, from a forward's `captured` layers and final-normed
        `hidden` [..., T, H]: the final hidden itself."""
        return hidden

    def target_to_draft(self) -> Tensor | None:
        """Each target id's draft-vocabulary index for the loss's targets; None: the full vocabulary."""
        return None

    def prepare_training(self, target) -> None:
        """Check that the drafter was made for `target`'s shape and share `target`'s embedding (and head)."""
        ta = self.target_args  # type: ignore[attr-defined]
        if target.args.hidden_size != ta.hidden_size or target.args.vocab_size != ta.vocab_size:
            raise SpecRLError(f"the drafter was built for a target with hidden size {ta.hidden_size} "
                              f"and vocabulary {ta.vocab_size}, but the target has "
                              f"{target.args.hidden_size} and {target.args.vocab_size}")
        self.attach(target)  # type: ignore[attr-defined]

    def distill_loss(self, logits: Tensor, top_idx: Tensor, top_p: Tensor) -> Tensor:
        """The per-position loss of predicted logits against the target's top-K (`objective`)."""
        return self.objective(logits, top_idx, top_p)

    def training_loss(self, batch: dict, ttt_steps: int) -> tuple[Tensor, dict]:
        """(loss, {"positions", "top1"}) of one padded batch (`specrl.drafters.training.offline.batch_loss`)."""
        raise NotImplementedError

    # ---------------------------------------------------------------- `specrl draft init`
    @classmethod
    def check_build(cls, target, **options) -> None:
        """A SpecRLError for build options that cannot make this kind's drafter for `target` (checked before
        the rollouts are generated)."""

    @classmethod
    def untrained(cls, target, *, draft_vocab=None, num_modules: int = 3, draft_layers: int = 4):
        """A fresh drafter for `target` (each kind reads the options it has)."""
        raise NotImplementedError

    @classmethod
    def from_recipe(cls, target, recipe, draft_vocab=None):
        """A fresh head for `specrl draft build` from a build recipe
        (`specrl.drafters.training.build.recipe.Recipe`)."""
        return cls.untrained(target, draft_vocab=draft_vocab)

    def checkpoint_setting(self) -> dict:
        """What a resumed training checkpoint must also agree on (its head's shape beyond the draft vocabulary)."""
        return {}

    def after_training(self, draft_vocab):
        """The drafter to measure and save once training is done (a head already drafts over `draft_vocab`)."""
        return self

    def build_report(self) -> dict:
        """This kind's fields of `train_report.json`."""
        return {}

    def save_built(self, out: Path, target, model: str | os.PathLike) -> None:
        """Save the built drafter into `out` (a drafter directory, `specrl.drafters.storage.io.save_drafter`)."""
        from specrl.drafters.storage.io import save_drafter

        save_drafter(self, out)

    # ---------------------------------------------------------------- drafter directories
    @classmethod
    def from_directory(cls, target, cfg: dict, state: dict, where: Path):
        """The drafter a directory's checked `cfg` and weights `state` make for `target` (weights not copied yet)."""
        raise NotImplementedError

    @classmethod
    def old_format_error(cls, where: Path, version: int, min_version: int) -> str:
        return (f"{where} is a {cls.kind} drafter of format {version}, made by an older specrl (this specrl reads "
                f"{cls.kind} drafters of format {min_version} and later); its weights cannot be converted. Rebuild "
                "it with `specrl draft init`")

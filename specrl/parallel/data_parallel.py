"""One rank of a data-parallel learner: the `Learner`, its policy and its drafter trainer's drafter sharded with FSDP2.

`ShardedLearner` runs in a process that has joined a `torch.distributed` process group (the Ray actors of
`specrl.cluster.learner_group` set that up). The policy is sharded with `fully_shard` per transformer block, then at the
root (a `MixedPrecisionPolicy` with bf16 parameters and fp32 gradient reduction replaces autocast under
`policy.precision: bf16-mixed`); the online drafter and the reference model are sharded at their root. Every rank
receives the whole step's rollouts (advantages are computed over whole groups first) and trains 1/N of each mini-batch
of the one-process plan (`specrl.algorithms.batch.collate` cuts the rank's rows), so optimizer step j sees the
one-process mini-batch j (a step that dynamic sampling left with a group count N does not divide still splits, as long
as each mini-batch holds a multiple of N sequences; otherwise a clear error). Each optimizer step's normaliser is the
whole mini-batch's; FSDP's reduce-scatter averages gradients over ranks (gloo has no pre-scaled sum), so each rank
normalises by it / N (collate computes both, no collective needed) and the average is the single-process gradient.
The drafter trainer (`specrl.drafters.training.trainer`) runs on every rank after the policy's optimizer steps, on that
rank's captured micro-batches: the drafter's loss, a mean over micro-batches, is averaged the same way (equal
micro-batch counts per rank). Gradient clipping is global (`clip_grad_norm_` on DTensor gradients), the policy's and the
drafter's each over its own parameters. The drafter's training methods (its class's `training_methods`) run under FSDP's
unshard; it reads the policy's embedding (and MTP its LM head) outside the policy's forward, so each rank keeps a frozen
full copy of those, refreshed after the policy's optimizer steps, before the drafter trains. So N ranks equal one
process in fp32 to rounding (tested N=1 vs 2: one step, 2 mini-batches x 2 iterations, the online drafter over 2
mini-batches, 3 groups on 2 ranks). Under bf16-mixed they do not match bit for bit: `MixedPrecisionPolicy` casts every
parameter (RMSNorm weights included) and the residual stream to bf16 where the one-process autocast keeps them in fp32;
the N-rank update stays within bf16's own rounding of the fp32 update (docs/benchmarks.md has the figures).
`merge_rank_records` turns the ranks' step records into the single-process record. Model and
optimizer checkpoints (the policy's optimizer and the drafter's) are DCP directories
(`specrl.checkpoint.sharded_state`); `named_weights` gathers one parameter at a time and only rank 0 keeps the full
tensors.
"""

from __future__ import annotations

import contextlib
import copy
import dataclasses
from types import SimpleNamespace
from typing import Any

import numpy as np
import torch
import torch.distributed as dist
from torch import Tensor, nn
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard, register_fsdp_forward_method
from torch.distributed.tensor import DTensor

from specrl.algorithms.rollouts import Rollouts
from specrl.checkpoint.sharded_state import load_dcp, save_dcp
from specrl.config.schema import TrainConfig
from specrl.errors import SpecRLError
from specrl.model.hf_checkpoint import hf_named_tensors
from specrl.observability.step_record import StepRecord
from specrl.trainer.learner import Batch, Learner, NonFiniteError, check_weights
from specrl.trainer.weight_check import probe_tokens

FORWARD_METHODS = ("forward_hidden", "logits")  # the policy methods the learner calls instead of forward


class LearnerRankError(SpecRLError):
    """A data-parallel learner rank died, failed or timed out in a collective; the learner group is unusable."""


def _full(t: Tensor) -> Tensor:
    return t.full_tensor() if isinstance(t, DTensor) else t


def _local(t: Any) -> Any:
    return t.to_local() if isinstance(t, DTensor) else t


def shard_policy(policy: nn.Module, mp: MixedPrecisionPolicy | None) -> None:
    """`fully_shard` each transformer block, then the root; the learner's entry points run FSDP's hooks."""
    kw = {"mp_policy": mp} if mp is not None else {}
    for block in policy.layers:
        fully_shard(block, **kw)
    fully_shard(policy, **kw)
    for name in FORWARD_METHODS:
        register_fsdp_forward_method(policy, name)




class ShardedLearner(Learner):
    """`Learner` on one rank of an initialised process group: its share of each step, sharded state."""

    # the shared-prefix forward calls each block twice (prompts, then rows); FSDP2 unshards a block per call and
    # that path is not tested under sharding, so a sharded policy scores whole sequences
    share_prefixes = False

    def __init__(self, cfg: TrainConfig, policy: nn.Module, drafter: Any = None, max_policy_lag: int = 0):
        if not dist.is_initialized():
            raise SpecRLError("ShardedLearner needs an initialised torch.distributed process group "
                              "(specrl.cluster.learner_group starts one per rank)")
        self.rank, self.world_size = dist.get_rank(), dist.get_world_size()
        mp = None
        if cfg.policy.precision == "bf16-mixed":
            mp = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
        ref = copy.deepcopy(policy) if cfg.grpo.kl_coef > 0 else None
        shard_policy(policy, mp)
        if ref is not None:
            for p in ref.parameters():
                p.requires_grad_(False)
            shard_policy(ref.eval(), mp)
        self._sharded_ref = ref
        self._mirror = None
        if cfg.drafter.online and isinstance(drafter, nn.Module):
            fully_shard(drafter)  # fp32, as the single-process learner trains it (outside autocast)
            # the drafter loss calls these directly, not forward(): each must gather the sharded parameters
            # (its class's `training_methods`, e.g. EAGLE's fuse_concat, forward_train and head)
            for method in getattr(drafter, "training_methods", ("forward_train",)):
                register_fsdp_forward_method(drafter, method)
            self._mirror = SimpleNamespace(embed_tokens=nn.Embedding(*policy.embed_tokens.weight.shape),
                                           lm_head=nn.Linear(*reversed(policy.lm_head.weight.shape), bias=False))
            for m in (self._mirror.embed_tokens, self._mirror.lm_head):
                m.requires_grad_(False)
            drafter.attach(self._mirror)
        super().__init__(cfg, policy, drafter, max_policy_lag)
        self._refresh_mirror()

    def _make_ref(self, policy: nn.Module) -> nn.Module:
        return self._sharded_ref

    def _autocast(self) -> contextlib.AbstractContextManager:
        return contextlib.nullcontext()  # bf16-mixed: the MixedPrecisionPolicy casts parameters instead

    @torch.no_grad()
    def _refresh_mirror(self) -> None:
        """The drafter's frozen full copy of the policy's embedding and LM head (collective: every rank)."""
        if self._mirror is None:
            return
        self._mirror.embed_tokens.weight.copy_(_full(self.policy.embed_tokens.weight))
        if self.policy.lm_head.weight is self.policy.embed_tokens.weight:
            self._mirror.lm_head.weight = self._mirror.embed_tokens.weight
        else:
            self._mirror.lm_head.weight.copy_(_full(self.policy.lm_head.weight))

    # ------------------------------------------------------------------ this rank's share of a step
    def stage_train(self, batch: Batch, capture: bool | None = None) -> dict[str, Any]:
        """The policy's optimizer steps, then the drafter's mirror of the policy's embedding / LM head refreshed, so
        the drafter trainer reads the weights one process would read (the policy's after this step's updates)."""
        out = super().stage_train(batch, capture)
        self._refresh_mirror()
        return out

    def learn_batch(self, r: Rollouts, seconds: dict[str, float]) -> tuple[StepRecord, Batch]:
        rec, batch = super().learn_batch(r, seconds)
        rec.rank_tokens = float(batch.mask.sum())
        return rec, batch

    # ------------------------------------------------------------------ weights
    def check_weights(self, step: int) -> None:
        """`check_weights` over every rank's shards, then the 16-token probe forward + backward on all ranks
        (global gradient norm); every rank raises the same NonFiniteError."""
        parts = {"policy": {k: _local(v) for k, v in self.policy.state_dict().items()}}
        if self.drafter is not None:
            parts["drafter"] = {k: _local(v) for k, v in self.drafter.state_dict().items()}
        err: NonFiniteError | None = None
        try:
            check_weights(parts, None, step)
        except NonFiniteError as e:
            err = e
        toks = probe_tokens(self.policy.args.vocab_size, self.device)
        with torch.enable_grad():
            logits = self.policy.logits(self.policy.forward_hidden(toks)[0][:, :-1])
            lp = torch.log_softmax(logits.float(), -1).gather(-1, toks[:, 1:, None]).sum()
            lp.backward()
        grads = [p.grad for p in self.policy.parameters() if p.grad is not None]
        norm = float(_full(torch.nn.utils.get_total_norm(grads))) if grads else 0.0
        self.optimizer.zero_grad(set_to_none=True)
        # on the ranks' device: an NCCL group all-reduces device tensors only
        flags = torch.tensor([err is not None, not bool(torch.isfinite(logits).all()), not np.isfinite(norm)],
                             dtype=torch.float32, device=self.device)
        dist.all_reduce(flags, op=dist.ReduceOp.MAX)
        if err is not None:
            raise err
        if flags[0]:
            raise NonFiniteError(f"step {step}: after the update another learner rank's shard of the weights holds "
                                 f"NaN/inf values; the step-{step} checkpoint was not written")
        if flags[1] or flags[2]:
            what = "logits in a forward pass" if flags[1] else "gradients"
            raise NonFiniteError(f"step {step}: after the update the policy gives non-finite {what} (the update "
                                 "blew the weights up, e.g. a learning rate far too high); the step-"
                                 f"{step} checkpoint was not written")

    def named_weights(self, cast: torch.dtype | None = None
                      ) -> tuple[int, dict[str, Tensor] | None, dict[str, Tensor] | None]:
        """(version, policy by HF name, drafter) on rank 0, gathered one tensor at a time (floating tensors cast to
        `cast` as each arrives, when given); (version, None, None) on the other ranks, which hold one full tensor
        at most, briefly (collective: every rank calls it)."""
        policy = {}
        for name, t in hf_named_tensors(self.policy).items():
            full = _full(t)
            if self.rank == 0:
                full = full.detach().cpu()
                policy[name] = full.to(cast) if cast is not None and full.is_floating_point() else full
        drafter = None
        if self.drafter is not None:
            drafter = {}
            for name, t in self.drafter.state_dict().items():
                full = _full(t)
                if self.rank == 0:
                    drafter[name] = full.detach().cpu()
        if self.rank != 0:
            return self.version, None, None
        return self.version, policy, drafter

    def full_policy_state(self) -> dict[str, Tensor] | None:
        """The policy's state dict as full tensors on rank 0 (None elsewhere), gathered one tensor at a time."""
        out = {}
        for name, t in self.policy.state_dict().items():
            full = _full(t)
            if self.rank == 0:
                out[name] = full.detach().cpu()
        return out if self.rank == 0 else None

    # ------------------------------------------------------------------ checkpoint state
    def state_parts(self) -> dict[str, Any]:
        """The bookkeeping part only; model and optimizers go through `save_sharded` (DCP)."""
        return {"learner": self.bookkeeping()}

    def save_sharded(self, path: str) -> None:
        save_dcp(path, self.policy, self.drafter, self.optimizers)

    def load_sharded(self, path: str, st: dict[str, Any]) -> None:
        load_dcp(path, self.policy, self.drafter, self.optimizers)
        self.drafter_trainer.apply_hyperparams()
        self.load_bookkeeping(st)
        self._refresh_mirror()


def merge_rank_records(recs: list[StepRecord]) -> StepRecord:
    """The single-process step record from the ranks' records (each of its share, with `rank_tokens`).

    Fields computed from the whole step's rollouts (rewards, lengths, drafter control, the global gradient norm,
    the learning rate) are the same on every rank. The loss is the sum of the ranks' (each normalised by the
    global count / N, so divided by N); token means are weighted by each rank's tokens; the drafter loss is the
    ranks' mean; stage seconds are the slowest rank's.
    """
    n = len(recs)
    tokens = [r.rank_tokens for r in recs]
    total = sum(tokens)
    rec = dataclasses.replace(recs[0], rank_tokens=None)

    def weighted(key: str) -> float | None:
        if getattr(recs[0], key) is None:
            return None
        return sum(getattr(r, key) * t for r, t in zip(recs, tokens, strict=True)) / max(total, 1.0)

    for key in ("clip_fraction", "kl", "ratio_mean", "is_ratio_mean", "is_clipped_fraction"):
        setattr(rec, key, weighted(key))
    rec.token_mult_prob_error = weighted("token_mult_prob_error") if total > 0 else 1.0
    rec.loss = sum(r.loss for r in recs) / n
    if rec.is_ratio_max is not None:
        rec.is_ratio_max = max(r.is_ratio_max for r in recs)
    if rec.draft_loss is not None:
        rec.draft_loss = sum(r.draft_loss for r in recs) / n
    times = dict(rec.stage_seconds)
    for s in ("logprob", "train"):
        times[s] = max(r.stage_seconds[s] for r in recs)
    rec.stage_seconds = times
    rec.step_seconds = sum(times.values())
    rec.gen_share = times["gen"] / rec.step_seconds if rec.step_seconds > 0 else None
    return rec

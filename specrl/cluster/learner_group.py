"""N data-parallel learner ranks on Ray, behind the learner contract (`specrl.trainer.protocol.LearnerProtocol`).

`LearnerGroup(cfg)` places `learner.world_size` `LearnerRank` actors in one placement group (a bundle of
`learner.threads` CPUs each, packed on one node), has rank 0 pick a free port on its node's address, and every
rank joins one `torch.distributed` process group there (`gloo` on CPU, `nccl` on CUDA) with
`learner.collective_timeout_s` as the collective timeout, then builds the same `ShardedLearner`
(`specrl.parallel.data_parallel`) from the config. The group offers what the pipelines call on any learner: `learn`
(every rank receives the step's rollouts once through the object store and trains its share; the records are
merged), `named_weights` (rank 0's gathered tensors: one full copy), `version` / `step_count`, `check_weights`,
`state_parts` (bookkeeping plus a directory part that the ranks write with DCP inside the checkpoint's temporary
directory), `load_parts` (the checkpoint's DCP directory, written by any number of ranks), `export` (an HF
checkpoint from rank 0) and `close`. Every call waits for all ranks; a rank that dies or fails makes the others
fail by the collective timeout at the latest, and the group then kills its actors and raises `LearnerRankError`
naming the rank. Ray is started locally (loopback) when nobody started it.
"""

from __future__ import annotations

import datetime
import os
import socket
import time
from pathlib import Path
from typing import Any

import ray
import torch
from ray.util.placement_group import placement_group, remove_placement_group
from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

from specrl.algorithms.rollouts import Rollouts
from specrl.checkpoint.sharded_state import DCP_PART, dcp_dir
from specrl.cluster.local_ray import start_local_ray
from specrl.cluster.plugin_env import actor_options
from specrl.config.schema import TrainConfig
from specrl.cpu import allowed_cores
from specrl.errors import SpecRLError
from specrl.observability.step_record import StepRecord
from specrl.parallel.data_parallel import LearnerRankError, merge_rank_records
from specrl.trainer.config_check import validate_config
from specrl.trainer.protocol import LearnerProtocol

GRACE_SECONDS = 30.0  # beyond the collective timeout: how long a call may take before the group gives up
PLACEMENT_TIMEOUT_SECONDS = 60.0


def _device_type(cfg: TrainConfig) -> str:
    """cuda when the config's run.device names CUDA (or auto finds it), else cpu."""
    dev = str(getattr(cfg.run, "device", "cpu"))
    if dev == "auto":
        return "cuda" if torch.cuda.is_available() else "cpu"
    return "cuda" if dev.startswith("cuda") else "cpu"


@ray.remote
class LearnerRank:
    """One rank: a process-group member owning a `ShardedLearner`."""

    def __init__(self, cfg_data: dict, rank: int, world_size: int, threads: int):
        torch.set_num_threads(threads)
        self.cfg = validate_config(cfg_data, "learner rank config")
        self.rank, self.world_size = rank, world_size
        self.learner = None
        self.lines: list[str] = []

    def pid(self) -> int:
        return os.getpid()

    def address(self) -> tuple[str, int]:
        """This node's address and a free TCP port on it (rank 0: the rendezvous)."""
        host = ray.util.get_node_ip_address()
        with socket.socket() as s:
            s.bind((host, 0))
            return host, s.getsockname()[1]

    def setup(self, host: str, port: int, max_policy_lag: int) -> None:
        import torch.distributed as dist

        from specrl.drafters.storage.default import resolve_drafter
        from specrl.model.hf_checkpoint import parse_dtype
        from specrl.model.loader import load_model
        from specrl.parallel.data_parallel import ShardedLearner
        from specrl.trainer.sync_trainer import seed_everything

        cfg = self.cfg
        device = _device_type(cfg)
        dist.init_process_group("nccl" if device == "cuda" else "gloo", init_method=f"tcp://{host}:{port}",
                                rank=self.rank, world_size=self.world_size,
                                timeout=datetime.timedelta(seconds=cfg.learner.collective_timeout_s))
        seed_everything(cfg.run.seed)
        policy, _ = load_model(cfg.model.name, dtype=parse_dtype(cfg.model.dtype), device=device)  # its device
        drafter = resolve_drafter(cfg.speculative.drafter, policy) if cfg.drafter.online else None
        policy.train()
        self.learner = ShardedLearner(cfg, policy, drafter, max_policy_lag=max_policy_lag)
        self.learner.log = self.lines.append

    def learn(self, r: Rollouts, seconds: dict) -> tuple[StepRecord, list[str]]:
        rec = self.learner.learn(r, seconds)
        lines, self.lines[:] = list(self.lines), []
        return rec, lines

    def named_weights(self):
        return self.learner.named_weights()

    def published_weights(self, dtype: torch.dtype) -> tuple[int, list | None]:
        """(version, [ref]) on rank 0: the gathered policy cast to `dtype` as it is gathered, and the drafter, put
        into the object store from here; (version, None) on the other ranks."""
        from specrl.trainer.weight_sync import cast_in_place

        version, policy, drafter = self.learner.named_weights(cast=dtype)
        if policy is None:
            return version, None
        ref = ray.put((cast_in_place(policy, dtype), drafter))
        del policy
        return version, [ref]

    def check_weights(self, step: int) -> None:
        self.learner.check_weights(step)

    def state_parts(self) -> dict:
        return self.learner.state_parts()

    def save_sharded(self, path: str) -> None:
        self.learner.save_sharded(path)

    def load_sharded(self, path: str, st: dict) -> None:
        self.learner.load_sharded(path, st)

    def export(self, directory: str) -> None:
        """Rank 0 writes the policy as an HF checkpoint (config.json + model.safetensors)."""
        from specrl.model.hf_checkpoint import save_hf_checkpoint
        from specrl.model.transformer import Transformer

        state = self.learner.full_policy_state()
        if state is None:
            return
        with torch.device("meta"):
            model = Transformer(self.learner.policy.args)
        model.load_state_dict(state, assign=True)
        save_hf_checkpoint(model, directory)


class ShardedPart:
    """A checkpoint directory part: `write_dir(path)` has every rank write its shards there with DCP."""

    def __init__(self, group: LearnerGroup):
        self.ranks = group.ranks
        self.timeout = group.timeout

    def write_dir(self, path: Path) -> None:
        path.mkdir(parents=True, exist_ok=True)
        _wait_all(self.ranks, [r.save_sharded.remote(str(path)) for r in self.ranks], self.timeout,
                  "writing the sharded checkpoint")


def _wait_all(ranks: list, refs: list, timeout: float, what: str) -> list:
    """Every rank's result, or LearnerRankError (after killing the ranks) when one dies, fails or hangs."""
    results: list[Any] = [None] * len(refs)
    failures: list[tuple[int, BaseException]] = []
    pending, deadline = list(refs), time.monotonic() + timeout + GRACE_SECONDS
    while pending:
        done, pending = ray.wait(pending, num_returns=1, timeout=max(0.0, deadline - time.monotonic()))
        if not done:
            break
        i = refs.index(done[0])
        try:
            results[i] = ray.get(done[0])
        except ray.exceptions.RayActorError as e:
            failures.insert(0, (i, e))  # a dead rank is the cause; the others' errors follow from it
        except ray.exceptions.RayTaskError as e:
            failures.append((i, e.cause if isinstance(e.cause, BaseException) else e))
    if not failures and not pending:
        return results
    for r in ranks:
        ray.kill(r)
    if failures and isinstance(failures[0][1], SpecRLError):  # e.g. NonFiniteError: the run loop reports it
        raise failures[0][1]
    if failures:
        i, e = failures[0]
        how = "died" if isinstance(e, ray.exceptions.RayActorError) else "failed"
        first = str(e).strip().splitlines()[-1] if str(e).strip() else type(e).__name__
        raise LearnerRankError(f"learner rank {i} {how} while {what} ({type(e).__name__}: {first[:300]}); the "
                               f"learner group was stopped (a collective waits at most {timeout:g} s for a rank, "
                               "learner.collective_timeout_s)")
    stuck = [refs.index(p) for p in pending]
    raise LearnerRankError(f"learner ranks {stuck} did not finish {what} within learner.collective_timeout_s + "
                           f"{GRACE_SECONDS:g} s ({timeout + GRACE_SECONDS:g} s)")


class LearnerGroup(LearnerProtocol):
    """`learner.world_size` ranks behind the learner contract (`LearnerProtocol`; see the module docstring)."""

    def __init__(self, cfg: TrainConfig, max_policy_lag: int = 0):
        lc = cfg.learner
        n, threads = lc.world_size, lc.threads
        if n < 2:
            raise SpecRLError(f"LearnerGroup needs learner.world_size >= 2, got {n} (1 runs the in-process Learner)")
        self.cfg, self.world_size, self.timeout = cfg, n, lc.collective_timeout_s
        self.step_count = 0
        self.log = lambda msg: print(msg, flush=True)
        self.ranks: list = []
        self.pg = None
        self._own_ray = False
        if not ray.is_initialized():
            have = allowed_cores()
            if n * threads > have:
                raise SpecRLError(f"learner.world_size={n} x learner.threads={threads} needs {n * threads} CPUs, "
                                  f"but this process may use {have}; lower learner.world_size or learner.threads")
            start_local_ray(n * threads)
            self._own_ray = True
        try:
            self._start(cfg, n, threads, max_policy_lag)
        except BaseException:
            self.close()
            raise

    def _start(self, cfg: TrainConfig, n: int, threads: int, max_policy_lag: int) -> None:
        gpu = _device_type(cfg) == "cuda"
        bundle = {"CPU": threads, **({"GPU": 1} if gpu else {})}
        self.pg = placement_group([dict(bundle) for _ in range(n)], strategy="STRICT_PACK")
        try:
            ray.get(self.pg.ready(), timeout=PLACEMENT_TIMEOUT_SECONDS)
        except ray.exceptions.GetTimeoutError:
            have = ray.available_resources()
            raise SpecRLError(f"cannot place {n} learner ranks of {bundle} on one node within "
                              f"{PLACEMENT_TIMEOUT_SECONDS:g} s (Ray has {have.get('CPU', 0):g} free CPUs"
                              f"{', ' + format(have.get('GPU', 0), 'g') + ' free GPUs' if gpu else ''}); lower "
                              "learner.world_size or learner.threads") from None
        data = cfg.model_dump(mode="json")
        self.ranks = [LearnerRank.options(**actor_options(data, num_cpus=threads, num_gpus=1 if gpu else 0,
                                                          scheduling_strategy=PlacementGroupSchedulingStrategy(
                                                              self.pg, placement_group_bundle_index=i)))
                      .remote(data, i, n, threads) for i in range(n)]
        host, port = ray.get(self.ranks[0].address.remote())
        self.pids = ray.get([r.pid.remote() for r in self.ranks])
        self._call("setup", host, port, max_policy_lag, what="starting")

    def _call(self, method: str, *args, what: str | None = None) -> list:
        refs = [getattr(r, method).remote(*args) for r in self.ranks]
        return _wait_all(self.ranks, refs, self.timeout, what or f"{method} (step {self.step_count + 1})")

    # ------------------------------------------------------------------ the learner contract
    def learn(self, r: Rollouts, seconds: dict[str, float]) -> StepRecord:
        out = self._call("learn", ray.put(r), seconds, what=f"training step {self.step_count + 1}")
        rec = merge_rank_records([rec for rec, _ in out])
        for line in out[0][1]:
            self.log(line)
        self.step_count = rec.step
        return rec

    def named_weights(self):
        return self._call("named_weights", what=f"gathering the weights of version {self.version}")[0]

    def published_weights(self, dtype: torch.dtype) -> tuple[int, list]:
        """(version, [ref]): rank 0 gathers the policy, casts it as it goes and puts it in the object store; the
        caller receives only the reference (one copy of the policy in flight)."""
        return self._call("published_weights", dtype, what=f"publishing the weights of version {self.version}")[0]

    def publish(self, sync: Any) -> None:
        """To the async pipeline's Ray weight sync: rank 0's reference, cast to the sync's rollout dtype."""
        sync.push_ref(*self.published_weights(sync.rollout_dtype))

    def resident_parameters(self) -> int:
        return 0  # the ranks own the policy

    def check_weights(self, step: int) -> None:
        self._call("check_weights", step, what=f"checking the weights of step {step}")

    def state_parts(self) -> dict[str, Any]:
        parts = self._call("state_parts")[0]
        parts[DCP_PART] = ShardedPart(self)
        return parts

    def load_parts(self, parts: dict[str, Any], st: dict[str, Any]) -> None:
        self._call("load_sharded", dcp_dir(parts), st, what="loading the checkpoint")  # DCP reshards to N ranks
        self.step_count = int(st["step"])

    def export(self, directory: str | Path) -> None:
        """The policy as an HF checkpoint directory (written by rank 0)."""
        self._call("export", str(directory), what=f"exporting the policy to {directory}")

    def close(self) -> None:
        for r in self.ranks:
            ray.kill(r)
        self.ranks = []
        if self.pg is not None:
            remove_placement_group(self.pg)
            self.pg = None
        if self._own_ray and ray.is_initialized():
            ray.shutdown()
            self._own_ray = False

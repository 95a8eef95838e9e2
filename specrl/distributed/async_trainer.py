"""Asynchronous GRPO on Ray: rollout workers generate the next steps while the learner trains this one.

`AsyncGRPOTrainer` is the driver. It presents the sync trainer's surface to the run loop (`step`, `validate`,
`state_parts`/`load_parts`, `save_final`, `close`), so validation, checkpoints, resume, metrics and the report are
the same code for both pipelines. Step s (1-based; index i = s - 1) is generated for policy version >= i - L, where
L = `pipeline.max_trajectory_age_steps`: the driver keeps the groups of steps i .. i + L in flight, each step's
groups split in contiguous shares over the workers (request ids are the step's global ones, so the shares merge
into exactly the sync step's rollouts). The learner trains step s on version i and publishes version s once,
through the object store; workers pick up the newest version before each share. A group older than the bound is
dropped, counted and regenerated. With L = 0 nothing overlaps and the run equals the sync run step for step;
with L >= 1, generation of the next step hides behind training. The in-flight object references are the
trajectory buffer (Ray's object store holds the finished groups; its size is bounded by the lag window).

Fault tolerance: workers restart (`max_restarts`) and their calls are retried (`max_task_retries`); a retried
share re-syncs to the newest weights and is regenerated with the same ids, so nothing is lost or trained twice.
A checkpoint stores the data cursor as it was before the first not-yet-trained step, so a resumed run
regenerates whatever was in flight. SIGINT/SIGTERM go through the run loop like a sync run's: the step being
trained finishes and is checkpointed, the groups generated ahead are discarded with the actors (`close`), Ray
is shut down and `specrl train` exits 2 with the resume command; a second signal aborts at once.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import time
import uuid
from pathlib import Path
from typing import Any

import ray

from specrl.errors import SpecRLError
from specrl.rl.config import TrainConfig
from specrl.rl.producer import Rollouts, fill_groups, merge_rollouts

WORKER_RESTARTS = 3
CONNECT_TIMEOUT_SECONDS = 3.0
LEARNER_KILL_ENV = "SPECRL_TEST_SIGKILL_AT_STEP"  # the learner's hook (specrl.rl.learner.KILL_ENV) kills the driver
# Test hook "STEP:SIGNAL[:COUNT]": in step STEP (1-based), with the next steps' groups in flight and this step's
# collected, the driver sends itself SIGNAL (TERM or INT) COUNT times (default 1), as a user or a scheduler would.
SIGNAL_ENV = "SPECRL_TEST_SIGNAL_AT_STEP"


def start_ray(cfg: TrainConfig) -> bool:
    """Connect to `pipeline.ray_address` or start Ray locally with the pipeline's CPUs; True if we started it."""
    pl = cfg.pipeline
    need = pl.num_rollout_workers * pl.worker_threads + pl.learner_threads
    if ray.is_initialized():  # a Ray the caller started: use it if it is big enough
        total = ray.cluster_resources().get("CPU", 0)
        if need > total:
            raise SpecRLError(f"pipeline needs {need} CPUs ({pl.num_rollout_workers} rollout workers x "
                              f"{pl.worker_threads} threads + {pl.learner_threads} learner threads) but the running "
                              f"Ray has {total:g}")
        return False
    if pl.ray_address is None:
        have = os.cpu_count() or 1
        if need > have:
            raise SpecRLError(f"pipeline: {pl.num_rollout_workers} rollout workers x {pl.worker_threads} threads + "
                              f"{pl.learner_threads} learner threads need {need} CPUs, but this machine has {have}; "
                              "lower pipeline.num_rollout_workers / worker_threads / learner_threads or set "
                              "pipeline.ray_address to a cluster")
        ray.init(num_cpus=need, include_dashboard=False, log_to_driver=False, logging_level="ERROR",
                 _node_ip_address="127.0.0.1", configure_logging=False)
        return True
    _check_reachable(pl.ray_address)
    try:
        ray.init(address=pl.ray_address, include_dashboard=False, log_to_driver=False, logging_level="ERROR")
    except (ConnectionError, RuntimeError, ValueError) as e:
        raise SpecRLError(f"pipeline.ray_address={pl.ray_address!r}: cannot connect to a Ray cluster there ({e}); "
                          "give the address of a running cluster (`ray start --head` prints it) or null to run "
                          "locally") from None
    total = ray.cluster_resources().get("CPU", 0)
    if need > total:
        ray.shutdown()
        raise SpecRLError(f"pipeline needs {need} CPUs but the cluster at {pl.ray_address} has {total:g}")
    return True


def _check_reachable(address: str) -> None:
    """A TCP probe of host:port (Ray itself retries an unreachable address for minutes before it gives up)."""
    if address == "auto":
        return
    hostport = address.split("://", 1)[-1]
    host, _, port = hostport.rpartition(":")
    if not host or not port.isdigit():
        raise SpecRLError(f"pipeline.ray_address={address!r}: expected HOST:PORT, ray://HOST:PORT or auto")
    try:
        socket.create_connection((host, int(port)), timeout=CONNECT_TIMEOUT_SECONDS).close()
    except OSError as e:
        raise SpecRLError(f"pipeline.ray_address={address!r}: cannot connect to a Ray cluster there ({e}); give "
                          "the address of a running cluster (`ray start --head` prints it) or null to run "
                          "locally") from None


def _get(ref):
    """`ray.get`, re-raising an actor's SpecRLError itself (its message, not Ray's traceback dump), so the run loop
    reports a learner's NonFiniteError exactly as a sync run does."""
    try:
        return ray.get(ref)
    except ray.exceptions.RayTaskError as e:
        if isinstance(e.cause, SpecRLError):
            raise e.cause from None
        raise


def _signal_hook(step: int) -> None:
    """The `SIGNAL_ENV` test hook (a no-op unless it names this step)."""
    at, _, rest = os.environ.get(SIGNAL_ENV, "").partition(":")
    if at != str(step):
        return
    name, _, count = rest.partition(":")
    for _ in range(int(count or 1)):
        os.kill(os.getpid(), getattr(signal, f"SIG{name}"))
        time.sleep(0.05)  # the handler runs here, as it would while the driver waits on Ray


class AsyncGRPOTrainer:
    """Driver of the async pipeline: N `RolloutWorker`s, one `LearnerActor`, one `WeightStore`."""

    def __init__(self, cfg: TrainConfig, run_dir: Path):
        from specrl.distributed.actors import LearnerActor, RolloutWorker, WeightStore

        self.cfg = cfg
        self.run_dir = Path(run_dir)
        self.run_dir.mkdir(parents=True, exist_ok=True)
        self.lag = cfg.pipeline.max_trajectory_age_steps
        self._own_ray = start_ray(cfg)
        try:
            pl = cfg.pipeline
            data = cfg.model_dump(mode="json")
            store_name = f"specrl-weights-{uuid.uuid4().hex[:12]}"
            self.store = WeightStore.options(num_cpus=0, name=store_name).remote()
            self.learner = LearnerActor.options(num_cpus=pl.learner_threads).remote(data, pl.learner_threads,
                                                                                     self.store)
            self.workers = [RolloutWorker.options(num_cpus=pl.worker_threads, max_restarts=WORKER_RESTARTS,
                                                  max_task_retries=WORKER_RESTARTS)
                            .remote(data, w, pl.worker_threads, store_name, str(self.run_dir))
                            for w in range(pl.num_rollout_workers)]
            names = ["learner", *[f"rollout worker {w}" for w in range(len(self.workers))]]
            states = ray.get([self.learner.ready.remote(), *[w.ready.remote() for w in self.workers]])
            errors = [f"{name}: {err}" for name, (_, err) in zip(names, states, strict=True) if err]
            if errors:
                raise SpecRLError("; ".join(dict.fromkeys(errors)))
        except Exception:
            self.close()
            raise
        self.step_count = 0
        self.dispatched = 0  # index of the next step whose groups are not yet in flight
        self.inflight: dict[int, list] = {}  # step index -> object refs of its shares (the trajectory buffer)
        self.cursor_before: dict[int, dict] = {}  # step index -> data cursor before its prompts were drawn
        self.prompts: dict[int, list[int]] = {}
        self.dropped_total = 0
        self.train_size: int | None = None  # the learner's train split size (dynamic sampling draws from it)
        self.last_rollouts: Rollouts | None = None
        self.log = lambda msg: print(msg, flush=True)
        self.timeline = self.run_dir / "timeline.jsonl"
        self.t_origin = time.time()
        self._published = self._publish()

    # ------------------------------------------------------------------ helpers
    def _publish(self) -> tuple[int, float, dict]:
        version, seconds, event = ray.get(self.learner.publish.remote())
        self._events([event])
        return version, seconds, event

    def _events(self, events: list[dict]) -> None:
        with self.timeline.open("a") as f:
            for e in events:
                f.write(json.dumps({**e, "start": e["start"] - self.t_origin, "end": e["end"] - self.t_origin}) + "\n")

    def _shares(self, idx: list[int]) -> list[tuple[int, list[int]]]:
        """Contiguous shares of a step's groups, one per worker: (first group, prompt indices)."""
        n, out, start = len(self.workers), [], 0
        for w in range(n):
            size = len(idx) // n + (1 if w < len(idx) % n else 0)
            if size:
                out.append((start, idx[start: start + size]))
            start += size
        return out

    def _dispatch(self, index: int, min_version: int) -> list:
        if index not in self.prompts:
            self.prompts[index], self.cursor_before[index] = ray.get(self.learner.next_prompts.remote())
        return [self.workers[w % len(self.workers)].generate.remote(index, first, share, min_version)
                for w, (first, share) in enumerate(self._shares(self.prompts[index]))]

    def _generate_now(self, index: int, prompt_idx: list[int], first_group: int, events: list) -> Rollouts:
        """Groups `first_group`.. of step `index` for `prompt_idx`, generated now over the workers (dynamic
        sampling's extra groups); their events join `events`."""
        refs = [self.workers[w % len(self.workers)].generate.remote(index, first_group + first, share,
                                                                     max(0, index - self.lag))
                for w, (first, share) in enumerate(self._shares(prompt_idx))]
        parts = []
        for r, ev in ray.get(refs):
            parts.append(r)
            events += ev
        return merge_rollouts(sorted(parts, key=lambda p: p.request_ids[0]))

    def _fill(self) -> None:
        """Keep the groups of steps step_count .. step_count + lag in flight (never past the run's end)."""
        last = min(self.step_count + self.lag, self.cfg.run.steps - 1)
        while self.dispatched <= last:
            self.inflight[self.dispatched] = self._dispatch(self.dispatched, max(0, self.dispatched - self.lag))
            self.dispatched += 1

    # ------------------------------------------------------------------ one step
    def step(self) -> dict[str, Any]:
        t0 = time.perf_counter()
        index = self.step_count
        self._fill()
        t1 = time.perf_counter()
        parts, events = [], []
        for r, ev in ray.get(self.inflight.pop(index)):
            parts.append(r)
            events += ev
        dropped = 0
        while any(p.policy_version < index - self.lag for p in parts):  # older than the bound: regenerate
            stale = [p for p in parts if p.policy_version < index - self.lag]
            dropped += sum(len(p.prompts) for p in stale) // self.cfg.grpo.num_generations
            parts, events = [], []
            for r, ev in ray.get(self._dispatch(index, index - self.lag)):
                parts.append(r)
                events += ev
        t2 = time.perf_counter()
        gen_windows = [e for e in events if e["kind"] == "gen"]
        wall_gen = max(e["end"] for e in gen_windows) - min(e["start"] for e in gen_windows)
        rollouts = merge_rollouts(sorted(parts, key=lambda p: p.request_ids[0]), wall_seconds=wall_gen)
        if self.cfg.grpo.filter_zero_advantage_groups:  # dynamic sampling: extra groups on the workers, at once
            if self.train_size is None:
                self.train_size = ray.get(self.learner.train_size.remote())
            rollouts = fill_groups(self.cfg, self.train_size, index, rollouts,
                                   lambda idx, first: self._generate_now(index, idx, first, events))
            t2 = time.perf_counter()
            gen_windows = [e for e in events if e["kind"] == "gen"]
        if os.environ.get(LEARNER_KILL_ENV) == str(index + 1):
            os.kill(os.getpid(), 9)  # the resume test: the whole run dies mid-step
        _signal_hook(index + 1)
        seconds = {"data": t1 - t0, "prepare": self._published[1], "gen": t2 - t1}
        rec, learn_events, lines = _get(self.learner.learn.remote(rollouts, seconds))
        for line in lines:
            self.log(line)
        self._published = self._publish()
        t3 = time.perf_counter()
        self.step_count += 1
        self.prompts.pop(index, None)
        self.cursor_before.pop(index, None)
        self.dropped_total += dropped
        self._events(events + learn_events)
        train_s = rec["stage_seconds"]["logprob"] + rec["stage_seconds"]["train"]
        wall = t3 - t0
        n = self.cfg.grpo.num_generations
        versions = [min(rollouts.policy_versions[g * n: (g + 1) * n]) for g in range(len(rollouts.prompts) // n)]
        ages = [index - v for v in versions]
        refit = [e["end"] - e["start"] for e in events if e["kind"] == "refit"]
        rec.update({
            "step_seconds": wall,
            "gen_share": (t2 - t1) / wall if wall > 0 else None,
            "exposed_gen_seconds": t2 - t1,
            "gen_seconds_workers": sum(e["end"] - e["start"] for e in gen_windows),
            "learner_idle_ratio": max(0.0, 1.0 - train_s / wall) if wall > 0 else None,
            "trajectory_age_mean": sum(ages) / len(ages),
            "trajectory_age_max": max(ages),
            "group_policy_versions": versions,
            "dropped_stale_groups": dropped,
            "max_trajectory_age_steps": self.lag,
            "refit_seconds": max(refit) if refit else 0.0,
            "publish_seconds": self._published[1],
            "trained_samples": len(rollouts.request_ids),
            "trained_request_id_range": [min(rollouts.request_ids), max(rollouts.request_ids)],
            "trained_prompt_indices": rollouts.problem_indices[::n],  # one per group, in group order
            # in-flight updates: samples whose tokens span more than one policy version
            "mixed_version_samples": sum(len(set(v)) > 1 for v in rollouts.token_versions),
        })
        self.last_rollouts = rollouts
        return rec

    def validate(self) -> dict[str, Any]:
        """Greedy held-out accuracy on worker 0 with the learner's current version."""
        return ray.get(self.workers[0].validate.remote(self.step_count))

    # ------------------------------------------------------------------ checkpoints and the end
    def check_weights(self, step: int) -> None:
        """Before checkpoint `step`: the learner actor scans its weights and runs the 16-token probe forward +
        backward (the sync learner's `check_weights`); raises its NonFiniteError."""
        _get(self.learner.check_weights.remote(step))

    def state_parts(self) -> dict[str, Any]:
        parts = ray.get(self.learner.state_parts.remote())
        learner_state = parts.pop("learner")
        # the cursor before the first step not trained yet: a resumed run draws (and regenerates) it again
        cursor = self.cursor_before.get(self.step_count) or ray.get(self.learner.data_state.remote())
        parts["trainer"] = {**learner_state, **cursor, "pipeline": "async"}
        return parts

    def load_parts(self, parts: dict[str, Any]) -> None:
        st = parts["trainer"]
        ray.get(self.learner.load_parts.remote(parts, st, {"sampler": st["sampler"]}))
        self.step_count = self.dispatched = int(st["step"])
        self.inflight.clear()
        self.prompts.clear()
        self.cursor_before.clear()
        self._published = self._publish()

    def save_final(self, directory, save_model=None) -> None:
        ray.get(self.learner.save_final.remote(str(directory)))

    def close(self) -> None:
        for a in [*getattr(self, "workers", []), getattr(self, "learner", None), getattr(self, "store", None)]:
            if a is not None:
                ray.kill(a)
        self.workers = []
        self.learner = self.store = None
        if getattr(self, "_own_ray", False) and ray.is_initialized():
            ray.shutdown()
            self._own_ray = False

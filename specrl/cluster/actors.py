"""The Ray actors of the async pipeline: rollout workers, the learner, and the versioned weight store.

`RolloutWorker` owns a rollout backend (with its drafter) and a `RolloutProducer`; `generate` first picks up the
newest published weights (refit, timed), waiting until at least the version the step needs is live, then runs the
producer's `gen` stage on its share of a step's groups; with `pipeline.in_flight_updates` it also picks up a
newer version between engine steps inside the share (the backend's `between_steps`), so a sequence may span
two versions, each token tagged with its own. `LearnerActor` owns the `Learner` and the data cursor (the
producer's `data` stage, without a backend) and publishes its weights once per RL step: one `ray.put` of
the policy (cast to the rollout dtype) and trainable drafter, registered with a version in the `WeightStore`.
`RayWeightSync` is that publication behind the `WeightSync` protocol. Everything a worker and the learner do is
the same producer and learner code the sync trainer runs; the actors only place it in processes. Each actor sets
its own torch thread count. Events (start/end wall times of refit, gen, logprob, train, publish) come back with
each result for the run's timeline.
"""

from __future__ import annotations

import os
import time
from pathlib import Path
from typing import Any

import ray
import torch

from specrl.algorithms.rollouts import Rollouts
from specrl.backends.registry import build_backend
from specrl.checkpoint.sharded_state import DcpPart
from specrl.config.schema import TrainConfig
from specrl.cpu import keep_large_allocations
from specrl.drafters.storage.default import resolve_drafter
from specrl.errors import SpecRLError
from specrl.model.hf_checkpoint import parse_dtype
from specrl.model.loader import load_model
from specrl.model.tokenizer import stop_token_ids
from specrl.observability.step_record import StepRecord
from specrl.rollout.digest import check_refit
from specrl.trainer.config_check import validate_config
from specrl.trainer.learner import Learner
from specrl.trainer.producer import RolloutProducer
from specrl.trainer.protocol import LearnerProtocol
from specrl.trainer.sync_trainer import seed_everything
from specrl.trainer.weight_sync import cast_in_place

WAIT_POLL_SECONDS = 0.02
IN_FLIGHT_POLL_SECONDS = 0.01  # in-flight updates: the weight store is asked at most this often during a share
WAIT_TIMEOUT_SECONDS = 600.0


class HeldPart:
    """A checkpoint directory part held by the learner actor (its model and optimizer state): `write_dir(path)` has
    the actor write it there with DCP (`save_checkpoint`'s directory-part protocol), so the state never travels to
    the driver; a failure there is the driver's error, with the actor's own exception."""

    def __init__(self, actor, name: str):
        self.actor, self.name = actor, name

    def write_dir(self, path) -> None:
        try:
            ray.get(self.actor.write_held_part.remote(self.name, str(path)))
        except ray.exceptions.RayTaskError as e:  # the actor's OSError / RuntimeError / SpecRLError, unwrapped
            raise (e.cause if isinstance(e.cause, Exception) else e) from None
        except ray.exceptions.RayActorError as e:
            raise SpecRLError(f"the learner actor died while writing checkpoint part {self.name!r}: {e}") from None


def _config(data: dict) -> TrainConfig:
    return validate_config(data, "pipeline actor config")


@ray.remote
class WeightStore:
    """The newest published (version, [ObjectRef of (policy tensors, drafter tensors)])."""

    def __init__(self) -> None:
        self.version: int | None = None
        self.refs: list | None = None

    def set(self, version: int, refs: list) -> None:
        if self.version is not None and version < self.version:
            raise SpecRLError(f"weight store: version {version} is older than the published {self.version}")
        self.version, self.refs = version, refs

    def latest(self) -> tuple[int | None, list | None]:
        return self.version, self.refs


class RayWeightSync:
    """`WeightSync` through Ray's object store: `push` puts the tensors once and registers the version."""

    def __init__(self, store, rollout_dtype: torch.dtype):
        self.store = store
        self.rollout_dtype = rollout_dtype

    def push(self, version: int, policy: dict, drafter: dict | None = None) -> None:
        ref = ray.put((cast_in_place(policy, self.rollout_dtype), drafter))
        ray.get(self.store.set.remote(version, [ref]))

    def push_ref(self, version: int, refs: list) -> None:
        """Register weights already in the object store (`[ref]` of a (policy, drafter) pair) as `version`."""
        ray.get(self.store.set.remote(version, refs))


    def wait_for(self, version: int, timeout: float | None = WAIT_TIMEOUT_SECONDS) -> int:
        t0 = time.monotonic()
        while True:
            live, _ = ray.get(self.store.latest.remote())
            if live is not None and live >= version:
                return live
            if timeout is not None and time.monotonic() - t0 > timeout:
                raise SpecRLError(f"weight sync: version {version} was not published within {timeout:.0f} s "
                                  f"(newest: {live})")
            time.sleep(WAIT_POLL_SECONDS)


@ray.remote
class RolloutWorker:
    def __init__(self, cfg_data: dict, index: int, threads: int, store_name: str):
        torch.set_num_threads(threads)
        if not cfg_data.get("run", {}).get("device", "cpu").startswith("cuda"):
            keep_large_allocations()  # a CPU generation-only process: reuse each step's [B, V] temporaries
        self.cfg = cfg = _config(cfg_data)
        self.index = index
        self.store = ray.get_actor(store_name)  # by name: a restarted worker finds it without object-store args
        self.version = -1  # nothing published loaded yet: the first call always refits
        self.init_error: str | None = None
        try:  # a config the worker cannot honour is reported by `ready`, as a clear error, not an actor death
            seed_everything(cfg.run.seed)
            policy, tokenizer = load_model(cfg.model.name, dtype=parse_dtype(cfg.model.dtype), device=cfg.run.device)
            self.backend = build_backend(cfg, policy)
            self.producer = RolloutProducer(cfg, tokenizer, self.backend, stop_token_ids(tokenizer, policy.args))
            if cfg.pipeline.in_flight_updates:
                self.backend.capabilities.require(in_flight_updates=True, where="rollout worker")
                self.backend.between_steps = self._in_flight
        except SpecRLError as e:
            self.init_error = str(e)
        self._last_poll = 0.0
        self._events: list[dict] = []  # in-flight refits of the share being generated

    def ready(self) -> tuple[int, str | None]:
        """(pid, the construction error or None)."""
        return os.getpid(), self.init_error

    def _load_newest(self) -> int | None:
        """Load the newest published weights if they are newer than the loaded ones; the store's newest version.
        Each load is acknowledged: the backend's digest of what it holds must match what was published."""
        live, refs = ray.get(self.store.latest.remote())
        if live is not None and live > self.version:
            policy, drafter = ray.get(refs[0])
            self._load("policy", policy, live)
            if drafter is not None:
                self._load("drafter", drafter, live)
            self.version = live
        return live

    def _where(self) -> str:
        backend = getattr(getattr(self.backend, "capabilities", None), "name", type(self.backend).__name__)
        return f"{backend} (rollout worker {self.index})"

    def _load(self, which: str, sent: dict, version: int) -> None:
        """Load `sent` into the backend and check its acknowledgement (a RefitError when it does not match)."""
        check_refit(sent, self.backend.load_weights(which, sent, version), which, self._where(), version)

    def _in_flight(self) -> None:
        """`between_steps` of the backend (pipeline.in_flight_updates): between engine steps, at most every
        IN_FLIGHT_POLL_SECONDS, pick up a newer published version; the time spent loading is a refit event."""
        now = time.monotonic()
        if now - self._last_poll < IN_FLIGHT_POLL_SECONDS:
            return
        self._last_poll = now
        t0, before = time.time(), self.version
        self._load_newest()
        if self.version != before:
            self._events.append({"lane": f"worker {self.index}", "kind": "refit", "start": t0, "end": time.time(),
                                 "in_flight": True, "version": self.version})

    def _refit(self, min_version: int) -> float:
        """Load the newest published weights (waiting until >= min_version is out); return the seconds spent."""
        t0 = time.monotonic()
        while True:
            live = self._load_newest()
            if self.version >= min_version:
                return time.monotonic() - t0
            if time.monotonic() - t0 > WAIT_TIMEOUT_SECONDS:
                raise SpecRLError(f"rollout worker {self.index}: policy version {min_version} was not published "
                                  f"within {WAIT_TIMEOUT_SECONDS:.0f} s (newest: {live})")
            time.sleep(WAIT_POLL_SECONDS)

    def generate(self, step_index: int, first_group: int, prompt_indices: list[int],
                 min_version: int) -> tuple[Rollouts, list[dict]]:
        t0 = time.time()
        self._refit(min_version)
        t1 = time.time()
        self._events = []
        version0 = self.version
        r = self.producer.stage_gen(step_index, prompt_indices, first_group)
        t2 = time.time()
        lane = f"worker {self.index}"
        in_flight = [{**e, "step": step_index + 1} for e in self._events]
        return r, [{"lane": lane, "kind": "refit", "start": t0, "end": t1, "step": step_index + 1},
                   {"lane": lane, "kind": "gen", "start": t1, "end": t2, "step": step_index + 1,
                    "version": version0}, *in_flight]

    def validate(self, min_version: int) -> dict[str, Any]:
        """Held-out accuracy with exactly the weights of `min_version` or newer (no in-flight switch inside)."""
        self._refit(min_version)
        hook, self.backend.between_steps = getattr(self.backend, "between_steps", None), None
        try:
            return self.producer.validate()
        finally:
            if hook is not None:
                self.backend.between_steps = hook


@ray.remote
class LearnerActor:
    def __init__(self, cfg_data: dict, threads: int, store):
        torch.set_num_threads(threads)
        self.cfg = cfg = _config(cfg_data)
        self.init_error: str | None = None
        self.lines: list[str] = []
        self.learner: LearnerProtocol  # one process or N ranks: the actor calls the contract only
        try:
            seed_everything(cfg.run.seed)
            lag = cfg.pipeline.max_trajectory_age_steps
            if cfg.learner.world_size > 1:  # data-parallel ranks in their own actors; this one coordinates them
                from specrl.cluster.learner_group import LearnerGroup
                from specrl.model.loader import load_model_info

                args, tokenizer = load_model_info(cfg.model.name)  # the ranks own the policy: no weights here
                self.learner = LearnerGroup(cfg, max_policy_lag=lag)
            else:
                policy, tokenizer = load_model(cfg.model.name, dtype=parse_dtype(cfg.model.dtype),
                                               device=cfg.run.device)
                online = cfg.drafter.online
                drafter = resolve_drafter(cfg.speculative.drafter, policy) if online else None
                self.learner = Learner(cfg, policy.train(), drafter, max_policy_lag=lag)
                args = policy.args
            self.tokenizer = tokenizer
            self.data = RolloutProducer(cfg, tokenizer, None, stop_token_ids(tokenizer, args))  # data stage
        except SpecRLError as e:
            self.init_error = str(e)
            return
        self.sync = RayWeightSync(store, parse_dtype(cfg.model.rollout_dtype))
        self.learner.log = self.lines.append

    def ready(self) -> tuple[int, str | None]:
        return os.getpid(), self.init_error

    def next_prompts(self) -> tuple[list[int], dict]:
        """The data stage: the next step's prompt indices, and the cursor state before drawing them."""
        before = self.data.state_dict()
        return self.data.stage_data(), before

    def train_size(self) -> int:
        """Prompts in the train split (dynamic sampling's extra draws come from it)."""
        return len(self.data.train_data)

    def data_state(self) -> dict:
        return self.data.state_dict()

    def resident_parameters(self) -> int:
        """Parameter elements this actor holds itself (0 when data-parallel ranks own the policy)."""
        return self.learner.resident_parameters()

    def publish(self) -> tuple[int, float, dict]:
        """Publish the current weights with their version; (version, seconds, timeline event). Data-parallel ranks
        put the gathered, cast weights into the object store themselves: this actor passes the reference on."""
        t0 = time.time()
        self.learner.publish(self.sync)
        t1 = time.time()
        return self.learner.version, t1 - t0, {"lane": "learner", "kind": "publish", "start": t0, "end": t1,
                                               "step": self.learner.version}

    def learn(self, rollouts: Rollouts, seconds: dict) -> tuple[StepRecord, list[dict], list[str]]:
        t0 = time.time()
        rec = self.learner.learn(rollouts, seconds)
        t1 = time.time()
        lp = rec.stage_seconds["logprob"]
        events = [{"lane": "learner", "kind": "logprob", "start": t0, "end": t0 + lp, "step": rec.step},
                  {"lane": "learner", "kind": "train", "start": t0 + lp, "end": t1, "step": rec.step}]
        lines, self.lines[:] = list(self.lines), []
        return rec, events, lines

    def check_weights(self, step: int) -> None:
        """The sync learner's pre-checkpoint check, here on the actor's weights (`Learner.check_weights`)."""
        self.learner.check_weights(step)

    def state_parts(self) -> dict:
        return self.learner.state_parts()

    def checkpoint_parts(self) -> dict:
        """The learner's checkpoint parts for the driver: its bookkeeping and an N-rank group's directory part as they
        are, the single-process learner's model and optimizer state (its `DcpPart`) held here as a `HeldPart` that
        this actor writes when the driver saves the checkpoint (`write_held_part`), so the state is never copied into
        the driver."""
        parts = self.learner.state_parts()
        me = ray.get_runtime_context().current_actor
        self.held, self.held_step, out = {}, self.learner.step_count, {}
        for name, obj in parts.items():
            if isinstance(obj, DcpPart):
                self.held[name] = obj
                out[name] = HeldPart(me, name)
            else:
                out[name] = obj
        return out

    def write_held_part(self, name: str, path: str) -> None:
        held = getattr(self, "held", {})
        if name not in held:
            raise SpecRLError(f"the learner holds no checkpoint part {name!r} to write (held: {sorted(held)}); "
                              "checkpoint_parts must be called first, and each part is written once")
        if self.learner.step_count != self.held_step:  # the optimizer state is live: a step in between changed it
            raise SpecRLError(f"checkpoint part {name!r} was taken after step {self.held_step} but the learner is at "
                              f"step {self.learner.step_count}; a checkpoint is written before the next step")
        held.pop(name).write_dir(Path(path))

    def load_parts(self, parts: dict, learner_state: dict, data_state: dict) -> None:
        self.learner.load_parts(parts, learner_state)  # a DCP directory of any world size
        self.data.load_state_dict(data_state)

    def save_final(self, directory: str) -> None:
        self.learner.export(directory)  # a data-parallel group's rank 0 writes it
        self.tokenizer.save_pretrained(directory)

    def close(self) -> None:
        """Stop the data-parallel ranks, if any (before the driver kills this actor)."""
        self.learner.close()

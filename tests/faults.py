"""Fault injection for tests: kills, signals and delays that a test installs; the library reads no hook for them.

In the test's own process a test patches through these functions (or pytest's monkeypatch). A test that runs
training in a subprocess starts it with `python -c subprocess_code(faults, call)`: the code installs the faults
in that process, then makes the call (`train_main(...)` or the CLI). Rollout workers are Ray actors in processes
of their own: `faulty_worker(...)` is a `RolloutWorker` subclass defined here, which `install` puts where the
async trainer looks the class up (`specrl.cluster.actors.RolloutWorker`); Ray ships it, closure included, to
the worker processes.

Faults (keys of `install`):
- `kill_learner_at_step`: SIGKILL the process at the start of the train stage of that step (sync pipeline).
- `kill_driver_at_step`: SIGKILL the async driver once that step's rollouts are gathered, before its update.
- `signal_at_step`: (step, "TERM" | "INT", count): the async driver sends itself the signal count times there.
- `kill_worker_at_step`: (step, marker path): a rollout worker SIGKILLs itself after its refit for that step,
  once per run (the marker file records that it happened), so Ray's restart and retry run.
- `in_flight_delay`: seconds a rollout worker sleeps between engine steps (in-flight updates), so a share spans
  a publish.

`parting_step(step)` is a `GRPOTrainer.step` for a test to patch in (monkeypatch): the speculative arm of a
compare nudges one policy weight after that step's update, so the two arms part there the way a verify forward
that rounds differently from the plain one would make them.
"""

from __future__ import annotations

import os
import signal
import time
from typing import Any

REFIT_FAULTS = ("drop-drafter", "partial-policy", "wrong-name", "stale")


def kill_learner_at(step: int) -> None:
    """SIGKILL this process at the start of the train stage of step `step`."""
    from specrl.trainer.learner import Learner

    original = Learner.stage_train

    def stage_train(self, batch, capture=None):
        if self.step_count + 1 == step:
            os.kill(os.getpid(), signal.SIGKILL)
        return original(self, batch, capture)

    Learner.stage_train = stage_train


def parting_step(step: int):
    """A replacement for `GRPOTrainer.step`: after step `step` of a trainer with speculative rollouts, one policy
    weight moves by 1e-3 (its rollouts of that step are untouched), so a seed_exact compare parts at `step`."""
    import torch

    from specrl.trainer.sync_trainer import GRPOTrainer

    original = GRPOTrainer.step

    def step_fn(self):
        rec = original(self)
        if self.cfg.speculative.enabled and self.step_count == step:
            with torch.no_grad():
                next(self.policy.parameters()).add_(1e-3)
        return rec

    return step_fn


def at_async_step(step: int, action) -> None:
    """Run `action()` in the async driver when step `step`'s rollouts are gathered, before the learner trains on
    them (the driver merges each step's shares once, with their wall time; dynamic sampling's extra merges are
    not counted)."""
    import specrl.cluster.async_trainer as at

    current: list[Any] = [None]
    original_step, original_merge = at.AsyncGRPOTrainer.step, at.merge_rollouts

    def tracked_step(self):
        current[0] = self
        return original_step(self)

    def merge(parts, **kw):
        out = original_merge(parts, **kw)
        if "wall_seconds" in kw and current[0] is not None and current[0].step_count + 1 == step:
            action()
        return out

    at.AsyncGRPOTrainer.step = tracked_step
    at.merge_rollouts = merge


def send_signal(name: str, count: int = 1) -> None:
    for _ in range(count):
        os.kill(os.getpid(), getattr(signal, f"SIG{name}"))
        time.sleep(0.05)  # the handler runs here, as it would while the driver waits on Ray


def faulty_worker(kill_at_step: int | None = None, marker: str | None = None, in_flight_delay: float = 0.0):
    """A Ray actor class: `RolloutWorker` with the given faults, plus `inject_refit_fault(kind)`: the next refit
    goes wrong the way `REFIT_FAULTS` names (the refit acknowledgement must stop it)."""
    import ray

    from specrl.cluster.actors import RolloutWorker
    from specrl.errors import SpecRLError
    from specrl.rollout.digest import check_refit

    class FaultyRolloutWorker(RolloutWorker.__ray_actor_class__):
        _fault: str | None = None
        _active: str | None = None
        _last_policy: dict | None = None
        _step_index: int | None = None

        def inject_refit_fault(self, kind: str) -> None:
            if kind not in REFIT_FAULTS:
                raise SpecRLError(f"refit fault {kind!r} unknown; use one of {REFIT_FAULTS}")
            self._fault = kind

        def _load(self, which: str, sent: dict, version: int) -> None:
            if which == "policy":  # a refit loads the policy first: the injected fault applies to this refit
                self._active, self._fault = self._fault, None
            fault, previous = self._active, self._last_policy
            if which == "policy":
                self._last_policy = sent
            if fault == "stale" or (fault == "drop-drafter" and which == "drafter"):
                ack = self.backend.weights_digest(which)  # nothing loaded, yet the version moves on
                check_refit(sent, ack, which, self._where(), version)
                return
            loaded = sent
            if fault == "partial-policy" and which == "policy" and previous:
                loaded = {k: (previous[k] if i % 2 else v) for i, (k, v) in enumerate(sent.items())}
            elif fault == "wrong-name" and which == "policy":
                a = next(k for k in sent if ".layers.0." in k)
                b = a.replace(".layers.0.", ".layers.1.")
                loaded = {**sent, a: sent[b], b: sent[a]}  # layer 0's tensor goes into layer 1 and back
            check_refit(sent, self.backend.load_weights(which, loaded, version), which, self._where(), version)

        def generate(self, step_index, first_group, prompt_indices, min_version):
            self._step_index = step_index
            return super().generate(step_index, first_group, prompt_indices, min_version)

        def _refit(self, min_version: int) -> float:
            seconds = super()._refit(min_version)
            if kill_at_step is not None and self._step_index == kill_at_step - 1 and not os.path.exists(marker):
                open(marker, "w").close()
                os.kill(os.getpid(), signal.SIGKILL)
            return seconds

        def _in_flight(self) -> None:
            if in_flight_delay:
                time.sleep(in_flight_delay)
            super()._in_flight()

    return ray.remote(FaultyRolloutWorker)


def install(kill_learner_at_step: int | None = None, kill_driver_at_step: int | None = None,
            signal_at_step: tuple[int, str, int] | None = None, kill_worker_at_step: tuple[int, str] | None = None,
            in_flight_delay: float = 0.0) -> None:
    """Install the named faults in this process (see the module docstring)."""
    if kill_learner_at_step is not None:
        kill_learner_at(kill_learner_at_step)
    if kill_driver_at_step is not None:
        at_async_step(kill_driver_at_step, lambda: os.kill(os.getpid(), signal.SIGKILL))
    if signal_at_step is not None:
        step, name, count = signal_at_step
        at_async_step(step, lambda: send_signal(name, count))
    if kill_worker_at_step is not None or in_flight_delay:
        import specrl.cluster.actors as actors

        step, marker = kill_worker_at_step or (None, None)
        actors.RolloutWorker = faulty_worker(step, marker, in_flight_delay)


def subprocess_code(faults: dict[str, Any], call: str) -> str:
    """`python -c` code that installs `faults` in the new process, then runs `call`."""
    return f"from tests.faults import install; install(**{faults!r}); {call}"

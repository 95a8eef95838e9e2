"""The run loop around `GRPOTrainer.step`: run directory, validation, checkpoints, resume, compare mode.

`train_main` is the entry point the `specrl train` CLI calls.

`setup_run` (`specrl.run.run_dir`) resolves the config and the run directory, takes its lock and writes the
resolved `config.yaml`. `run_training` drives the steps, evaluates held-out accuracy (at step 0,
every `grpo.val_every` steps and at the end), appends `metrics.jsonl` / `validation.jsonl` / TensorBoard, writes
atomic checkpoints, exports the final policy as a loadable checkpoint directory and writes `report.md`. A run
directory is locked while a run uses it (`RunLock`, a `filelock` lock: a second run refuses, naming the first's PID;
a dead run's stale lock is taken over), weights are checked before every checkpoint (`Learner.check_weights`), a
full or read-only disk stops the run with the previous checkpoint intact, and SIGINT/SIGTERM finish the step in
flight, checkpoint it and stop (`RunInterrupted`; a second signal aborts at once, `RunAborted`), so `--resume`
continues with no step missing or twice. Both exit the CLI with status 2 and the resume command.
With `compare`, `train_main` hands the run to `specrl.run.compare.run_compare` (the main job of `specrl run`). The
run's state around the step (`Run`, `Budget`, threads, certificate) is `specrl.run.session`'s.
"""

from __future__ import annotations

import signal
from pathlib import Path
from typing import Any

from specrl.checkpoint.store import step_dirname
from specrl.config.schema import TrainConfig
from specrl.errors import SpecRLError
from specrl.observability.metrics import ProgressDisplay
from specrl.parallel.data_parallel import LearnerRankError
from specrl.run import certificate
from specrl.run.compare import run_compare, shared_tokens
from specrl.run.run_dir import LOCK_FILE, RunLock, release_run, setup_run, warn
from specrl.run.session import Budget, Run, TrainerFactory, certify_run, governor_for, sync_trainer
from specrl.run.sizing import wall_start
from specrl.trainer.weight_check import NonFiniteError

__all__ = ["LOCK_FILE", "RunAborted", "RunInterrupted", "RunLock", "release_run", "run_compare", "run_training",
           "setup_run", "shared_tokens", "sync_trainer", "train_main", "warn"]


class RunInterrupted(SpecRLError):
    """SIGINT/SIGTERM: the step in flight was finished and checkpointed, then the run stopped."""


class RunAborted(SpecRLError):
    """A second SIGINT/SIGTERM: the step in flight was discarded at once; resume continues from the last
    checkpoint."""


class _StopSignals:
    """While installed, the first SIGINT/SIGTERM only asks the run to stop after the step in flight (which is
    then checkpointed); a second one aborts at once (KeyboardInterrupt: that step is discarded, and resume
    continues from the last checkpoint)."""

    SIGNALS = (signal.SIGINT, signal.SIGTERM)

    def __init__(self):
        self.received: int | None = None
        self._old: dict[int, Any] = {}

    def _handle(self, signum, frame) -> None:
        if self.received is not None:
            self.uninstall()
            raise KeyboardInterrupt(f"second {signal.Signals(signum).name}")
        self.received = signum
        warn(f"[specrl] {signal.Signals(signum).name}: finishing the current step, then checkpointing and "
             "stopping (send it again to abort now and lose that step)")

    def install(self) -> _StopSignals:
        import threading

        if threading.current_thread() is threading.main_thread():
            for sig in self.SIGNALS:
                self._old[sig] = signal.signal(sig, self._handle)
        return self

    def uninstall(self) -> None:
        for sig, old in self._old.items():
            signal.signal(sig, old)
        self._old = {}

    @property
    def name(self) -> str:
        return signal.Signals(self.received).name if self.received is not None else ""


def run_training(cfg: TrainConfig, run_dir: Path, resume: bool = False,
                 make_trainer: TrainerFactory | None = None, started: float | None = None) -> Path:
    """Train for cfg.run.steps (continuing from the newest good checkpoint when resuming). `make_trainer(cfg,
    run_dir)` builds the trainer (default: the sync `GRPOTrainer`; the CLI passes one that also knows async).
    `started`: when the command began, for `run.wall_budget_minutes` (default: SPECRL_WALL_START, else now)."""
    display = ProgressDisplay(cfg.run.steps, cfg.run.progress, title=f"specrl train {cfg.run.name}")
    governor = governor_for(cfg)
    run = Run(cfg, run_dir, resume, display, make_trainer)
    stop = _StopSignals().install()
    try:
        try:
            budget = Budget.for_run(cfg, started)
            if run.trainer.step_count == 0:
                v = run.validate(0)
                budget.reserve = v["val_seconds"]
                display.message(f"[specrl] step 0 validation accuracy {v['accuracy']}")
            while run.trainer.step_count < cfg.run.steps and stop.received is None and budget.fits_another():
                budget.begin()
                threads = governor.update() if governor else None
                rec = run.trainer.step()
                if threads is not None:
                    rec.torch_threads = threads
                run.after_step(rec)
                budget.end()
            if stop.received is None and run.trainer.step_count < cfg.run.steps:
                note = budget.note(run.trainer.step_count, cfg.run.steps)
                display.message(f"[specrl] {note}")
                run.end_early(run.trainer.step_count, note)
            if stop.received is not None:
                s = run.trainer.step_count
                if s > 0 and not (run.last_ckpt and run.last_ckpt.name == step_dirname(s)):
                    run.checkpoint(s)
                run.writer.close()
                where = f"checkpoint {run.last_ckpt}" if run.last_ckpt else "no checkpoint (no step finished)"
                raise RunInterrupted(f"{stop.name} received: stopped after step {s} of {cfg.run.steps}, "
                                     f"{where}; continue with `specrl train --resume {run_dir}`")
        except NonFiniteError as e:
            run.writer.close()
            raise run.failed(e) from None
        except LearnerRankError as e:
            run.writer.close()
            where = str(run.last_ckpt) if run.last_ckpt else "none (a resume starts at step 0)"
            raise SpecRLError(f"{e}. Training stopped after step {run.trainer.step_count} of {cfg.run.steps}; the "
                              f"last good checkpoint is {where}; continue with `specrl train --resume {run_dir}`"
                              ) from None
        except KeyboardInterrupt:
            if stop.received is None:  # not ours (no handler in a non-main thread): a plain interrupt
                raise
            run.writer.close()
            where = f"checkpoint {run.last_ckpt}" if run.last_ckpt else "no checkpoint (a resume starts at step 0)"
            raise RunAborted(f"second {stop.name}: aborted at once after {run.trainer.step_count} of "
                             f"{cfg.run.steps} steps, without finishing the step in flight or checkpointing; "
                             f"the last is {where}; continue with `specrl train --resume {run_dir}`") from None
        finally:
            stop.uninstall()
            display.close()
        report = run.finish()
        cert = certify_run(run) if cfg.run.certify else None
    finally:
        run.trainer.close()
    if cert is not None:
        print(f"[specrl] {certificate.line(cert)}", flush=True)
    print(f"[specrl] done: {run.trainer.step_count} of {cfg.run.steps} steps; report: {report}", flush=True)
    return run_dir


def train_main(config_path: str | Path | TrainConfig | None, sets: list[str] | None = None, resume: str | None = None,
               out: str | None = None, compare: bool = False, make_trainer: TrainerFactory | None = None,
               stop_on_divergence: bool = True) -> Path:
    """Entry point of `specrl train` and `specrl run` (and of `specrl.train`): returns the run directory, which
    holds report.md. `config_path` is a YAML file, a `TrainConfig` object, or None for the defaults. `compare` runs
    the config's autoregressive and speculative arms side by side (`run_compare`; `stop_on_divergence` as there).
    `run.wall_budget_minutes` counts from SPECRL_WALL_START, else from this call (`specrl.run.sizing`)."""
    started = wall_start()
    if compare:
        cfg, run_dir = setup_run(config_path, sets or [], resume, None if resume else out, started)
        try:
            return run_compare(cfg, run_dir, stop_on_divergence, resume=resume is not None, started=started)
        finally:
            release_run(run_dir)
    cfg, run_dir = setup_run(config_path, sets or [], resume, out, started)
    try:
        return run_training(cfg, run_dir, resume=resume is not None, make_trainer=make_trainer, started=started)
    finally:
        release_run(run_dir)

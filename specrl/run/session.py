"""One run around the trainer's step, the state a plain run and a compare share: `Run` (its directory, metrics and
validation files, checkpoints, resume, the final policy and report), `Budget` (`run.time_budget_minutes` and
`run.wall_budget_minutes`: whether another step fits), `governor_for` (the sync pipeline's torch threads),
`certify_run` (the run's losslessness certificate next to its report) and `sync_trainer`, the default trainer
factory. `specrl.run.loop` drives a run's steps with them, `specrl.run.compare` two arms' steps side by side.
"""

from __future__ import annotations

import json
import shutil
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from specrl.checkpoint.store import CheckpointError, load_latest, save_checkpoint
from specrl.config.schema import TrainConfig
from specrl.cpu import ThreadGovernor
from specrl.errors import SpecRLError
from specrl.fileio import replace_dir
from specrl.observability.metrics import MetricsWriter, ProgressDisplay, read_jsonl
from specrl.observability.run_report import write_report
from specrl.observability.step_record import StepRecord, read_records, to_record
from specrl.run import certificate
from specrl.run.run_dir import warn
from specrl.run.sizing import wall_deadline, wall_start
from specrl.trainer.sync_trainer import GRPOTrainer, seed_everything
from specrl.trainer.weight_check import NonFiniteError, check_weights

TrainerFactory = Callable[[TrainConfig, Path], Any]


def sync_trainer(cfg: TrainConfig, run_dir: Path) -> GRPOTrainer:
    if cfg.pipeline.mode != "sync":
        raise SpecRLError(f"pipeline.mode={cfg.pipeline.mode!r} runs on Ray (specrl.cluster); start it with "
                          "`specrl train`, or pass make_trainer=specrl.cluster.make_trainer")
    if cfg.learner.world_size > 1:
        raise SpecRLError(f"learner.world_size={cfg.learner.world_size} runs its ranks on Ray (specrl.cluster); "
                          "start it with `specrl train`, or pass make_trainer=specrl.cluster.make_trainer")
    return GRPOTrainer.from_config(cfg)


def _due(step: int, every: int, last: int) -> bool:
    return step == last or (every > 0 and step % every == 0)


def _append_jsonl(path: Path, record: dict) -> None:
    with path.open("a") as f:
        f.write(json.dumps(record) + "\n")


def _keep_until(path: Path, step: int) -> None:
    recs = [r for r in read_jsonl(path) if int(r.get("step", 0)) <= step]
    path.write_text("".join(json.dumps(r) + "\n" for r in recs))


class Budget:
    """`run.time_budget_minutes` and `run.wall_budget_minutes`: whether another step (in a compare, another pair of
    the arms' steps) fits, predicted from the slowest one so far plus `reserve` seconds kept for the final
    validation (as long as step 0's took): within `minutes` of the steps' start, and ending before `deadline` (an
    epoch second, `specrl.run.sizing.wall_deadline`). The first step always runs."""

    def __init__(self, minutes: float | None, deadline: float | None = None, wall_minutes: float | None = None):
        self.minutes, self.deadline, self.wall_minutes = minutes, deadline, wall_minutes
        self.start = self._t = time.perf_counter()
        self.slowest = 0.0
        self.reserve = 0.0
        self.stopped_by: str | None = None

    @classmethod
    def for_run(cls, cfg: TrainConfig, started: float | None = None) -> Budget:
        """The run's budget; `started`: when the command began (epoch seconds; default `wall_start()`)."""
        deadline = wall_deadline(cfg, wall_start() if started is None else started)
        return cls(cfg.run.time_budget_minutes, deadline, cfg.run.wall_budget_minutes)

    def begin(self) -> None:
        self._t = time.perf_counter()

    def end(self) -> None:
        self.slowest = max(self.slowest, time.perf_counter() - self._t)

    def fits_another(self) -> bool:
        if self.slowest == 0.0:
            return True
        need = self.slowest + self.reserve
        if self.minutes is not None and time.perf_counter() - self.start + need > self.minutes * 60.0:
            self.stopped_by = "time"
        elif self.deadline is not None and time.time() + need > self.deadline:
            self.stopped_by = "wall"
        return self.stopped_by is None

    def note(self, done: int, planned: int) -> str:
        """The sentence a run stopped by its budget reports."""
        which = (f"run.wall_budget_minutes={self.wall_minutes:g} (the whole command: set-up, steps and certificate)"
                 if self.stopped_by == "wall" else f"run.time_budget_minutes={self.minutes:g}")
        return (f"stopped by {which} after step {done} of {planned} (the next "
                f"would have ended past the budget: the slowest so far took {self.slowest:.0f} s, and "
                f"{self.reserve:.0f} s are kept for the final validation)")


class Run:
    """One trainer plus its run directory, writers and checkpoint bookkeeping."""

    def __init__(self, cfg: TrainConfig, run_dir: Path, resume: bool, display: ProgressDisplay,
                 make_trainer: TrainerFactory | None = None):
        self.cfg, self.run_dir, self.display = cfg, run_dir, display
        seed_everything(cfg.run.seed)
        self.trainer = (make_trainer or sync_trainer)(cfg, run_dir)
        try:
            self._setup(resume)
        except BaseException:
            self.trainer.close()
            raise

    def _setup(self, resume: bool) -> None:
        cfg, run_dir, display = self.cfg, self.run_dir, self.display
        self.trainer.log = display.message
        self.ckpt_root = run_dir / "checkpoints"
        self.last_ckpt: Path | None = None
        start = None
        if resume:
            try:
                ck = load_latest(self.ckpt_root)
            except CheckpointError as e:
                raise SpecRLError(f"cannot resume {run_dir}: {e}") from None
            if ck is None:
                warn(f"[specrl] {run_dir}: no checkpoint yet; starting from step 0")
            else:
                for s in ck.skipped:
                    warn(f"[specrl] warning: skipping bad checkpoint: {s}")
                self.trainer.log = warn  # what resume changes (a new learning rate) is always shown
                self.trainer.load_parts(ck.parts)
                self.trainer.log = display.message
                self.last_ckpt, start = ck.path, ck.step
                warn(f"[specrl] resumed {run_dir} from {ck.path.name} (step {ck.step})")
        self.val_path = run_dir / "validation.jsonl"
        if start is None and self.val_path.exists():
            self.val_path.unlink()
        elif start is not None:
            _keep_until(self.val_path, start)
        self.stopped_early: str | None = None  # set by end_early: why the run ended before run.steps
        self.writer = MetricsWriter(run_dir, cfg.run.tensorboard, resume_step=start if resume else None,
                                    loggers=cfg.run.loggers, name=cfg.run.name, config=cfg.model_dump(mode="json"))

    def validate(self, step: int) -> dict[str, Any]:
        t = time.perf_counter()
        v = self.trainer.validate()
        v["val_seconds"] = time.perf_counter() - t
        return self.record_validation(step, v)

    def record_validation(self, step: int, v: dict[str, Any]) -> dict[str, Any]:
        """Append validation `v` of `step` to validation.jsonl (`validate` measures it; a compare records its
        shared step-0 validation in the second arm with this)."""
        _append_jsonl(self.val_path, {"step": step, **v})
        return v

    def after_step(self, rec: StepRecord | dict[str, Any], label: str = "") -> None:
        rec = to_record(rec, require=True)
        s, c = rec.step, self.cfg
        if _due(s, c.grpo.val_every, c.run.steps):
            rec.add_validation(self.validate(s))
        self.writer.write(rec)
        self.display.update(rec, label)
        if _due(s, c.run.checkpoint_every, c.run.steps):
            self.checkpoint(s)

    def end_early(self, step: int, note: str) -> None:
        """A run stopped by its time budget after `step`: the validation and checkpoint a last step gets."""
        c = self.cfg
        self.stopped_early = note
        if not _due(step, c.grpo.val_every, c.run.steps):
            self.validate(step)
        if not _due(step, c.run.checkpoint_every, c.run.steps):
            self.checkpoint(step)

    def checkpoint(self, step: int) -> None:
        """Check the weights, then write checkpoint `step` (a clear error on a full or read-only disk)."""
        c = self.cfg
        parts = self.trainer.state_parts()
        probe = getattr(self.trainer, "check_weights", None)
        if probe is not None:  # the trainer's learner scans its weights and runs the probe forward + backward
            probe(step)
        else:  # a custom trainer without one: the NaN/inf scan of what is about to be written
            check_weights(parts, None, step)
        try:
            self.last_ckpt = save_checkpoint(self.ckpt_root, step, parts,
                                             meta={"run": c.run.name, "model": c.model.name},
                                             keep=c.run.keep_checkpoints)
        except CheckpointError as e:
            prev = f"the previous checkpoint {self.last_ckpt} is intact" if self.last_ckpt else \
                "no earlier checkpoint exists"
            raise SpecRLError(f"{e}; {prev}. Training stopped after step {step}: free space or fix the "
                              f"permissions, then continue with --resume {self.run_dir}") from None

    def failed(self, e: NonFiniteError) -> SpecRLError:
        where = str(self.last_ckpt) if self.last_ckpt else "none (no checkpoint was written yet)"
        fix = ("a lower drafter.learning_rate or drafter.loss_weight, or drafter.online=false"
               if getattr(e, "component", "policy") == "drafter" else "a lower policy.learning_rate")
        return SpecRLError(f"{e}. Training stopped; the last good checkpoint is {where} (resume with "
                           f"--resume {self.run_dir} after fixing the cause, e.g. {fix}: `specrl train --resume "
                           f"{self.run_dir} --set KEY=VALUE` applies the new value)")

    def finish(self) -> Path:
        self.writer.close()
        final = self.run_dir / "final"
        tmp = self.run_dir / ".final.tmp"
        shutil.rmtree(tmp, ignore_errors=True)
        try:
            self.trainer.save_final(tmp)
        except (OSError, RuntimeError) as e:
            shutil.rmtree(tmp, ignore_errors=True)
            raise SpecRLError(f"cannot write the final policy to {final}: {getattr(e, 'strerror', None) or e}; "
                              f"the checkpoints in {self.ckpt_root} are intact: free space or fix the "
                              f"permissions, then rerun with --resume {self.run_dir}") from None
        replace_dir(tmp, final)
        extra = {"final policy (load_model path)": f"`{final}`"}
        if self.stopped_early:
            extra["steps"] = self.stopped_early
        return write_report(self.run_dir, read_records(self.writer.path), self.cfg.to_yaml(), extra=extra,
                            validation=read_records(self.val_path),
                            max_new_tokens=self.cfg.generation.max_new_tokens)


def governor_for(cfg: TrainConfig) -> ThreadGovernor | None:
    """The sync pipeline's torch thread count (run.threads); the async actors set their own."""
    if cfg.pipeline.mode != "sync" or cfg.run.device.startswith("cuda"):
        return None  # a CPU mechanism: on CUDA the CPU threads only feed the GPU
    g = ThreadGovernor(cfg.run.threads, "run.threads")
    print(f"[specrl] torch threads: {g.describe()}", flush=True)
    return g


def certify_run(run: Run) -> dict[str, Any] | None:
    """The run's certificate (`specrl.run.certificate`), written next to its report."""
    cert = certificate.certify(run.trainer, read_records(run.writer.path))
    certificate.write_certificate(run.run_dir, cert)
    return cert

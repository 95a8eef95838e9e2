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
`run_compare` runs the same config autoregressively and speculatively with the same seeds (the main job of
`specrl run`, and `specrl train --compare`), interleaving their steps so machine noise hits both, checks seed-exact
identity after every step, and writes `report.md` (led by the speed-ups and the identity evidence) with
`compare.json` / `compare.md` beside the two arms' own run directories. Where the arms part (a numeric difference
between the verify forward and the plain one), the report says at which step; `specrl train --compare` then exits
with an error, `specrl run` finishes normally.
"""

from __future__ import annotations

import json
import shutil
import signal
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from specrl.checkpoint.store import CheckpointError, load_latest, save_checkpoint, step_dirname
from specrl.config.schema import TrainConfig
from specrl.cpu import ThreadGovernor
from specrl.errors import SpecRLError
from specrl.fileio import replace_dir
from specrl.observability.metrics import MetricsWriter, ProgressDisplay, read_jsonl
from specrl.observability.run_report import write_report
from specrl.observability.step_record import StepRecord, read_records, to_record
from specrl.parallel.data_parallel import LearnerRankError
from specrl.run import certificate
from specrl.run.compare_report import identity_checks, write_compare_report
from specrl.run.run_dir import LOCK_FILE, RunLock, release_run, setup_run, warn
from specrl.run.sizing import read_sizing
from specrl.trainer.config_check import validate_config
from specrl.trainer.sync_trainer import GRPOTrainer, seed_everything
from specrl.trainer.weight_check import NonFiniteError, check_weights

__all__ = ["LOCK_FILE", "RunAborted", "RunInterrupted", "RunLock", "release_run", "run_compare", "run_training",
           "setup_run", "sync_trainer", "train_main", "warn"]


TrainerFactory = Callable[[TrainConfig, Path], Any]


def sync_trainer(cfg: TrainConfig, run_dir: Path) -> GRPOTrainer:
    if cfg.pipeline.mode != "sync":
        raise SpecRLError(f"pipeline.mode={cfg.pipeline.mode!r} runs on Ray (specrl.cluster); start it with "
                          "`specrl train`, or pass make_trainer=specrl.cluster.make_trainer")
    if cfg.learner.world_size > 1:
        raise SpecRLError(f"learner.world_size={cfg.learner.world_size} runs its ranks on Ray (specrl.cluster); "
                          "start it with `specrl train`, or pass make_trainer=specrl.cluster.make_trainer")
    return GRPOTrainer.from_config(cfg)


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


def _due(step: int, every: int, last: int) -> bool:
    return step == last or (every > 0 and step % every == 0)


def _append_jsonl(path: Path, record: dict) -> None:
    with path.open("a") as f:
        f.write(json.dumps(record) + "\n")


def _keep_until(path: Path, step: int) -> None:
    recs = [r for r in read_jsonl(path) if int(r.get("step", 0)) <= step]
    path.write_text("".join(json.dumps(r) + "\n" for r in recs))


class _Budget:
    """`run.time_budget_minutes`: whether another step (in a compare, another pair of the arms' steps) fits in
    the budget, predicted from the slowest one so far plus `reserve` seconds kept for the final validation (as
    long as step 0's took). The first step always runs."""

    def __init__(self, minutes: float | None) -> None:
        self.minutes = minutes
        self.start = self._t = time.perf_counter()
        self.slowest = 0.0
        self.reserve = 0.0

    def begin(self) -> None:
        self._t = time.perf_counter()

    def end(self) -> None:
        self.slowest = max(self.slowest, time.perf_counter() - self._t)

    def fits_another(self) -> bool:
        if self.minutes is None or self.slowest == 0.0:
            return True
        return time.perf_counter() - self.start + self.slowest + self.reserve <= self.minutes * 60.0

    def note(self, done: int, planned: int) -> str:
        """The sentence a run stopped by its budget reports."""
        return (f"stopped by run.time_budget_minutes={self.minutes:g} after step {done} of {planned} (the next "
                f"would have ended past the budget: the slowest so far took {self.slowest:.0f} s, and "
                f"{self.reserve:.0f} s are kept for the final validation)")


class _Run:
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


def _governor(cfg: TrainConfig) -> ThreadGovernor | None:
    """The sync pipeline's torch thread count (run.threads); the async actors set their own."""
    if cfg.pipeline.mode != "sync" or cfg.run.device.startswith("cuda"):
        return None  # a CPU mechanism: on CUDA the CPU threads only feed the GPU
    g = ThreadGovernor(cfg.run.threads, "run.threads")
    print(f"[specrl] torch threads: {g.describe()}", flush=True)
    return g


def run_training(cfg: TrainConfig, run_dir: Path, resume: bool = False,
                 make_trainer: TrainerFactory | None = None) -> Path:
    """Train for cfg.run.steps (continuing from the newest good checkpoint when resuming). `make_trainer(cfg,
    run_dir)` builds the trainer (default: the sync `GRPOTrainer`; the CLI passes one that also knows async)."""
    display = ProgressDisplay(cfg.run.steps, cfg.run.progress, title=f"specrl train {cfg.run.name}")
    governor = _governor(cfg)
    run = _Run(cfg, run_dir, resume, display, make_trainer)
    stop = _StopSignals().install()
    try:
        try:
            budget = _Budget(cfg.run.time_budget_minutes)
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
        cert = _certify(run) if cfg.run.certify else None
    finally:
        run.trainer.close()
    if cert is not None:
        print(f"[specrl] {certificate.line(cert)}", flush=True)
    print(f"[specrl] done: {run.trainer.step_count} of {cfg.run.steps} steps; report: {report}", flush=True)
    return run_dir


def _certify(run: _Run) -> dict[str, Any] | None:
    """The run's certificate (`specrl.run.certificate`), written next to its report."""
    cert = certificate.certify(run.trainer)
    certificate.write_certificate(run.run_dir, cert)
    return cert


def _weights_equal(a: torch.nn.Module, b: torch.nn.Module) -> bool:
    pb = dict(b.named_parameters())
    return all(torch.equal(p, pb[n]) for n, p in a.named_parameters())


_COMPARE = "a compare (`specrl run`, `specrl train --compare`)"


def shared_tokens(a: list[list[int]], b: list[list[int]]) -> dict[str, int]:
    """How far two arms' rollouts of one step agree: tokens in common before each pair of responses parts, summed,
    next to the tokens the two arms generated."""
    common = 0
    for x, y in zip(a, b, strict=True):
        n = 0
        for s, t in zip(x, y, strict=False):
            if s != t:
                break
            n += 1
        common += n
    return {"shared": common, "autoregressive": sum(map(len, a)), "speculative": sum(map(len, b))}


def run_compare(cfg: TrainConfig, run_dir: Path, stop_on_divergence: bool = True, resume: bool = False) -> Path:
    """Same config twice — autoregressive and speculative — steps interleaved; write report.md, compare.json/.md.

    The arms run in `run_dir/autoregressive` and `run_dir/speculative` (the latter is the training run to keep).
    With `stop_on_divergence`, a seed_exact compare whose arms parted raises `SpecRLError` after the reports are
    written; without it the run ends normally and the report says where they parted. With `resume`, each arm
    continues from its newest checkpoint (`run.checkpoint_every`); an arm that got further before the kill waits
    until the other has caught up, and the steps go on in pairs from there."""
    if cfg.pipeline.mode != "sync":
        raise SpecRLError(f"{_COMPARE} runs the sync pipeline twice, got pipeline.mode={cfg.pipeline.mode!r}; set "
                          "pipeline.mode=sync, or run this config alone with `specrl train --config FILE` "
                          "(benchmarks/pipelines.py compares sync and async)")
    if not cfg.speculative.enabled:
        raise SpecRLError(f"{_COMPARE} needs speculative rollouts to compare against: set speculative.drafter "
                          "(e.g. ngram or eagle:default) and speculative.num_draft_tokens > 0 or 'auto'")
    data = cfg.model_dump(mode="json")
    data["speculative"]["drafter"] = "none"
    data["drafter"]["online"] = False
    ar_cfg = validate_config(data, "compare (autoregressive copy)")
    display = ProgressDisplay(cfg.run.steps, cfg.run.progress, live=False)
    governor = _governor(cfg)
    runs = {"autoregressive": _Run(ar_cfg, run_dir / "autoregressive", resume, display),
            "speculative": _Run(cfg, run_dir / "speculative", resume, display)}
    budget = _Budget(cfg.run.time_budget_minutes)
    for r in runs.values():
        (r.run_dir / "config.yaml").write_text(r.cfg.to_yaml())
        if r.trainer.step_count == 0:
            budget.reserve += r.validate(0)["val_seconds"]
    exact = cfg.speculative.verify == "seed_exact"
    same_rollouts: list[bool] = []
    same_weights: list[bool] = []
    shared: list[dict[str, int]] = []  # per step: tokens the arms' rollouts shared before they parted
    ar, sd = runs["autoregressive"], runs["speculative"]
    try:
        while (target := min(r.trainer.step_count for r in runs.values()) + 1) <= cfg.run.steps:
            if not budget.fits_another():
                break
            budget.begin()
            threads = governor.update() if governor else None  # once per pair: both arms on the same threads
            stepped = [r.trainer.step_count < target for r in runs.values()]
            for name, r in runs.items():
                if r.trainer.step_count >= target:
                    continue  # resumed ahead of the other arm: wait for it
                rec = r.trainer.step()
                if threads is not None:
                    rec.torch_threads = threads
                r.after_step(rec, label="[ar]   " if name == "autoregressive" else "[spec] ")
            if not all(stepped):
                budget.end()
                continue
            shared.append(shared_tokens(ar.trainer.last_rollouts.responses, sd.trainer.last_rollouts.responses))
            if exact:
                same_rollouts.append(ar.trainer.last_rollouts.responses == sd.trainer.last_rollouts.responses)
                same_weights.append(_weights_equal(ar.trainer.policy, sd.trainer.policy))
            budget.end()
        done = min(r.trainer.step_count for r in runs.values())
        budget_note = budget.note(done, cfg.run.steps) if done < cfg.run.steps else None
        if budget_note:
            display.message(f"[specrl] {budget_note}")
            if governor:
                governor.update()  # the final validation runs on the cores free now
            for r in runs.values():
                r.end_early(done, budget_note)
    except NonFiniteError as e:
        raise SpecRLError(f"compare run: {e}") from None
    for r in runs.values():
        r.finish()
    cert = _certify(sd) if cfg.run.certify else None
    checks = {**identity_checks(cfg.speculative.verify, same_rollouts, same_weights), "shared_tokens_per_step": shared,
              "stopped_early": budget_note, "sizing": read_sizing(run_dir)}
    report, lines = write_compare_report(
        run_dir, read_records(ar.writer.path), read_records(sd.writer.path), checks,
        validation={name: read_records(r.val_path) for name, r in runs.items()}, certificate=cert)
    print("\n[specrl] " + lines[0] + ":\n" + "\n".join(f"  - {line}" for line in lines[1:]), flush=True)
    certificate.require(cert, report)
    bad = checks["parted_at_step"]
    if bad is not None and stop_on_divergence:
        raise SpecRLError(f"seed_exact compare: the autoregressive and speculative runs diverged at step {bad} "
                          f"(rollouts identical: {same_rollouts[bad - 1]}, weights identical: "
                          f"{same_weights[bad - 1]}); see {report}. seed_exact emits plain decoding's token wherever "
                          "the verify forward over k+1 tokens computes bit-identical logits to the plain one-token "
                          "forwards. On CPUs it does not in every (batch, k) shape, in bfloat16 (differences up to "
                          "~0.6 in a logit) nor in float32 (~1e-4; measured on AVX512-BF16 and on AVX2 kernels: "
                          "tools/forward_shape_drift.py prints them for this machine), because GEMM kernels round B "
                          "and B*(k+1) rows differently; a uniform that falls within that rounding of a CDF boundary "
                          "picks another token and the runs part (float32 makes it rarer, not impossible). The "
                          "sampled distribution is exact either way; compare.md's gen throughput speedup is the fair "
                          "speed figure for runs that parted")
    return run_dir


def train_main(config_path: str | Path | TrainConfig | None, sets: list[str] | None = None, resume: str | None = None,
               out: str | None = None, compare: bool = False, make_trainer: TrainerFactory | None = None,
               stop_on_divergence: bool = True) -> Path:
    """Entry point of `specrl train` and `specrl run` (and of `specrl.train`): returns the run directory, which
    holds report.md. `config_path` is a YAML file, a `TrainConfig` object, or None for the defaults. `compare` runs
    the config's autoregressive and speculative arms side by side (`run_compare`; `stop_on_divergence` as there)."""
    if compare:
        cfg, run_dir = setup_run(config_path, sets or [], resume, None if resume else out)
        try:
            return run_compare(cfg, run_dir, stop_on_divergence, resume=resume is not None)
        finally:
            release_run(run_dir)
    cfg, run_dir = setup_run(config_path, sets or [], resume, out)
    try:
        return run_training(cfg, run_dir, resume=resume is not None, make_trainer=make_trainer)
    finally:
        release_run(run_dir)

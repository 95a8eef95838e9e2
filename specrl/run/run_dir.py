"""The run directory: its config, its lock and what a run leaves in it.

`setup_run` resolves the config (YAML + `--set`, a `TrainConfig`, or the saved config of a run being resumed)
and the run directory, refuses a directory that holds another run's artefacts unless `run.overwrite`, takes the
directory's lock and writes the resolved `config.yaml`; `release_run` lets the lock go. `RunLock` is that lock (a
`filelock` lock on `LOCK_FILE`: a second run refuses, naming the first's PID; a dead run's stale lock is taken
over). `warn` prints a line to stderr. The training loop that uses the directory is `specrl.run.loop`.
"""

from __future__ import annotations

import os
import shutil
import socket
import sys
from pathlib import Path

import psutil
from filelock import FileLock, Timeout

from specrl.config.hardware import hardware_fields, resolve_hardware
from specrl.config.schema import TrainConfig, apply_override
from specrl.device import describe_class
from specrl.errors import SpecRLError
from specrl.fileio import write_text_atomic
from specrl.run.sizing import apply_sizing, write_sizing
from specrl.run.sizing import line as sizing_line
from specrl.trainer.config_check import load_config, validate_config

LOCK_FILE = ".specrl.lock"


def warn(text: str) -> None:
    """Warnings and run-state lines go to stderr whatever run.progress says."""
    print(text, file=sys.stderr, flush=True)


class RunLock:
    """An exclusive lock on a run directory: a `filelock.FileLock` on `.specrl.lock`, which holds the owner's PID and
    host.

    The kernel drops the lock when its process dies (kill -9 too), so a lock file left by a dead run is stale: the
    next run takes it over and says so. A live owner makes `acquire` refuse, naming its PID. Locks are re-entrant
    within one process (compare mode, a resume after a failed start in the same interpreter).
    """

    _held: dict[Path, RunLock] = {}

    def __init__(self, path: Path):
        self.path, self.depth = path, 1
        self.previous: tuple[int | None, str] = (None, "")
        self.lock = FileLock(path, blocking=False, thread_local=False, on_acquired=self._claim)

    @staticmethod
    def _parse_owner(text: str) -> tuple[int | None, str]:
        pid_s, _, host = text.strip().partition(" ")
        try:
            return int(pid_s), host
        except ValueError:
            return None, ""

    @classmethod
    def _owner(cls, path: Path) -> tuple[int | None, str]:
        try:
            return cls._parse_owner(path.read_text())
        except (OSError, UnicodeDecodeError):
            return None, ""

    def _claim(self, fd: int) -> None:
        """filelock's on_acquired callback: remember who held the file before, then write this process as owner."""
        try:
            self.previous = self._parse_owner(os.pread(fd, 512, 0).decode())
        except UnicodeDecodeError:
            self.previous = (None, "")
        os.ftruncate(fd, 0)
        os.pwrite(fd, f"{os.getpid()} {socket.gethostname()}\n".encode(), 0)

    @classmethod
    def acquire(cls, run_dir: Path) -> RunLock:
        run_dir = Path(run_dir)
        try:
            run_dir.mkdir(parents=True, exist_ok=True)
        except OSError as e:
            raise SpecRLError(f"cannot create the run directory {run_dir}: {e.strerror or e}; pass --out DIR "
                              "(or run.out_dir) on a writable disk") from None
        key = run_dir.resolve()
        if key in cls._held:
            cls._held[key].depth += 1
            return cls._held[key]
        path = run_dir / LOCK_FILE
        lock = cls(path)
        try:
            lock.lock.acquire()
        except Timeout:
            pid, host = cls._owner(path)
            who = f"PID {pid}" + (f" on {host}" if host and host != socket.gethostname() else "") \
                if pid else "another process"
            raise SpecRLError(
                f"run directory {run_dir} is in use by another `specrl train` ({who}; lock file {path}). "
                "Two runs in one directory would delete each other's checkpoints: wait for it to finish, "
                f"stop it, or pass --out DIR for a separate run") from None
        except OSError as e:
            raise SpecRLError(f"cannot lock {path}: {e.strerror or e}; the run directory must be writable (pass "
                              "--out DIR on a writable disk)") from None
        pid, host = lock.previous
        if pid is not None and pid != os.getpid():
            alive = host == socket.gethostname() and psutil.pid_exists(pid)
            warn(f"[specrl] warning: {run_dir} was locked by PID {pid}{f' on {host}' if host else ''}, which no "
                 f"longer holds it ({'a stopped run' if not alive else 'its lock was released'}); taking over "
                 "the stale lock")
        cls._held[key] = lock
        return lock

    @classmethod
    def release(cls, run_dir: Path) -> None:
        key = Path(run_dir).resolve()
        lock = cls._held.get(key)
        if lock is None:
            return
        lock.depth -= 1
        if lock.depth > 0:
            return
        del cls._held[key]
        try:
            os.unlink(lock.path)  # still holding the lock: nobody can lock the unlinked inode meanwhile
        except OSError:
            pass
        lock.lock.release()


_ARTEFACTS = ("checkpoints", "tensorboard", "final", "metrics.jsonl", "validation.jsonl", "report.md",
              "reward.png", "stages.png", "acceptance.png", "rollout_shape.png", "config.yaml", "autoregressive",
              "speculative", "compare.json", "compare.md", "compare_reward.png", "timeline.jsonl", "timeline.png",
              "wandb", "mlruns", "sizing.json", "compare_learning.png")


def _write_text(path: Path, text: str) -> None:
    """Write a small run file atomically (temp file + rename), with a clear error on a read-only or full disk."""
    try:
        write_text_atomic(path, text)
    except OSError as e:
        raise SpecRLError(f"cannot write {path}: {e.strerror or e}; the run directory must be writable with free "
                          "space (pass --out DIR elsewhere)") from None


def _unfinished_checkpoint(run_dir: Path) -> int | None:
    """The newest checkpoint step of a run that has checkpoints but never finished (no final/), else None."""
    from specrl.checkpoint.store import list_checkpoints

    if (run_dir / "final").exists():
        return None
    ckpts = list_checkpoints(run_dir / "checkpoints")
    return ckpts[0][0] if ckpts else None


def _resolve_config(config: str | Path | TrainConfig | None, sets: list[str]) -> TrainConfig:
    """A YAML path (or None: the defaults) through `load_config`, or a `TrainConfig` object, with `--set` applied."""
    if isinstance(config, TrainConfig):
        data = config.model_dump(mode="json")
        for s in sets:
            apply_override(data, s)
        return validate_config(data, "config object" + (" with --set " + " ".join(sets) if sets else ""))
    return load_config(config, sets)


# keys of a run's saved config.yaml that now live in their own section (old -> new, under `rollout`)
_MOVED_ROLLOUT_KEYS = ("dtype", "max_model_len", "kv_cache_space_gib", "enforce_eager", "tensor_parallel_size",
                       "sampling_fix", "probe", "probe_samples")


def _migrate_saved_config(saved: Path) -> list[str]:
    """A run directory's config.yaml written before the vLLM settings moved to `rollout.vllm`: move them there
    (in the file, which `setup_run` rewrites) so the run resumes with the settings it started with. Returns the
    moved keys. A user's own config file is never migrated: it gets the error naming the new key."""
    import yaml

    try:
        data = yaml.safe_load(saved.read_text(encoding="utf-8-sig"))
    except (OSError, UnicodeDecodeError, yaml.YAMLError):
        return []  # load_config reports it
    ro = data.get("rollout") if isinstance(data, dict) else None
    if not isinstance(ro, dict):
        return []
    moved = [k for k in _MOVED_ROLLOUT_KEYS if k in ro]
    if moved:
        vllm = ro.setdefault("vllm", {})
        for k in moved:
            vllm.setdefault(k, ro.pop(k))
        write_text_atomic(saved, yaml.safe_dump(data, sort_keys=False))
        warn(f"[specrl] resuming: {saved} kept the vLLM settings under rollout; moved "
             f"{', '.join('rollout.' + k for k in moved)} to rollout.vllm")
    return moved


def setup_run(config_path: str | Path | TrainConfig | None, sets: list[str], resume: str | None,
              out: str | None, started: float | None = None) -> tuple[TrainConfig, Path]:
    """Resolve config (a YAML path or a `TrainConfig`) and run directory, lock the directory (`RunLock`), write the
    resolved config.yaml.

    The lock is held until `release_run(run_dir)` (train_main releases it when the run ends)."""
    if resume is not None:
        run_dir = Path(resume)
        saved = run_dir / "config.yaml"
        if not saved.is_file():
            raise SpecRLError(f"--resume {resume}: no config.yaml there; pass the directory of an earlier "
                              "`specrl train` run (it holds config.yaml, metrics.jsonl, checkpoints/)")
        if config_path is not None:
            given = "the config object" if isinstance(config_path, TrainConfig) else f"--config {config_path}"
            warn(f"[specrl] resuming: using {saved} (the run's resolved config); {given} is not used")
        moved = _migrate_saved_config(saved)
        loaded = load_config(saved, sets)
        cfg = resolve_hardware(loaded)
        RunLock.acquire(run_dir)
        try:
            if sets or moved or cfg != loaded:
                _write_text(saved, cfg.to_yaml())
        except BaseException:
            RunLock.release(run_dir)
            raise
        return cfg, run_dir
    cfg = resolve_hardware(_resolve_config(config_path, sets))  # config.yaml records what auto resolved to
    # run.min_steps: the work sized to this CPU, within what `started`'s wall budget leaves
    cfg, sized = apply_sizing(cfg, hardware_fields(cfg)["processor_class"], started=started)
    if sized is not None:
        print(f"[specrl] {sizing_line(sized)}", flush=True)
    print(f"[specrl] device {cfg.run.device} ({describe_class()}): rollouts in "
          f"{cfg.model.rollout_dtype}, training in {cfg.policy.precision}", flush=True)
    run_dir = Path(out) if out else Path(cfg.run.out_dir) / cfg.run.name
    if run_dir.exists() and not run_dir.is_dir():
        raise SpecRLError(f"run directory {run_dir} is a file; pass --out DIR naming a directory")
    RunLock.acquire(run_dir)  # before anything is cleared or written: a second run into this directory refuses
    try:
        existing = [a for a in _ARTEFACTS if (run_dir / a).exists() and a != "config.yaml"]
        if existing:
            if not cfg.run.overwrite:
                raise SpecRLError(
                    f"run directory {run_dir} already holds a run ({', '.join(existing)}); use --resume {run_dir} "
                    "to continue it, --out DIR (or run.name) for a new one, or --set run.overwrite=true to start "
                    "over")
            step = _unfinished_checkpoint(run_dir)
            if step is not None:
                # A killed or failed run: overwriting would silently throw its checkpoints away.
                raise SpecRLError(
                    f"run directory {run_dir} holds an unfinished run (checkpoints up to step {step}, no final/), "
                    f"and run.overwrite=true would delete them. Continue it with `specrl train --resume {run_dir}`, "
                    f"or delete {run_dir / 'checkpoints'} to start over, or pass --out DIR for a new run")
            warn(f"[specrl] run.overwrite=true: clearing the finished run in {run_dir}")
            for a in _ARTEFACTS:
                p = run_dir / a
                if p.is_dir():
                    shutil.rmtree(p)
                elif p.exists():
                    p.unlink()
        _write_text(run_dir / "config.yaml", cfg.to_yaml())
        write_sizing(run_dir, sized)
    except BaseException:
        RunLock.release(run_dir)
        raise
    return cfg, run_dir


def unfinished_compare(config_path: str | Path, sets: list[str] | None = None) -> str | None:
    """The run directory of `config_path`'s compare (with the `--set` overrides `sets`) when it holds an unfinished
    one that may not be overwritten (`run.overwrite: false`, an arm with checkpoints and no final policy: a killed
    run), so `specrl run` continues it; None otherwise (a new run, or one `run.overwrite` starts over)."""
    cfg = load_config(config_path, sets)
    run_dir = Path(cfg.run.out_dir) / cfg.run.name
    if cfg.run.overwrite or not (run_dir / "config.yaml").is_file():
        return None
    arms = [run_dir / arm for arm in ("autoregressive", "speculative")]
    if any(_unfinished_checkpoint(a) is not None for a in arms):
        warn(f"[specrl] {run_dir} holds an unfinished compare of this config: continuing it (as `specrl train "
             f"--compare --resume {run_dir}`)")
        return str(run_dir)
    return None


def release_run(run_dir: Path) -> None:
    """Release the run directory's lock taken by `setup_run`."""
    RunLock.release(run_dir)

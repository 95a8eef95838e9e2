"""Memory, file descriptors and threads of one `specrl train` run, per step; with `--load N`, a soak test.

Runs `specrl train` (the given `--config`, repeated `--set`, `--compare`) as a subprocess and samples its whole
process tree every `--interval` seconds with psutil (`children(recursive=True)`: Ray's gcs_server, raylet and actor
workers that an async run starts are in it): per process RSS, PSS where /proc lets us read it
(`memory_full_info`), open file descriptors and threads, and a role from the command line (driver = the `specrl
train` process, `ray::<ActorClass>` for a Ray worker, raylet, gcs_server, other). It tails the run's
`metrics.jsonl` (with `--compare` both `RUN/autoregressive/` and `RUN/speculative/`) to know which step is in
progress: a sample belongs to the first step whose record had not yet appeared when it was taken. For a step of the
sync pipeline it also names the stage: the record's `stage_seconds` (data, prepare, gen, logprob, train) are laid
back from the moment its line appeared, after its validation time (`validate`, when the step validated);
the rest of the step's interval is `between` (checkpoint, metrics writing), and the time before the first step is
`setup` (model loading, step-0 validation). That is an approximation at the sampling interval: the line's
appearance is observed by polling (its file's modification time), and a stage shorter than the interval may hold
no sample. Async steps overlap generation and training, so they get no stage.

Output (printed, and with `--json PATH` as a document that starts with `run_header`'s `"hardware"` record): per
step {arm, step, peak tree RSS, peak per role, peak per stage (sync), fds and threads at the step's end}, and a
summary: the overall peak RSS (tree total and per role), the stage holding the peak, and the growth after warm-up:
for the steps after `--warmup`, the least-squares slope of the per-step peak tree RSS in MB/step (MB = 10^6 bytes)
and its max - min spread, and the same for fds and for the run directory's size on disk. The soak part: whether
every step 1..run.steps was recorded once (no lost or repeated step), whether the run exited 0, whether it hung
(`--timeout` seconds: the tree is killed), and any process of the tree still alive 10 s after the driver exited
(killed then). `--load N` starts N competing CPU-load processes (`python -c "while True: pass"`) for the duration
and kills them at the end, also on Ctrl-C or an error. The run directory (a fresh one under runs/bench/ unless
`--out DIR`) is removed at the end unless `--keep-runs`; the JSON stays.

The soak (200 async steps with one step of policy lag and one competing load; a long run):

    .venv/bin/python benchmarks/memory.py --config examples/short.yaml --set pipeline.mode=async \\
        --set pipeline.max_trajectory_age_steps=1 --set grpo.importance_sampling_correction=true \\
        --set run.steps=200 --set grpo.val_every=0 --set run.checkpoint_every=10 --load 1 --timeout 7200 \\
        --json runs/bench/soak.json

A short look at the sync pipeline: `--set run.steps=3 --set grpo.val_every=0 --warmup 0`.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "benchmarks"))
from common import KEEP_RUNS_HELP, config_dtypes, hardware_line, run_dirs, run_header  # noqa: E402

MB = 1e6
STAGES = ("data", "prepare", "gen", "logprob", "train")  # specrl.observability.metrics.STAGES, the order they run in
ARMS_COMPARE = ("autoregressive", "speculative")
LOAD_CODE = "while True: pass"


# ---------------------------------------------------------------------------------------------------- sampling
def role_of(cmdline: Sequence[str], is_root: bool = False) -> str:
    """driver (the sampled subprocess itself), ray::<ActorClass> (a Ray worker: its title is `ray::Class.method`,
    `ray::IDLE` before it holds an actor), raylet, gcs_server, or other."""
    if is_root:
        return "driver"
    first = cmdline[0].strip() if cmdline else ""
    if first.startswith("ray::") and first[5:].strip():
        return "ray::" + first[5:].split()[0].split(".")[0]
    name = os.path.basename(first.split()[0]) if first else ""
    return name if name in ("raylet", "gcs_server") else "other"


@dataclass
class Proc:
    pid: int
    role: str
    rss: int
    pss: int | None
    fds: int | None
    threads: int


@dataclass
class Sample:
    """The process tree at time `t` (time.time())."""

    t: float
    procs: list[Proc]

    @property
    def rss(self) -> int:
        return sum(p.rss for p in self.procs)

    @property
    def pss(self) -> int | None:
        return None if any(p.pss is None for p in self.procs) else sum(p.pss for p in self.procs)

    @property
    def fds(self) -> int:
        return sum(p.fds or 0 for p in self.procs)

    @property
    def threads(self) -> int:
        return sum(p.threads for p in self.procs)

    def role_rss(self) -> dict[str, int]:
        out: dict[str, int] = {}
        for p in self.procs:
            out[p.role] = out.get(p.role, 0) + p.rss
        return out


class TreeSampler:
    """Samples the process tree under `root_pid`; remembers every process it saw (for the leftover check)."""

    def __init__(self, root_pid: int):
        import psutil

        self.psutil = psutil
        self.root = psutil.Process(root_pid)
        self.seen: dict[int, Any] = {root_pid: self.root}
        self.peaks: dict[int, dict[str, Any]] = {}

    def processes(self) -> list[Any]:
        try:
            kids = self.root.children(recursive=True)
        except self.psutil.Error:
            kids = []
        for k in kids:
            self.seen.setdefault(k.pid, k)
        return [self.root, *kids]

    def sample(self) -> Sample | None:
        ps = self.psutil
        t = time.time()
        procs = []
        for p in self.processes():
            try:
                with p.oneshot():
                    try:
                        full = p.memory_full_info()
                        rss, pss = full.rss, getattr(full, "pss", None)
                    except ps.AccessDenied:
                        rss, pss = p.memory_info().rss, None
                    try:
                        fds = p.num_fds()
                    except ps.AccessDenied:
                        fds = None
                    proc = Proc(p.pid, role_of(p.cmdline(), p.pid == self.root.pid), rss, pss, fds,
                                p.num_threads())
            except (ps.NoSuchProcess, ps.ZombieProcess):
                continue
            procs.append(proc)
            pk = self.peaks.setdefault(p.pid, {"pid": p.pid, "role": proc.role, "first_seen": t, "peak_rss_mb": 0.0,
                                                "peak_pss_mb": None, "peak_fds": 0, "peak_threads": 0})
            pk["role"] = proc.role if proc.role != "ray::IDLE" else pk["role"]
            pk["last_seen"] = t
            pk["peak_rss_mb"] = max(pk["peak_rss_mb"], rss / MB)
            if pss is not None:
                pk["peak_pss_mb"] = max(pk["peak_pss_mb"] or 0.0, pss / MB)
            pk["peak_fds"] = max(pk["peak_fds"], fds or 0)
            pk["peak_threads"] = max(pk["peak_threads"], proc.threads)
        return Sample(t, procs) if procs else None

    def alive(self) -> list[Any]:
        out = []
        for p in self.seen.values():
            try:
                if p.is_running() and p.status() != self.psutil.STATUS_ZOMBIE:
                    out.append(p)
            except self.psutil.Error:
                continue
        return out


def kill_tree(procs: Sequence[Any], timeout: float = 10.0) -> None:
    """SIGTERM these psutil processes, then SIGKILL the ones still alive after `timeout` seconds."""
    import psutil

    for p in procs:
        try:
            p.terminate()
        except psutil.Error:
            pass
    _, alive = psutil.wait_procs(list(procs), timeout=timeout)
    for p in alive:
        try:
            p.kill()
        except psutil.Error:
            pass
    psutil.wait_procs(alive, timeout=timeout)


# ---------------------------------------------------------------------------------------------------- load
@contextmanager
def cpu_load(n: int) -> Iterator[list[subprocess.Popen]]:
    """N competing CPU-load processes (`python -c "while True: pass"`) for the body; killed when it is left,
    normally, by an exception or by Ctrl-C."""
    procs: list[subprocess.Popen] = []
    try:
        for _ in range(n):
            procs.append(subprocess.Popen([sys.executable, "-c", LOAD_CODE], stdin=subprocess.DEVNULL,
                                          stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL))
        yield procs
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
        for p in procs:
            p.wait()


# ---------------------------------------------------------------------------------------------------- steps
@dataclass
class StepEnd:
    """A step record's line seen in `arm`'s metrics.jsonl at time `end`; `stage_seconds` only for a sync step."""

    arm: str
    step: int
    end: float
    stage_seconds: dict[str, float] = field(default_factory=dict)
    val_seconds: float = 0.0
    disk_mb: float | None = None  # the arm's run directory on disk when the record was seen

    @classmethod
    def from_record(cls, arm: str, rec: dict[str, Any], end: float) -> StepEnd:
        sync = "exposed_gen_seconds" not in rec  # the async pipeline's records carry its async fields
        stages = {s: float(rec.get("stage_seconds", {}).get(s, 0.0)) for s in STAGES} if sync else {}
        return cls(arm, int(rec["step"]), end, stages, float(rec.get("val_seconds") or 0.0))

    def stage_at(self, t: float) -> str | None:
        """The stage running at time t (t <= end), laid back from the end: validate, then the stages in reverse
        order; before them `between`. None for an async step."""
        if not self.stage_seconds:
            return None
        edge = self.end - self.val_seconds
        if t > edge:
            return "validate"
        for s in reversed(STAGES):
            edge -= self.stage_seconds[s]
            if t > edge:
                return s
        return "between"


def dir_mb(path: Path) -> float | None:
    """Bytes under `path` (files only, links not followed), in MB; None when it does not exist."""
    if not path.is_dir():
        return None
    total = 0
    for root, _, files in os.walk(path):
        for f in files:
            try:
                total += os.lstat(os.path.join(root, f)).st_size
            except OSError:  # removed meanwhile (checkpoint rotation)
                continue
    return total / MB


class MetricsTail:
    """New complete lines of one metrics.jsonl since the last poll, as StepEnds timed by the file's mtime, each
    with the size of the run directory that holds the file at that moment."""

    def __init__(self, path: Path, arm: str):
        self.path, self.arm = path, arm
        self.offset = 0
        self.buf = ""

    def poll(self) -> list[StepEnd]:
        try:
            st = self.path.stat()
            with self.path.open() as f:
                f.seek(self.offset)
                chunk = f.read()
                self.offset = f.tell()
        except FileNotFoundError:
            return []
        self.buf += chunk
        *lines, self.buf = self.buf.split("\n")
        out = []
        for line in lines:
            try:
                rec = json.loads(line)
            except json.JSONDecodeError:
                continue
            if isinstance(rec, dict) and "step" in rec:
                out.append(StepEnd.from_record(self.arm, rec, min(st.st_mtime, time.time())))
        if out:
            out[-1].disk_mb = dir_mb(self.path.parent)
        return out


@dataclass
class Place:
    arm: str | None
    step: int | None  # None: after the last recorded step (final export, report, shutdown)
    stage: str | None  # a STAGES name, validate, between, setup; None for async steps and after the last step


def place(samples: Sequence[Sample], ends: Sequence[StepEnd]) -> list[Place]:
    """Each sample's step: the first step (in time) whose line had not appeared yet when it was taken; its stage
    from `StepEnd.stage_at`, and `setup` for the time before the first step's laid-back start."""
    order = sorted(ends, key=lambda e: e.end)
    out = []
    i = 0
    for s in sorted(samples, key=lambda x: x.t):
        while i < len(order) and order[i].end < s.t:
            i += 1
        if i == len(order):
            out.append(Place(None, None, None))
            continue
        e = order[i]
        stage = e.stage_at(s.t)
        if i == 0 and stage == "between":  # before the first step: model loading, step-0 validation
            stage = "setup"
        out.append(Place(e.arm, e.step, stage))
    return out


def step_records(samples: Sequence[Sample], ends: Sequence[StepEnd]) -> list[dict[str, Any]]:
    """One record per recorded step (in time order): peak tree RSS / PSS, peak RSS per role, peak tree RSS per
    stage (sync steps), and the fds and threads of the step's last sample."""
    samples = sorted(samples, key=lambda x: x.t)
    groups: dict[tuple[str, int], list[tuple[Sample, str | None]]] = {}
    for s, p in zip(samples, place(samples, ends), strict=True):
        if p.step is not None:
            groups.setdefault((p.arm, p.step), []).append((s, p.stage))
    out = []
    for e in sorted(ends, key=lambda x: x.end):
        got = groups.get((e.arm, e.step), [])
        rec: dict[str, Any] = {"arm": e.arm, "step": e.step, "samples": len(got), "disk_mb": e.disk_mb}
        if got:
            roles: dict[str, float] = {}
            stages: dict[str, float] = {}
            for s, stage in got:
                for r, v in s.role_rss().items():
                    roles[r] = max(roles.get(r, 0.0), v / MB)
                if stage is not None:
                    stages[stage] = max(stages.get(stage, 0.0), s.rss / MB)
            psss = [s.pss for s, _ in got if s.pss is not None]
            last = got[-1][0]
            rec.update(peak_rss_mb=max(s.rss for s, _ in got) / MB,
                       peak_pss_mb=max(psss) / MB if psss else None,
                       peak_rss_mb_per_role=dict(sorted(roles.items())), peak_rss_mb_per_stage=stages,
                       fds_end=last.fds, threads_end=last.threads)
        out.append(rec)
    return out


def growth(values: Sequence[float]) -> dict[str, Any]:
    """Least-squares slope of values against their index (per step), and max - min; None with fewer than 2."""
    n = len(values)
    if n < 2:
        return {"n": n, "slope_per_step": None, "spread": None}
    mx = (n - 1) / 2
    my = sum(values) / n
    sxx = sum((i - mx) ** 2 for i in range(n))
    slope = sum((i - mx) * (v - my) for i, v in enumerate(values)) / sxx
    return {"n": n, "slope_per_step": slope, "spread": max(values) - min(values)}


def growth_after_warmup(records: Sequence[dict[str, Any]], warmup: int) -> dict[str, dict[str, Any]]:
    """Per arm: `growth` of the peak tree RSS (MB/step) and of the fds at step end over the steps > warmup."""
    out = {}
    for arm in dict.fromkeys(r["arm"] for r in records):
        tail = sorted((r for r in records if r["arm"] == arm and r["step"] > warmup and r["samples"]),
                      key=lambda r: r["step"])
        out[arm] = {"steps": [tail[0]["step"], tail[-1]["step"]] if tail else None,
                    "rss_mb": growth([r["peak_rss_mb"] for r in tail]),
                    "fds": growth([float(r["fds_end"]) for r in tail]),
                    "disk_mb": growth([r["disk_mb"] for r in tail if r.get("disk_mb") is not None])}
    return out


def step_check(steps: Sequence[int], expected: int) -> dict[str, Any]:
    """Were steps 1..expected each recorded once? Lists the missing (lost) and repeated step numbers."""
    seen: dict[int, int] = {}
    for s in steps:
        seen[s] = seen.get(s, 0) + 1
    missing = [s for s in range(1, expected + 1) if s not in seen]
    repeated = sorted(s for s, c in seen.items() if c > 1)
    unexpected = sorted(s for s in seen if not 1 <= s <= expected)
    return {"recorded": len(steps), "expected": expected, "missing": missing, "repeated": repeated,
            "unexpected": unexpected, "complete": not (missing or repeated or unexpected)}


def summarize(samples: Sequence[Sample], ends: Sequence[StepEnd], warmup: int, expected: int,
              arms: Sequence[str]) -> dict[str, Any]:
    """Peaks (tree and per role, with the step and stage of the tree peak), growth after warm-up, the step check."""
    out: dict[str, Any] = {"samples": len(samples)}
    if samples:
        ordered = sorted(samples, key=lambda x: x.t)
        places = place(ordered, ends)
        k = max(range(len(ordered)), key=lambda i: ordered[i].rss)
        p = places[k]
        roles: dict[str, float] = {}
        for s in ordered:
            for r, v in s.role_rss().items():
                roles[r] = max(roles.get(r, 0.0), v / MB)
        out["peak"] = {"rss_mb": ordered[k].rss / MB, "arm": p.arm, "step": p.step,
                       "stage": p.stage if p.step is not None else "after the last step",
                       "rss_mb_per_role": dict(sorted(roles.items())),
                       "fds": max(s.fds for s in ordered), "threads": max(s.threads for s in ordered)}
    recs = step_records(samples, ends)
    out["growth_after_warmup"] = growth_after_warmup(recs, warmup)
    out["steps"] = {arm: step_check([e.step for e in ends if e.arm == arm], expected) for arm in arms}
    return out


# ---------------------------------------------------------------------------------------------------- the run
def _metrics_paths(run_dir: Path, compare: bool) -> dict[str, Path]:
    if compare:
        return {arm: run_dir / arm / "metrics.jsonl" for arm in ARMS_COMPARE}
    return {"run": run_dir / "metrics.jsonl"}


def measure(cmd: list[str], tails: Sequence[MetricsTail], interval: float, timeout: float | None,
            env: dict[str, str] | None = None) -> dict[str, Any]:
    """Run cmd, sample its tree and tail its metrics until it exits (or `timeout`, or Ctrl-C: the tree is
    killed). Returns samples, step ends, exit code, hang and interrupted flags, per-process peaks and leftover
    processes."""
    proc = subprocess.Popen(cmd, cwd=ROOT, env=env)
    sampler = TreeSampler(proc.pid)
    samples: list[Sample] = []
    ends: list[StepEnd] = []
    t0 = time.time()
    hang = interrupted = False
    try:
        while proc.poll() is None:
            s = sampler.sample()
            if s is not None:
                samples.append(s)
            for tail in tails:
                ends.extend(tail.poll())
            if timeout is not None and time.time() - t0 > timeout:
                hang = True
                break
            time.sleep(interval)
    except KeyboardInterrupt:
        interrupted = True
    finally:
        if proc.poll() is None:  # the root through Popen (a psutil wait would reap it and hide its exit code)
            proc.terminate()
            kill_tree([p for p in sampler.alive() if p.pid != proc.pid])
            try:
                proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                proc.kill()
        proc.wait()
    for tail in tails:
        ends.extend(tail.poll())
    deadline = time.time() + 10.0
    while sampler.alive() and time.time() < deadline:  # Ray's processes exit shortly after the driver
        time.sleep(0.5)
    left = sampler.alive()
    leftover = []
    for p in left:
        try:
            leftover.append({"pid": p.pid, "cmdline": " ".join(p.cmdline())[:200]})
        except Exception:  # noqa: BLE001 - gone meanwhile
            leftover.append({"pid": p.pid, "cmdline": "?"})
    if left:
        kill_tree(left)
    return {"samples": samples, "ends": ends, "returncode": proc.returncode, "hang": hang, "interrupted": interrupted,
            "wall_seconds": time.time() - t0, "processes": list(sampler.peaks.values()), "leftover": leftover}


def report_lines(summary: dict[str, Any], records: Sequence[dict[str, Any]], warmup: int) -> list[str]:
    lines = []
    for r in records:
        if not r["samples"]:
            lines.append(f"  {r['arm']} step {r['step']}: no sample (shorter than the interval)")
            continue
        roles = ", ".join(f"{k} {v:.0f}" for k, v in r["peak_rss_mb_per_role"].items())
        stages = ", ".join(f"{k} {v:.0f}" for k, v in r["peak_rss_mb_per_stage"].items())
        lines.append(f"  {r['arm']} step {r['step']}: peak RSS {r['peak_rss_mb']:.0f} MB ({roles})"
                     + (f"; per stage {stages}" if stages else "") + f"; fds {r['fds_end']}, threads "
                     f"{r['threads_end']}")
    pk = summary.get("peak")
    if pk:
        where = f"{pk['arm']} step {pk['step']}, stage {pk['stage']}" if pk["step"] is not None else \
            "after the last step's record (final checkpoint, export, report)"
        lines.append(f"peak tree RSS {pk['rss_mb']:.0f} MB at {where}; per role: "
                     + ", ".join(f"{k} {v:.0f} MB" for k, v in pk["rss_mb_per_role"].items())
                     + f"; peak fds {pk['fds']}, threads {pk['threads']}")
    for arm, g in summary["growth_after_warmup"].items():
        if g["steps"] is None or g["rss_mb"]["slope_per_step"] is None:
            lines.append(f"growth after warm-up ({arm}): fewer than 2 steps after step {warmup}")
            continue
        lines.append(f"growth after warm-up ({arm}, steps {g['steps'][0]}..{g['steps'][1]}): RSS "
                     f"{g['rss_mb']['slope_per_step']:+.2f} MB/step (spread {g['rss_mb']['spread']:.0f} MB), fds "
                     f"{g['fds']['slope_per_step']:+.2f}/step (spread {g['fds']['spread']:.0f})"
                     + (f", run dir on disk {g['disk_mb']['slope_per_step']:+.2f} MB/step (spread "
                        f"{g['disk_mb']['spread']:.0f} MB)" if g.get("disk_mb", {}).get("slope_per_step") is not None
                        else ""))
    for arm, c in summary["steps"].items():
        state = "every step recorded once" if c["complete"] else (
            f"LOST {c['missing']}" + (f", repeated {c['repeated']}" if c["repeated"] else "")
            + (f", unexpected {c['unexpected']}" if c["unexpected"] else ""))
        lines.append(f"steps ({arm}): {c['recorded']} of {c['expected']} recorded: {state}")
    run = summary["run"]
    lines.append(f"run: exit code {run['returncode']}" + (" (HUNG: killed at --timeout)" if run["hang"] else "")
                 + (" (interrupted: the tree was killed)" if run.get("interrupted") else "")
                 + f", {run['wall_seconds']:.0f} s" + (f", load processes {run['load']}" if run["load"] else "")
                 + (f"; LEFTOVER processes killed: {run['leftover']}" if run["leftover"] else
                    "; no process of the tree left behind"))
    return lines


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0],
                                 epilog="Removed at the end unless --keep-runs: the training run directory (--out, "
                                        "or the fresh one under runs/bench/); the --json file stays.")
    ap.add_argument("--config", default="examples/short.yaml")
    ap.add_argument("--set", dest="sets", action="append", default=[], metavar="KEY=VALUE",
                    help="passed to `specrl train --set` (repeatable)")
    ap.add_argument("--compare", action="store_true", help="pass --compare (autoregressive and speculative arms)")
    ap.add_argument("--interval", type=float, default=0.5, help="seconds between samples of the process tree")
    ap.add_argument("--warmup", type=int, default=10, help="steps left out of the growth statistics")
    ap.add_argument("--load", type=int, default=0, help="competing CPU-load processes during the run")
    ap.add_argument("--timeout", type=float, default=None, help="seconds; then the tree is killed (a hang)")
    ap.add_argument("--out", default=None, help="the run directory (default: a fresh one under runs/bench/)")
    ap.add_argument("--json", default=None, help="write the per-step records and the summary here")
    ap.add_argument("--keep-runs", action="store_true", help=KEEP_RUNS_HELP + ": here the run directory")
    a = ap.parse_args(argv)
    if a.interval <= 0 or a.load < 0 or a.warmup < 0 or (a.timeout is not None and a.timeout <= 0):
        ap.error("--interval and --timeout must be > 0, --load and --warmup >= 0")
    from specrl.trainer.config_check import load_config

    config = str(Path(a.config).resolve()) if Path(a.config).exists() else a.config
    cfg = load_config(config, a.sets)
    threads: int | str = cfg.run.threads
    if cfg.pipeline.mode == "async":
        threads = f"{cfg.pipeline.num_rollout_workers}x{cfg.pipeline.worker_threads} worker + " \
                  f"{cfg.pipeline.learner_threads} learner"
    hw = run_header(config_dtypes(config, a.sets), threads)
    arms = list(ARMS_COMPARE) if a.compare else ["run"]
    with run_dirs(a.keep_runs) as dirs:
        if a.out:
            run_dir = dirs.add(Path(a.out).resolve())
        else:
            (ROOT / "runs" / "bench").mkdir(parents=True, exist_ok=True)
            run_dir = dirs.add(Path(tempfile.mkdtemp(prefix="memory-", dir=ROOT / "runs" / "bench")))
        cmd = [sys.executable, "-m", "specrl.cli", "train", "--config", config, "--out", str(run_dir),
               *[x for s in a.sets for x in ("--set", s)], *(["--compare"] if a.compare else [])]
        tails = [MetricsTail(p, arm) for arm, p in _metrics_paths(run_dir, a.compare).items()]
        print(f"[memory] {' '.join(cmd[1:])}  (sampling every {a.interval} s"
              + (f", {a.load} load processes" if a.load else "") + ")", flush=True)
        with cpu_load(a.load):
            m = measure(cmd, tails, a.interval, a.timeout)
    records = step_records(m["samples"], m["ends"])
    summary = summarize(m["samples"], m["ends"], a.warmup, cfg.run.steps, arms)
    summary["run"] = {"returncode": m["returncode"], "hang": m["hang"], "interrupted": m["interrupted"],
                      "wall_seconds": m["wall_seconds"],
                      "leftover": m["leftover"], "load": a.load, "interval": a.interval, "warmup": a.warmup,
                      "pipeline": cfg.pipeline.mode, "compare": a.compare}
    lines = [f"hardware: {hardware_line(hw)}", *report_lines(summary, records, a.warmup)]
    print("\n".join(lines), flush=True)
    if a.json:
        Path(a.json).parent.mkdir(parents=True, exist_ok=True)
        doc = {"hardware": hw, "command": cmd[1:], "summary": summary, "steps": records,
               "processes": sorted(m["processes"], key=lambda p: -p["peak_rss_mb"])}
        Path(a.json).write_text(json.dumps(doc, indent=1) + "\n")
        print(f"[memory] wrote {a.json}", flush=True)
    ok = m["returncode"] == 0 and not (m["hang"] or m["interrupted"]) and \
        all(c["complete"] for c in summary["steps"].values())
    return 0 if ok else 1


def _sigterm(signum, frame) -> None:
    raise KeyboardInterrupt("SIGTERM")  # the same cleanup as Ctrl-C: tree and load processes killed


if __name__ == "__main__":
    signal.signal(signal.SIGTERM, _sigterm)
    sys.exit(main())

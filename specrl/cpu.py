"""How this process uses the CPU: how many torch threads (the cores other processes leave free), and glibc's
allocator kept from returning every large temporary to the kernel. Both engage only when the run's device is the
CPU (on CUDA the trainer starts no governor and the rollout workers leave glibc alone).

torch's OpenMP threads wait on each other at every parallel region, so one thread on a core that another job
holds stalls them all: far slower than its share of the CPU would explain (docs/benchmarks.md has the figures).
`ThreadGovernor` picks the thread count from a setting: an integer
(used as given, at most the cores this process may run on) or "auto", the cores the rest of the machine leaves
free, read from /proc/stat (and at most OMP_NUM_THREADS when that is set). `update()` between training steps
re-reads what other processes used since the last reading (all busy CPU time minus this process's own) and
changes the count when that moved, so a job started mid-run costs its share of the CPU, not a collapse. A long
job outside the training loop (a drafter build, `prepare`, `draft init`, `generate`) activates its governor, and
the loops that do its work (the rollout engine's decode loop, drafter training's batches) call `tick()`, which
re-reads at most every `REREAD_SECONDS`: one noisy reading at start no longer fixes the count for an hour.

`keep_large_allocations()`, for generation-only processes (async rollout workers, benchmarks): glibc serves
allocations above its mmap threshold with fresh pages from the kernel and unmaps them on free, so every decode
step's full-vocabulary temporaries ([B, V] float64 CDFs) page-fault again on first touch (benchmarks/allocator.py
measures it). A fixed 32 MiB threshold keeps them in the heap for reuse. In a process that also trains it slowed the
learner's stages by more than it sped generation up (docs/benchmarks.md), so the sync trainer leaves glibc as it is.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import functools
import logging
import math
import os
import time
from dataclasses import dataclass

import torch

from specrl.errors import SpecRLError

log = logging.getLogger(__name__)

REREAD_SECONDS = 5.0  # an active governor re-reads /proc/stat at most this often from tick()
FREE_IF_IDLE = 0.75  # a core counts as free when others leave at least this much of it idle


_M_TRIM_THRESHOLD, _M_MMAP_THRESHOLD = -1, -3  # glibc mallopt parameters
MMAP_THRESHOLD = 32 * 2**20  # glibc's largest allowed value on 64-bit
_tuned: bool | None = None


def keep_large_allocations() -> bool:
    """Process-wide, once: glibc keeps allocations up to 32 MiB in its heap (and trims it only past 256 MiB free)
    instead of mapping and unmapping each one. Returns whether the setting is in effect (False off glibc)."""
    global _tuned
    if _tuned is None:
        _tuned = False
        try:
            libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
            _tuned = bool(libc.mallopt(_M_MMAP_THRESHOLD, MMAP_THRESHOLD)) and \
                bool(libc.mallopt(_M_TRIM_THRESHOLD, 8 * MMAP_THRESHOLD))
        except (OSError, AttributeError):  # not glibc
            pass
    return _tuned


def release_free_memory() -> bool:
    """Return the allocator's free pages to the kernel (glibc `malloc_trim(0)`: every arena, free pages inside the
    heap too); True where it ran (glibc), False elsewhere.

    A training step frees most of what it allocated (activations, the [rows, V] log-prob temporaries, the engine's
    per-step buffers), but glibc keeps freed chunks below its mmap threshold in its arenas, so a process's RSS grows
    to the high-water mark of every stage it runs and stays there: two learners in one process (a compare run) each
    kept the other's peak resident. The learner calls this once per step, after the update, where the live set is
    smallest; it costs tens of milliseconds (`benchmarks/memory.py` shows the RSS it returns)."""
    trim = _malloc_trim()
    if trim is None:
        return False
    trim(0)
    return True


@functools.cache
def _malloc_trim():
    """glibc's `malloc_trim`, looked up once; None where the C library has none."""
    try:
        return ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6").malloc_trim
    except (OSError, AttributeError):  # not glibc
        return None


def allowed_cores() -> int:
    """The CPUs this process may run on (its affinity mask)."""
    try:
        return len(os.sched_getaffinity(0))
    except (AttributeError, OSError):  # not Linux
        return os.cpu_count() or 1


def omp_cap() -> int | None:
    """OMP_NUM_THREADS as an integer >= 1, or None when unset or not a plain count."""
    try:
        n = int(os.environ.get("OMP_NUM_THREADS", ""))
    except ValueError:
        return None
    return n if n >= 1 else None


def _busy_seconds() -> float | None:
    """Busy CPU seconds of the whole machine since boot (all CPUs; /proc/stat), or None where unreadable."""
    try:
        with open("/proc/stat") as f:
            fields = f.readline().split()
    except OSError:
        return None
    if not fields or fields[0] != "cpu":
        return None
    ticks = [int(x) for x in fields[1:9]]  # user nice system idle iowait irq softirq steal
    busy = sum(ticks) - ticks[3] - ticks[4]
    return busy / os.sysconf("SC_CLK_TCK")


def _own_seconds() -> float:
    t = os.times()
    return t.user + t.system


@dataclass
class _Reading:
    wall: float
    busy: float
    own: float


def parse_threads(value: object, key: str) -> int | str:
    """An integer >= 1 or "auto"; anything else is an error naming `key`."""
    if value == "auto":
        return "auto"
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise SpecRLError(f"{key} must be an integer >= 1 or 'auto' (the cores other processes leave free), "
                          f"got {value!r}")
    return value


class ThreadGovernor:
    """Sets torch's thread count from `setting` (int or "auto") now, and again on `update()` for "auto"."""

    def __init__(self, setting: int | str = "auto", key: str = "threads", sample_seconds: float = 0.2):
        self.setting = parse_threads(setting, key)
        self.cores = allowed_cores()
        if isinstance(self.setting, int) and self.setting > self.cores:
            raise SpecRLError(f"{key}={self.setting} but this process may run on {self.cores} cores "
                              f"(sched_getaffinity); more threads than cores stall each other: use at most "
                              f"{self.cores}, or 'auto'")
        self.others = 0.0  # cores' worth of CPU other processes used over the last reading
        self._last = self._read()
        if self.setting == "auto" and self._last is not None and sample_seconds > 0:
            time.sleep(sample_seconds)  # nothing of ours runs yet: what is busy now is someone else
            self._measure()
        self.threads = self._choose()
        torch.set_num_threads(self.threads)

    @staticmethod
    def _read() -> _Reading | None:
        busy = _busy_seconds()
        return None if busy is None else _Reading(time.monotonic(), busy, _own_seconds())

    def _measure(self) -> None:
        now = self._read()
        if now is None or self._last is None:
            return
        wall = now.wall - self._last.wall
        if wall > 0:
            others = (now.busy - self._last.busy) - (now.own - self._last.own)
            self.others = min(max(others / wall, 0.0), float(self.cores))
        self._last = now

    def _choose(self) -> int:
        if isinstance(self.setting, int):
            return self.setting
        free = self.cores - self.others
        return max(1, min(self.cores, omp_cap() or self.cores, math.floor(free + (1.0 - FREE_IF_IDLE))))

    def update(self) -> int:
        """Re-read what other processes used since the last call; for "auto", follow it. Returns the count."""
        if self.setting != "auto":
            return self.threads
        self._measure()
        n = self._choose()
        if n != self.threads:
            log.info("torch threads %d -> %d (other processes use %.1f of %d cores)", self.threads, n,
                     self.others, self.cores)
            self.threads = n
            torch.set_num_threads(n)
        return self.threads

    def maybe_update(self, interval: float = REREAD_SECONDS) -> int:
        """`update()` when at least `interval` seconds passed since the last reading; else the current count."""
        if self.setting == "auto" and self._last is not None and time.monotonic() - self._last.wall >= interval:
            return self.update()
        return self.threads

    def activate(self) -> ThreadGovernor:
        """Make this the governor `tick()` re-reads (one per process; a later activation replaces it)."""
        global _active
        _active = self
        return self

    def describe(self) -> str:
        if self.setting == "auto":
            return f"{self.threads} (auto: other processes use {self.others:.1f} of {self.cores} cores)"
        return f"{self.threads} (set)"


_active: ThreadGovernor | None = None


def tick() -> None:
    """From inside long loops: let the active governor (if any) follow the machine's load. Costs a clock read."""
    g = _active
    if g is not None:
        g.maybe_update()


def deactivate() -> None:
    """No governor re-reads from `tick()` any more (the thread count stays where it is)."""
    global _active
    _active = None

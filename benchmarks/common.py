"""Shared benchmark helpers: hardware header, prompt set, a median-of-interleaved-runs timer, run-dir cleanup.

Every benchmark calls `run_header(dtypes, threads)` once at start: it prints one `[bench] hardware: ...` line and
returns the record (`specrl.device.hardware_record()` plus threads and dtypes) that the script stores under
`"hardware"` in its JSON, and `hardware_line(rec)` is the same line for a markdown table's header. Only torch and
`specrl.device` are imported here at load, so the scripts that run in the vLLM venv (`backends.py`) can use it.
`run_dirs(keep)` is how a script that creates training run directories (or checkpoint directories) removes them
when it finishes, unless its `--keep-runs` was given: the results it writes elsewhere stay.
"""

from __future__ import annotations

import os
import shutil
import statistics
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any, TextIO

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")


DTYPES = ("auto", "float32", "bfloat16")  # a benchmark's --dtype choices (auto: specrl.device.resolve_dtype)


def hardware_line(rec: dict[str, Any]) -> str:
    """`processor AVX512-BF16, 2 cores, threads 1, dtypes rollout=bfloat16 train=fp32` for a record of run_header."""
    dtypes = " ".join(f"{k}={v}" for k, v in rec.get("dtypes", {}).items()) or "none"
    gpu = f", gpu {rec['gpu']}" if rec.get("gpu") else ""
    from specrl.device import class_label

    cls = class_label(rec["processor_class"], rec.get("isa_limit"), rec.get("cpu_flags_class"))
    return (f"processor {cls}, {rec['cpu_cores']} cores, threads {rec.get('threads')}, "
            f"dtypes {dtypes}{gpu}")


def run_header(dtypes: dict[str, str], threads: int | str | None = None, device: str = "cpu",
               file: TextIO | None = None) -> dict[str, Any]:
    """Print `[bench] hardware: ...` and return {**hardware_record(device), "threads", "dtypes"}.

    `dtypes` names what the script computes in (e.g. {"rollout": "bfloat16", "train": "fp32"}; {} where none
    applies); `threads` is what the script runs with (None: this process's torch threads). `file` defaults to
    stdout (a script whose stdout is pure JSON passes sys.stderr).
    """
    import torch

    from specrl.device import hardware_record

    rec = {**hardware_record(device), "threads": torch.get_num_threads() if threads is None else threads,
           "dtypes": {str(k): str(v) for k, v in dtypes.items()}}
    print(f"[bench] hardware: {hardware_line(rec)}", file=file or sys.stdout, flush=True)
    return rec


def dtype_name(spec: str, device: str = "cpu", key: str = "--dtype") -> str:
    """A benchmark's --dtype (auto | float32 | bfloat16) resolved like the library resolves it."""
    from specrl.device import resolve_dtype

    return resolve_dtype(spec, device, key)


def config_dtypes(config: str | None, sets: list[str] | None = None) -> dict[str, str]:
    """The dtypes a `specrl train` run of this config (with these --set overrides) resolves to on this machine:
    model (policy weights), rollout (native engine), train (policy.precision) and, for the vLLM backend, vllm."""
    from specrl.config.hardware import resolve_hardware
    from specrl.trainer.config_check import load_config

    cfg = resolve_hardware(load_config(config, sets))
    out = {"model": cfg.model.dtype, "rollout": cfg.model.rollout_dtype, "train": cfg.policy.precision}
    if cfg.rollout.backend == "vllm":
        out["vllm"] = cfg.rollout.vllm.dtype
    return out


def parse_candidate(spec: str) -> tuple[str, list[str]]:
    """A `--candidate` of the scripts that compare configs: `name:key=value,key=value` -> (name, ["key=value",
    ...]); `name:` is the config as it is."""
    name, sep, rest = spec.partition(":")
    if not sep or not name:
        raise SystemExit(f"--candidate {spec!r}: expected NAME:KEY=VALUE[,KEY=VALUE...] (or NAME: for the config "
                         "as it is)")
    sets = [s for s in rest.split(",") if s]
    bad = [s for s in sets if "=" not in s]
    if bad:
        raise SystemExit(f"--candidate {spec!r}: {bad[0]!r} is not KEY=VALUE (expected NAME:KEY=VALUE[,KEY=VALUE...])")
    return name, sets


def prompt_ids(tok, batch_size: int) -> list[list[int]]:
    from specrl.cli.training import DEMO_PROMPTS  # one prompt set for the demo and benchmarks
    from specrl.model.tokenizer import encode_chat

    base = [encode_chat(tok, p) for p in DEMO_PROMPTS]
    return [base[i % len(base)] for i in range(batch_size)]


def timed(fn) -> tuple[float, object]:
    t = time.perf_counter()
    out = fn()
    return time.perf_counter() - t, out


def median(xs: list[float]) -> float:
    return statistics.median(xs)


KEEP_RUNS_HELP = "keep the run directories this script creates (by default they are removed when it finishes)"


class RunDirs:
    """The run directories a benchmark created; `add(path)` collects one and returns it as a Path."""

    def __init__(self, keep: bool):
        self.keep = keep
        self.paths: list[Path] = []

    def add(self, path: str | Path) -> Path:
        p = Path(path)
        if p not in self.paths:
            self.paths.append(p)
        return p


@contextmanager
def run_dirs(keep: bool, file: TextIO | None = None) -> Iterator[RunDirs]:
    """Collect run directories (`dirs.add(path)`); on leaving — normally or by an exception — remove each one that
    exists, unless `keep`. Prints one `[bench] removed ...` / `[bench] kept ...` line naming them."""
    dirs = RunDirs(keep)
    try:
        yield dirs
    finally:
        present = [p for p in dirs.paths if p.exists()]
        if present:
            if keep:
                print(f"[bench] kept run directories (--keep-runs): {', '.join(map(str, present))}",
                      file=file or sys.stdout, flush=True)
            else:
                for p in present:
                    if p.is_dir() and not p.is_symlink():
                        shutil.rmtree(p, ignore_errors=True)
                    else:
                        p.unlink(missing_ok=True)
                print(f"[bench] removed run directories (pass --keep-runs to keep them): "
                      f"{', '.join(map(str, present))}", file=file or sys.stdout, flush=True)

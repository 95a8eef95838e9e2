"""Per-step metrics: the `metrics.jsonl` contract, TensorBoard scalars and the live terminal display.

`STEP_FIELDS` is the list of keys every line of `metrics.jsonl` carries
(`specrl.observability.step_record.StepRecord` is
the record's type; `read_records` reads a file into it). `MetricsWriter`
appends one JSON line per step (flushed, so a killed run keeps every finished step), mirrors numeric values
to TensorBoard (nested dicts become `stage_seconds/gen`, lists become `acceptance_rate_per_position/0`), and
on resume drops lines past the checkpointed step so the file never holds a step twice. `ProgressDisplay`
shows step, reward, accuracy, a stage-time bar and acceptance length: a rich live panel on a terminal, one
plain line per step otherwise.
"""

from __future__ import annotations

import json
import math
import os
import sys
from pathlib import Path
from typing import Any

from specrl.observability.step_record import STEP_FIELDS, StepRecord, to_record

__all__ = ["STAGES", "STEP_FIELDS", "TRACE_FIELDS", "MetricsWriter", "ProgressDisplay", "read_jsonl", "stage_bar"]

STAGES = ("data", "prepare", "gen", "logprob", "train")


# Per-sequence / per-engine-step lists kept in metrics.jsonl for the report's pictures, not mirrored as scalars.
TRACE_FIELDS = ("response_lengths", "batch_trace")


def _clean(value: Any) -> Any:
    """JSON-safe: non-finite floats become None, tuples become lists, numpy/torch scalars become floats."""
    if isinstance(value, dict):
        return {str(k): _clean(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [_clean(v) for v in value]
    if isinstance(value, bool) or value is None or isinstance(value, str | int):
        return value
    try:
        f = float(value)
    except (TypeError, ValueError):
        return str(value)
    return f if math.isfinite(f) else None


def read_jsonl(path: str | Path) -> list[dict]:
    """Every JSON line of a JSONL file as a mapping (a torn last line from a killed run is ignored); step records
    as `StepRecord`s: `specrl.observability.step_record.read_records`."""
    p = Path(path)
    if not p.exists():
        return []
    out = []
    for line in p.read_text().splitlines():
        if not line.strip():
            continue
        try:
            out.append(json.loads(line))
        except json.JSONDecodeError:
            continue
    return out


def _flatten(prefix: str, value: Any, out: dict[str, float]) -> None:
    if isinstance(value, dict):
        for k, v in value.items():
            _flatten(f"{prefix}/{k}", v, out)
    elif isinstance(value, list):
        for i, v in enumerate(value):
            _flatten(f"{prefix}/{i}", v, out)
    elif isinstance(value, int | float) and not isinstance(value, bool) and math.isfinite(value):
        out[prefix] = float(value)


LOGGERS = ("wandb", "mlflow")


class _WandbLogger:
    """Weights & Biases, offline unless WANDB_MODE says otherwise: runs land in RUN/wandb (`wandb sync` uploads)."""

    def __init__(self, run_dir: Path, name: str, config: dict | None, resume: bool):
        os.environ.setdefault("WANDB_MODE", "offline")
        import wandb

        self.run = wandb.init(project="specrl", name=name, dir=str(run_dir), config=config or {},
                              mode=os.environ["WANDB_MODE"], resume="allow" if resume else None)

    def log(self, flat: dict[str, float], step: int) -> None:
        self.run.log(flat, step=step)

    def close(self) -> None:
        self.run.finish()


class _MlflowLogger:
    """MLflow into a local file store RUN/mlruns (unless MLFLOW_TRACKING_URI points elsewhere)."""

    def __init__(self, run_dir: Path, name: str, config: dict | None, resume: bool):
        import mlflow

        if "MLFLOW_TRACKING_URI" not in os.environ:
            os.environ.setdefault("MLFLOW_ALLOW_FILE_STORE", "true")  # the local file store is the point here
            mlflow.set_tracking_uri((run_dir / "mlruns").resolve().as_uri())
        self.mlflow = mlflow
        self.mlflow.start_run(run_name=name)
        if config:
            params = {}
            _flatten_params("", config, params)
            self.mlflow.log_params(params)

    def log(self, flat: dict[str, float], step: int) -> None:
        self.mlflow.log_metrics(flat, step=step)

    def close(self) -> None:
        self.mlflow.end_run()


def _flatten_params(prefix: str, value: Any, out: dict[str, str]) -> None:
    if isinstance(value, dict):
        for k, v in value.items():
            _flatten_params(f"{prefix}{k}.", v, out)
    else:
        out[prefix.rstrip(".")] = str(value)[:500]


class MetricsWriter:
    """Appends step records to `metrics.jsonl` and mirrors their numbers to TensorBoard and the optional loggers
    (W&B offline, MLflow's local file store) under the run directory, with the same metric names everywhere."""

    def __init__(self, run_dir: str | Path, tensorboard: bool = True, resume_step: int | None = None,
                 filename: str = "metrics.jsonl", loggers: tuple[str, ...] | list[str] = (), name: str = "run",
                 config: dict | None = None):
        self.run_dir = Path(run_dir)
        self.path = self.run_dir / filename
        self.run_dir.mkdir(parents=True, exist_ok=True)
        if resume_step is not None:
            kept = [r for r in read_jsonl(self.path) if int(r.get("step", 0)) <= resume_step]
            self.path.write_text("".join(json.dumps(r) + "\n" for r in kept))
        elif self.path.exists():
            self.path.unlink()
        self._tb = None
        if tensorboard:
            from torch.utils.tensorboard import SummaryWriter

            self._tb = SummaryWriter(log_dir=str(self.run_dir / "tensorboard"),
                                     purge_step=(resume_step + 1) if resume_step is not None else None)
        unknown = [x for x in loggers if x not in LOGGERS]
        if unknown:
            raise ValueError(f"unknown loggers {unknown}; use any of {list(LOGGERS)}")
        kinds = {"wandb": _WandbLogger, "mlflow": _MlflowLogger}
        self._loggers = [kinds[x](self.run_dir, name, config, resume_step is not None) for x in loggers]

    def write(self, record: StepRecord | dict[str, Any]) -> None:
        """Append `record` (a StepRecord, or a mapping with at least STEP_FIELDS) as one line with its schema
        version."""
        rec = to_record(record, require=True)
        clean = _clean(rec.to_json())
        with self.path.open("a") as f:
            f.write(json.dumps(clean) + "\n")
            f.flush()
        if self._tb is None and not self._loggers:
            return
        flat: dict[str, float] = {}
        for k, v in clean.items():
            if k not in ("step", "schema_version") and k not in TRACE_FIELDS:
                _flatten(k, v, flat)
        step = int(rec.step)
        if self._tb is not None:
            for k, v in flat.items():
                self._tb.add_scalar(k, v, global_step=step)
            self._tb.flush()
        for logger in self._loggers:
            logger.log(flat, step)

    def close(self) -> None:
        if self._tb is not None:
            self._tb.close()
            self._tb = None
        for logger in self._loggers:
            logger.close()
        self._loggers = []


_STAGE_STYLE = {"data": "cyan", "prepare": "magenta", "gen": "green", "logprob": "yellow", "train": "red"}
_STAGE_CHAR = {"data": "d", "prepare": "p", "gen": "g", "logprob": "l", "train": "t"}


def stage_bar(stage_seconds: dict[str, float], width: int = 40) -> str:
    """Plain-text stage bar: one letter per stage, each run proportional to the stage's share of the step."""
    total = sum(stage_seconds.get(s, 0.0) for s in STAGES) or 1.0
    out = ""
    for s in STAGES:
        out += _STAGE_CHAR[s] * round(width * stage_seconds.get(s, 0.0) / total)
    return out


def _fmt(v: Any, spec: str = ".3f") -> str:
    return "-" if v is None else format(v, spec)


class ProgressDisplay:
    """Live view of the run: a rich panel on a terminal, a plain line per step elsewhere (logs, CI)."""

    def __init__(self, total_steps: int, enabled: bool = True, title: str = "specrl train",
                 live: bool | None = None):
        self.total = total_steps
        self.enabled = enabled
        self.title = title
        self._live = None
        self._console = None
        if enabled and (sys.stdout.isatty() if live is None else live):
            from rich.console import Console
            from rich.live import Live

            self._console = Console()
            self._live = Live(console=self._console, refresh_per_second=4, transient=False)
            self._live.start()

    def _renderable(self, r: dict) -> Any:
        from rich.table import Table
        from rich.text import Text

        t = Table.grid(padding=(0, 2))
        t.add_row("step", f"{r['step']}/{self.total}", "reward", f"{_fmt(r.get('reward_mean'))}",
                  "accuracy", _fmt(r.get("accuracy")))
        bar = Text()
        total = sum(r["stage_seconds"].values()) or 1.0
        for s in STAGES:
            sec = r["stage_seconds"].get(s, 0.0)
            bar.append("█" * round(40 * sec / total), style=_STAGE_STYLE[s])
        legend = " ".join(f"[{_STAGE_STYLE[s]}]{s}[/] " + ("in train" if s == "logprob" and r.get("logprob_skipped")
                                                            else f"{r['stage_seconds'].get(s, 0):.1f}s")
                          for s in STAGES)
        t.add_row("stages", bar, "step s", f"{r['step_seconds']:.1f}", "gen share",
                  _fmt(r.get("gen_share"), ".2f"))
        t.add_row("", Text.from_markup(legend), "accept len", _fmt(r.get("acceptance_length"), ".2f"),
                  "gen tok/s", _fmt(r.get("gen_tokens_per_second"), ".0f"))
        return t

    def line(self, r: dict, label: str = "") -> str:
        return (f"{label}step {r['step']}/{self.total}  reward {_fmt(r.get('reward_mean'))}  "
                f"acc {_fmt(r.get('accuracy'))}  len {_fmt(r.get('response_length_mean'), '.1f')}  "
                f"[{stage_bar(r['stage_seconds'], 30)}] {r['step_seconds']:.1f}s  "
                f"gen {_fmt(r.get('gen_share'), '.2f')}  AL {_fmt(r.get('acceptance_length'), '.2f')}")

    def update(self, record: dict, label: str = "") -> None:
        if not self.enabled:
            return
        if self._live is not None:
            self._live.update(self._renderable(record))
        else:
            print(self.line(record, label), flush=True)

    def message(self, text: str) -> None:
        if self._console is not None:
            self._console.print(text)
        elif self.enabled:
            print(text, flush=True)

    def close(self) -> None:
        if self._live is not None:
            self._live.stop()
            self._live = None

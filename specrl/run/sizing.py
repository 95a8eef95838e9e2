"""Per-step work sized to this machine's measured speed, so a time-budgeted compare runs at least `run.min_steps` steps.

`make run` has a fixed wall-clock budget for its steps (`run.time_budget_minutes`), and one for the whole command
(`run.wall_budget_minutes`, below); the lesser of the first and what is left of the second is the budget
planned with. With `run.min_steps` set, `size_run` picks the largest rung of `LADDER` (fractions of the config's
`generation.max_new_tokens` and `task.val_size`) whose predicted time fits the budget: the validations (step 0 once,
shared by both arms, which hold the same weights then; the end in each arm: `VALIDATIONS` validations of both arms'
worth) plus `min_steps` pairs of steps. Seconds per class do not predict a step: two 2-core machines of one class ran
the same plain decode step 2.5x apart (a shared host's memory bandwidth). So the prediction is in units of this
machine's plain decode step, measured at start-up (`specrl.run.speed_probe`): the pair of steps, its generation share
R and the validations of the main job at the reference work, each measured on a class as seconds and divided by the
probe's step on the same machine (`COSTS`; the runs are in docs/results.md). A pair's generation scales with the
response cap and the rest of the step is held fixed (a bound: training shrinks too):
pair(f) = pair * (R * f + 1 - R); a greedy validation is generation only and scales with the cap and the question
count. A class without its own measured units (another architecture) is planned with the measured class whose units
ask the most of a probe step. The plan is not a promise: the run's budget check still stops before a step that would
end past the budget. Both arms run the same sized config, so neither is handicapped. A CUDA device is not sized.
The result (`sizing.json` beside the run's config, and compare.json's `sizing`) says what was sized, from what, why.

The whole command's wall clock (`run.wall_budget_minutes`): `wall_deadline(cfg, start)` is the epoch second by which
a run's steps (with its final validation) must end so that the command, set-up and certificate included, ends within
the budget. The clock starts at SPECRL_WALL_START (epoch seconds, `date +%s`; `make run` sets it before it builds the
venv) or, unset, when `specrl.run.loop.train_main` began (the caller passes the start on). The certificate is kept
out of it as CERTIFICATE_OVERRUN times its seconds budget, since it is estimated at the run's own generation speed
and took 1.5x that on an AVX2-only EPYC (docs/results.md), and the report, figures and exit as TAIL_SECONDS. Sizing
plans with what is left, and `specrl.run.session.Budget` stops before a step that would end past the deadline.
"""

from __future__ import annotations

import json
import os
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from specrl.errors import SpecRLError

MARGIN = 0.90  # plan within 90% of the budget: the probe's mean scatters by ~9% on a shared host (docs/results.md);
# the run still stops before a step that would pass the budget
WALL_FLOOR_MINUTES = 0.01  # a wall budget already spent plans the smallest rung (the first step still runs)
VALIDATIONS = 1.5  # three single-arm validations (step 0 shared, the end in both arms), in units of both arms' one


@dataclass(frozen=True)
class ClassCost:
    """The main job at the reference work (`REFERENCE`) on a 2-core CPU of a class, in plain decode steps of the
    start-up probe on the same machine: one pair of steps (autoregressive + speculative), its generation share, and
    the validation of both arms."""

    pair_steps: float
    gen_share: float
    validation_steps: float
    source: str


REFERENCE = {"max_new_tokens": 256, "val_size": 16}
# Each class: 4 pairs of the main job's steps at the reference work, their mean seconds, the autoregressive arm's
# generation share, one validation of both arms (the mean of step 0's and the end's, each run in both arms when
# measured; a compare shares step 0's, so it counts twice), and the mean of six probe readings on the same machine
# (three before the run, three after), quiet, 2 threads (the command is in docs/results.md, "Steps enough").
# AVX512-BF16 and AVX2 were measured on the AMX machine limited by the environment (`specrl.device.isa_limit`): bf16
# on AVX512-BF16 kernels, and fp32 rollouts and training on AVX2 kernels, what `auto` resolves to on each class.
# AVX512 (no bf16 units: fp32 rollouts and training) was measured on a real CPU of the class.
COSTS: dict[str, ClassCost] = {
    "AMX": ClassCost(54.2 / 0.0499, 0.63, 58.1 / 0.0499,
                     "the main job at 256 new tokens and 16 validation questions on a 2-core Intel Xeon with AMX, "
                     "bf16 (docs/results.md)"),
    "AVX512-BF16": ClassCost(65.7 / 0.0643, 0.53, 63.2 / 0.0643,
                             "the main job at 256 new tokens and 16 validation questions, bf16, on a 2-core Intel "
                             "Xeon limited to AVX512-BF16 (no AMX) by ONEDNN_MAX_CPU_ISA (docs/results.md)"),
    "AVX512": ClassCost(86.04 / 0.0720, 0.60, 90.76 / 0.0720,
                        "the main job at 256 new tokens and 16 validation questions, fp32, on a 2-core Intel Xeon "
                        "with AVX512 and no bf16 units (docs/results.md)"),
    "AVX2": ClassCost(62.2 / 0.0794, 0.59, 69.65 / 0.0794,
                      "the main job at 256 new tokens and 16 validation questions, fp32, on a 2-core Intel Xeon "
                      "limited to AVX2 by ONEDNN_MAX_CPU_ISA, ATEN_CPU_CAPABILITY and MKL_ENABLE_INSTRUCTIONS "
                      "(docs/results.md)"),
}
# (fraction of generation.max_new_tokens, fraction of task.val_size), most work first
LADDER: tuple[tuple[float, float], ...] = ((1.0, 1.0), (0.875, 1.0), (0.75, 1.0), (0.75, 0.75), (0.75, 0.5),
                                           (0.625, 0.5), (0.5, 0.5), (0.375, 0.5))


def _fallback() -> str:
    """The measured class whose units predict the longest reference run for one probe step: a class without units
    of its own (another architecture) is planned with the least work per probe step any class has needed."""
    return max(COSTS, key=lambda c: predict_seconds(COSTS[c], 1.0, 1.0, 1.0, 6))


def predict_seconds(cost: ClassCost, step_seconds: float, token_fraction: float, val_fraction: float,
                    steps: int) -> float:
    """The validations (`VALIDATIONS` of both arms' worth) plus `steps` pairs of steps, at the given fractions of the
    reference work, on a machine whose plain decode step takes `step_seconds`."""
    pair = cost.pair_steps * (cost.gen_share * token_fraction + 1.0 - cost.gen_share)
    return step_seconds * (VALIDATIONS * cost.validation_steps * token_fraction * val_fraction + steps * pair)


def size_run(processor: str, budget_minutes: float, min_steps: int, max_new_tokens: int, val_size: int,
             step_seconds: float | None, device: str = "cpu") -> dict[str, Any]:
    """The sizing decision (a JSON-able dict): the chosen `max_new_tokens` and `val_size`, the class, units and
    probe it used, the predicted seconds, and `reason`. Pure: the same inputs give the same answer on any machine.
    `step_seconds` is the probe's plain decode step on this machine (None only where nothing is sized: CUDA)."""
    if min_steps < 1 or budget_minutes <= 0 or max_new_tokens < 1 or val_size < 0:
        raise SpecRLError(f"sizing needs min_steps >= 1, a positive budget, max_new_tokens >= 1 and val_size >= 0, "
                          f"got {min_steps}, {budget_minutes}, {max_new_tokens}, {val_size}")
    out: dict[str, Any] = {"processor_class": processor, "device": device, "min_steps": min_steps,
                           "budget_seconds": budget_minutes * 60.0, "configured": {"max_new_tokens": max_new_tokens,
                                                                                  "val_size": val_size}}
    if device.startswith("cuda"):
        return {**out, "sized": False, "max_new_tokens": max_new_tokens, "val_size": val_size,
                "reason": "not sized: the units are measured on CPUs only"}
    if step_seconds is None or not step_seconds > 0:
        raise SpecRLError(f"sizing needs this machine's plain decode step in seconds (> 0), got {step_seconds!r}")
    cls = processor if processor in COSTS else FALLBACK
    cost = COSTS[cls]
    base_tok = max_new_tokens / REFERENCE["max_new_tokens"]
    base_val = val_size / REFERENCE["val_size"]
    plan = budget_minutes * 60.0 * MARGIN
    out.update(cost_class=cls, cost=asdict(cost), margin=MARGIN, step_seconds=step_seconds)
    for i, (ft, fv) in enumerate(LADDER):
        tokens, vals = max(1, round(max_new_tokens * ft)), round(val_size * fv)
        secs = predict_seconds(cost, step_seconds, base_tok * ft, base_val * fv, min_steps)
        if secs <= plan or i == len(LADDER) - 1:
            fits = secs <= plan
            on = f"a plain decode step of {step_seconds * 1e3:.0f} ms measured here, in {cls} units"
            why = (f"{min_steps} steps per arm plus the validations (step 0 shared, the end in each arm) are "
                   f"predicted to take {secs:.0f} s "
                   f"({on}) at {tokens} new tokens and {vals} validation questions, within {MARGIN:.0%} of the "
                   f"{budget_minutes:.3g}-minute budget" if fits else
                   f"even the smallest rung ({tokens} new tokens, {vals} questions) is predicted at {secs:.0f} s "
                   f"({on}), past {MARGIN:.0%} of the {budget_minutes:.3g}-minute budget: fewer steps will run")
            if i == 0:
                why = "full work: " + why
            if cls != processor:
                why += f" (no units measured on {processor}: {cls}'s are used)"
            return {**out, "sized": i > 0, "fits": fits, "rung": i, "max_new_tokens": tokens, "val_size": vals,
                    "predicted_seconds": secs, "reason": why}
    raise AssertionError("unreachable: the last rung always returns")


FALLBACK = _fallback()


# The whole command's wall clock (run.wall_budget_minutes)
WALL_START_ENV = "SPECRL_WALL_START"
CERTIFICATE_OVERRUN = 2.0  # the certificate's reserve, in its seconds budgets (an estimate that ran 1.5x on AVX2)
TAIL_SECONDS = 30.0  # the report, figures and exit after the certificate
STALE_SECONDS = 24 * 3600.0  # a start older than this is a variable left over from another command


def wall_start(now: float | None = None) -> float:
    """SPECRL_WALL_START as epoch seconds, checked; `now` (default: this moment) where it is unset."""
    now = time.time() if now is None else now
    raw = os.environ.get(WALL_START_ENV)
    if raw is None or not raw.strip():
        return now
    try:
        start = float(raw)
    except ValueError:
        raise SpecRLError(f"{WALL_START_ENV}={raw!r} is not a time: set it to the epoch second the command started "
                          f"(`{WALL_START_ENV}=$(date +%s)`), or unset it to count from the run's start") from None
    if not now - STALE_SECONDS <= start <= now + 1.0:
        raise SpecRLError(f"{WALL_START_ENV}={raw} is {start - now:+.0f} s from now, not the start of this command: "
                          f"set it to the epoch second the command started (`{WALL_START_ENV}=$(date +%s)`), or "
                          "unset it")
    return start


def wall_deadline(cfg: Any, start: float) -> float | None:
    """The epoch second the steps must end by under `run.wall_budget_minutes` (None without one), for a command
    that started at `start` (`wall_start()`)."""
    r = cfg.run
    if r.wall_budget_minutes is None:
        return None
    # the config refuses a wall budget beside a certificate whose budget is not in seconds (TrainConfig._cross)
    certifies = r.certify and cfg.speculative.enabled
    cert = CERTIFICATE_OVERRUN * float(r.certificate.budget_seconds) if certifies else 0.0
    return start + r.wall_budget_minutes * 60.0 - cert - TAIL_SECONDS


def apply_sizing(cfg: Any, processor: str, probe: Callable[[Any], float] | None = None,
                 started: float | None = None) -> tuple[Any, dict[str, Any] | None]:
    """(the config with the sized work, the decision) where `run.min_steps` is set; (cfg, None) otherwise. `probe`
    measures this machine's plain decode step for `cfg` (default `specrl.run.speed_probe.decode_step_seconds`);
    `started`, when the command began (epoch seconds, for `run.wall_budget_minutes`; default `wall_start()`)."""
    r = cfg.run
    if getattr(r, "min_steps", None) is None:
        return cfg, None
    if r.time_budget_minutes is None:
        raise SpecRLError("run.min_steps sizes the per-step work to fit run.time_budget_minutes, which is not set; "
                          "set a budget or run.min_steps=null")
    step = None
    if not r.device.startswith("cuda"):
        if probe is None:
            from specrl.run.speed_probe import decode_step_seconds as probe
        step = probe(cfg)
    budget, wall = r.time_budget_minutes, None
    deadline = wall_deadline(cfg, wall_start() if started is None else started)
    if deadline is not None:  # run.wall_budget_minutes: plan with what the set-up so far and the certificate leave
        left = (deadline - time.time()) / 60.0
        wall = {"wall_budget_minutes": r.wall_budget_minutes, "left_minutes": round(left, 2)}
        budget = min(budget, max(left, WALL_FLOOR_MINUTES))
    d = size_run(processor, budget, r.min_steps, cfg.generation.max_new_tokens, cfg.task.val_size, step, r.device)
    if wall is not None:
        d["wall"] = wall
        if budget < r.time_budget_minutes:
            d["reason"] += (f"; the budget is the {wall['left_minutes']:.1f} minutes left of run.wall_budget_minutes="
                            f"{r.wall_budget_minutes:g} after the set-up so far and the certificate's reserve, less "
                            f"than run.time_budget_minutes={r.time_budget_minutes:g}")
    data = cfg.model_dump(mode="json")
    data["generation"]["max_new_tokens"] = d["max_new_tokens"]
    data["task"]["val_size"] = d["val_size"]
    return type(cfg).model_validate(data), d


def write_sizing(run_dir: str | Path, decision: dict[str, Any] | None) -> None:
    path = Path(run_dir) / "sizing.json"
    if decision is None:
        path.unlink(missing_ok=True)
    else:
        path.write_text(json.dumps(decision, indent=2) + "\n")


def read_sizing(run_dir: str | Path) -> dict[str, Any] | None:
    path = Path(run_dir) / "sizing.json"
    return json.loads(path.read_text()) if path.is_file() else None


def line(decision: dict[str, Any]) -> str:
    """The report's sentence: what was sized and why."""
    c = decision["configured"]
    if not decision.get("sized"):
        what = f"per-step work as configured ({c['max_new_tokens']} new tokens, {c['val_size']} validation questions)"
    else:
        what = (f"per-step work sized to this machine: {decision['max_new_tokens']} new tokens (configured "
                f"{c['max_new_tokens']}) and {decision['val_size']} validation questions (configured {c['val_size']}),"
                " the same in both arms")
    return f"sizing: {what}; {decision['reason']}"

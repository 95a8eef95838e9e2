"""Per-step work sized to the processor class, so a time-budgeted compare runs at least `run.min_steps` steps.

`make run` has a fixed wall-clock budget (`run.time_budget_minutes`), and a 2-core CPU of the slowest class measured
(AVX2-only, fp32) ran one pair of the main job's steps in 108 s, so the full work fitted one step there. With
`run.min_steps` set, `size_run` picks, before anything is loaded, the largest rung of `LADDER` (fractions of the
config's `generation.max_new_tokens` and `task.val_size`) whose predicted time fits the budget: two validations of
both arms (step 0 and the end) plus `min_steps` pairs of steps, predicted from the pair time, generation share and
validation time measured on that class with the reference work of `examples/default.yaml` (`COSTS`; the figures
and where they were measured are in docs/results.md). A pair's generation share R scales with the response cap,
the rest of the step does not: pair(f) = pair · (R · f + 1 − R); a greedy validation is generation only and scales
with the cap and the question count. The prediction is a plan, not a promise: the run's budget check still stops
before a step that would end past the budget. Both arms run the same sized config, so neither is handicapped.
A class with no measured costs is sized with the slowest class's; a CUDA device is not sized. The result
(`sizing.json` beside the run's config, and compare.json's `sizing`) says what was sized, from what, and why.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from specrl.errors import SpecRLError

MARGIN = 0.95  # plan within 95% of the budget (the run still stops before a step that would pass it)


@dataclass(frozen=True)
class ClassCost:
    """One pair of the main job's steps (autoregressive + speculative) on a 2-core CPU of a class, at the reference
    work (512 new tokens, 16 validation questions), and its validation of both arms."""

    pair_seconds: float
    gen_share: float
    validation_seconds: float
    source: str


REFERENCE = {"max_new_tokens": 512, "val_size": 16}
# AVX2: a fresh-clone `make run` (one step: the slowest pair 108 s, 121 s kept for the final validation, R 0.69).
# AVX512-BF16 and AMX: docs/results.md's `make run` rows (slowest pair 77 s; mean pair 35.31 + 27.15 s, R 0.69);
# their validations were not timed apart, so they take AVX2's ratio of validation to pair time (121 / 108).
_VAL_RATIO = 121.0 / 108.0
COSTS: dict[str, ClassCost] = {
    "AVX2": ClassCost(108.0, 0.69, 121.0, "make run on a 2-core AVX2-only AMD EPYC, fp32"),
    "AVX512-BF16": ClassCost(77.0, 0.57, 77.0 * _VAL_RATIO,
                             "make run on a 2-core AMD EPYC with AVX512-BF16, bf16 (docs/results.md, e754791)"),
    "AMX": ClassCost(62.46, 0.69, 62.46 * _VAL_RATIO,
                     "make run on a 2-core Intel Xeon with AMX, bf16 (docs/results.md, first run)"),
}
SLOWEST = "AVX2"
# (fraction of generation.max_new_tokens, fraction of task.val_size), most work first
LADDER: tuple[tuple[float, float], ...] = ((1.0, 1.0), (0.875, 1.0), (0.75, 0.75), (0.625, 0.75), (0.625, 0.5),
                                           (0.5, 0.5), (0.375, 0.5))


def predict_seconds(cost: ClassCost, token_fraction: float, val_fraction: float, steps: int) -> float:
    """Two validations of both arms plus `steps` pairs of steps, at the given fractions of the reference work."""
    pair = cost.pair_seconds * (cost.gen_share * token_fraction + 1.0 - cost.gen_share)
    return 2 * cost.validation_seconds * token_fraction * val_fraction + steps * pair


def size_run(processor: str, budget_minutes: float, min_steps: int, max_new_tokens: int, val_size: int,
             device: str = "cpu") -> dict[str, Any]:
    """The sizing decision (a JSON-able dict): the chosen `max_new_tokens` and `val_size`, the class and costs it
    used, the predicted seconds, and `reason`. Pure: the same inputs give the same answer on any machine."""
    if min_steps < 1 or budget_minutes <= 0 or max_new_tokens < 1 or val_size < 0:
        raise SpecRLError(f"sizing needs min_steps >= 1, a positive budget, max_new_tokens >= 1 and val_size >= 0, "
                          f"got {min_steps}, {budget_minutes}, {max_new_tokens}, {val_size}")
    out: dict[str, Any] = {"processor_class": processor, "device": device, "min_steps": min_steps,
                           "budget_seconds": budget_minutes * 60.0, "configured": {"max_new_tokens": max_new_tokens,
                                                                                  "val_size": val_size}}
    if device.startswith("cuda"):
        return {**out, "sized": False, "max_new_tokens": max_new_tokens, "val_size": val_size,
                "reason": "not sized: the costs are measured on CPUs only"}
    cls = processor if processor in COSTS else SLOWEST
    cost = COSTS[cls]
    base_tok = max_new_tokens / REFERENCE["max_new_tokens"]
    base_val = val_size / REFERENCE["val_size"]
    plan = budget_minutes * 60.0 * MARGIN
    out.update(cost_class=cls, cost=asdict(cost), margin=MARGIN)
    for i, (ft, fv) in enumerate(LADDER):
        tokens, vals = max(1, round(max_new_tokens * ft)), round(val_size * fv)
        secs = predict_seconds(cost, base_tok * ft, base_val * fv, min_steps)
        if secs <= plan or i == len(LADDER) - 1:
            fits = secs <= plan
            why = (f"{min_steps} steps per arm plus two validations of both arms are predicted to take {secs:.0f} s "
                   f"on {cls} ({cost.source}) at {tokens} new tokens and {vals} validation questions, within "
                   f"{MARGIN:.0%} of the {budget_minutes:g}-minute budget" if fits else
                   f"even the smallest rung ({tokens} new tokens, {vals} questions) is predicted at {secs:.0f} s, "
                   f"past {MARGIN:.0%} of the {budget_minutes:g}-minute budget: fewer steps will run")
            if i == 0:
                why = "full work: " + why
            elif cls != processor:
                why += f" (no costs measured for {processor}: sized as the slowest class measured)"
            return {**out, "sized": i > 0, "fits": fits, "rung": i, "max_new_tokens": tokens, "val_size": vals,
                    "predicted_seconds": secs, "reason": why}
    raise AssertionError("unreachable: the last rung always returns")


def apply_sizing(cfg: Any, processor: str) -> tuple[Any, dict[str, Any] | None]:
    """(the config with the sized work, the decision) where `run.min_steps` is set; (cfg, None) otherwise."""
    r = cfg.run
    if getattr(r, "min_steps", None) is None:
        return cfg, None
    if r.time_budget_minutes is None:
        raise SpecRLError("run.min_steps sizes the per-step work to fit run.time_budget_minutes, which is not set; "
                          "set a budget or run.min_steps=null")
    d = size_run(processor, r.time_budget_minutes, r.min_steps, cfg.generation.max_new_tokens, cfg.task.val_size,
                 r.device)
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
        what = (f"per-step work sized to the processor: {decision['max_new_tokens']} new tokens (configured "
                f"{c['max_new_tokens']}) and {decision['val_size']} validation questions (configured {c['val_size']}),"
                " the same in both arms")
    return f"sizing: {what}; {decision['reason']}"

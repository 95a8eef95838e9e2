"""Fitting the efficiency factors to measured stage tables (`specrl simulate fit`).

The fitted quantities are the ones `roofline.Efficiency` names — achieved bandwidth fraction, per-forward
overheads of target and drafter, logprob/train MFU, prepare and data fixed costs — plus one workload unknown
per paper workload, the log-normal shape σ of its response lengths (the paper publishes no length data).
Achieved FLOP/s in decode is held at a prior (0.6) because these tables cannot identify it. The generation
parameters are fitted by least squares on log(predicted/measured) with weak log-priors (so degenerate
directions, e.g. bandwidth vs per-step overhead, stay near typical values); the other stages are closed form.
`holdout` leaves named measurements out of the fit so they become predictions (`RL-Zero:spec:gen`).
"""

from __future__ import annotations

import json
import math
import pprint
from dataclasses import dataclass, field, replace
from pathlib import Path

import numpy as np

from specrl.errors import SpecRLError
from specrl.sim.pipeline import SimConfig, other_stages, prepare, run_generation
from specrl.sim.roofline import Efficiency

STAGE_MAP = {"data": "data", "prepare": "prepare", "generation": "gen", "logprob": "logprob", "training": "train"}
ARM_MAP = {"autoregressive": "ar", "speculative_k3": "spec"}
PRIORS = {"bw_eff": 0.7, "step_overhead_s": 2e-3, "draft_overhead_s": 0.5e-3}
PRIOR_WEIGHT = 0.05  # residual per e-fold away from the prior; measured residuals weigh 1 per e-fold
# A copy of shared/reference/paper_8b.json ships with the package, so `fit` works from any checkout.
DEFAULT_DATA = Path(__file__).resolve().parent / "data" / "paper_8b.json"


@dataclass
class FitResult:
    efficiency: Efficiency
    workload_sigma: dict[str, float]
    rows: list[dict] = field(default_factory=list)  # workload, arm, stage, measured, predicted, error, held_out
    source: str = ""

    def median_abs_error(self, held_out: bool | None = None) -> float:
        errs = [abs(r["error"]) for r in self.rows if held_out is None or r["held_out"] == held_out]
        return float(np.median(errs)) if errs else float("nan")

    def to_dict(self) -> dict:
        return {"efficiency": self.efficiency.to_dict(), "workload_sigma": self.workload_sigma,
                "rows": self.rows, "median_abs_error": self.median_abs_error(), "source": self.source}


def load_tables(path: str | Path) -> dict[str, dict]:
    """{workload: {"al": float, "ar": {stage: s}, "spec": {stage: s}}} from a paper_8b.json-shaped file."""
    p = Path(path)
    if not p.exists():
        raise SpecRLError(f"calibration data {p} does not exist; pass --data PATH to a paper_8b.json-shaped file")
    try:
        raw = json.loads(p.read_text())
        out = {}
        for name, w in raw["workloads"].items():
            tables = {ARM_MAP[a]: {STAGE_MAP[s]: float(v) for s, v in t.items() if s in STAGE_MAP}
                      for a, t in w["stage_seconds"].items() if a in ARM_MAP}
            out[name] = {"al": float(w["acceptance_length_k3"]), **tables}
        return out
    except (json.JSONDecodeError, KeyError, TypeError, ValueError) as exc:
        raise SpecRLError(f"{p}: not a paper_8b.json-shaped calibration file ({exc!r}); it needs "
                          "workloads.NAME.stage_seconds.{autoregressive,speculative_k3} and acceptance_length_k3") \
            from exc


def _config(name: str, al: float, eff: Efficiency, sigma: float) -> SimConfig:
    from specrl.sim.scenarios import paper_8b

    return replace(paper_8b(name, eff, sigma), acceptance_length=al)


def fit(data: str | Path = DEFAULT_DATA, holdout: tuple[str, ...] = (), max_nfev: int = 60,
        base: Efficiency | None = None) -> FitResult:
    from scipy.optimize import least_squares

    tables = load_tables(data)
    names = sorted(tables)
    for h in holdout:
        parts = h.split(":")
        ok = len(parts) == 3 and parts[0] in tables and parts[1] in ("ar", "spec")
        if not ok or parts[2] not in STAGE_MAP.values():
            raise SpecRLError(f"--holdout {h!r} must be WORKLOAD:ARM:STAGE with WORKLOAD in {names}, ARM ar|spec, "
                              f"STAGE one of {sorted(STAGE_MAP.values())}")
    held = set(holdout)
    base = base or Efficiency(flops_eff=0.6)
    gen_targets = [(n, arm) for n in names for arm in ("ar", "spec") if f"{n}:{arm}:gen" not in held]

    def unpack(x: np.ndarray) -> tuple[Efficiency, dict[str, float]]:
        eff = replace(base, bw_eff=min(1.0, math.exp(x[0])), step_overhead_s=math.exp(x[1]),
                      draft_overhead_s=math.exp(x[2]))
        return eff, {n: float(x[3 + i]) for i, n in enumerate(names)}

    def gen_pred(eff: Efficiency, sig: dict[str, float]) -> dict[tuple[str, str], float]:
        out = {}
        for n in names:
            ctx = prepare(_config(n, tables[n]["al"], eff, sig[n]))
            out[(n, "ar")] = run_generation(ctx, False)[0].seconds
            out[(n, "spec")] = run_generation(ctx, True)[0].seconds
        return out

    def residuals(x: np.ndarray) -> np.ndarray:
        eff, sig = unpack(x)
        pred = gen_pred(eff, sig)
        r = [math.log(pred[t] / tables[t[0]][t[1]]["gen"]) for t in gen_targets]
        r += [PRIOR_WEIGHT * (x[i] - math.log(PRIORS[k])) for i, k in enumerate(PRIORS)]
        return np.asarray(r)

    x0 = np.array([math.log(PRIORS[k]) for k in PRIORS] + [0.8] * len(names))
    lo = np.array([math.log(0.05), math.log(1e-5), math.log(1e-6)] + [0.05] * len(names))
    hi = np.array([0.0, math.log(0.1), math.log(0.05)] + [2.0] * len(names))
    sol = least_squares(residuals, x0, bounds=(lo, hi), diff_step=0.02, max_nfev=max_nfev)
    eff, sig = unpack(sol.x)

    # closed-form stages: data mean; prepare fixed = mean(measured - bytes term); MFU = geometric fits
    contexts = {n: prepare(_config(n, tables[n]["al"], eff, sig[n])) for n in names}
    kept = [(n, a) for n in names for a in ("ar", "spec")]
    unit = replace(eff, mfu_logprob=1.0, mfu_train=1.0, prepare_fixed_s=0.0, data_s=0.0)
    raw = {(n, a): other_stages(replace(contexts[n], cfg=replace(contexts[n].cfg, efficiency=unit)), a == "spec")
           for n, a in kept}

    def use(n: str, a: str, s: str) -> bool:
        return f"{n}:{a}:{s}" not in held

    def mean(vals: list[float], what: str) -> float:
        if not vals:
            raise SpecRLError(f"--holdout left no measurement to fit {what}")
        return float(np.mean(vals))

    data_s = mean([tables[n][a]["data"] for n, a in kept if use(n, a, "data")], "data")
    prep = mean([tables[n][a]["prepare"] - raw[(n, a)]["prepare"] for n, a in kept if use(n, a, "prepare")],
                "prepare")
    mfu_lp = math.exp(mean([math.log(raw[(n, a)]["logprob"] / tables[n][a]["logprob"])
                            for n, a in kept if use(n, a, "logprob")], "logprob"))
    grad = {k: raw[k]["train"] - 3 * raw[k]["logprob"] for k in kept}  # gradient sync part (MFU-free)
    mfu_tr = math.exp(mean([math.log(3 * raw[(n, a)]["logprob"] / (tables[n][a]["train"] - grad[(n, a)]))
                            for n, a in kept if use(n, a, "train")], "train"))
    eff = replace(eff, data_s=data_s, prepare_fixed_s=max(prep, 0.0), mfu_logprob=min(mfu_lp, 1.0),
                  mfu_train=min(mfu_tr, 1.0))

    rows = []
    pred_gen = gen_pred(eff, sig)
    for n, a in kept:
        ctx = replace(contexts[n], cfg=replace(contexts[n].cfg, efficiency=eff))
        pred = other_stages(ctx, a == "spec")
        pred["gen"] = pred_gen[(n, a)]
        for s in ("data", "prepare", "gen", "logprob", "train"):
            m = tables[n][a][s]
            rows.append({"workload": n, "arm": a, "stage": s, "measured": m, "predicted": pred[s],
                         "error": (pred[s] - m) / m, "held_out": not use(n, a, s)})
        m_tot, p_tot = sum(tables[n][a].values()), sum(pred.values())
        rows.append({"workload": n, "arm": a, "stage": "total", "measured": m_tot, "predicted": p_tot,
                     "error": (p_tot - m_tot) / m_tot, "held_out": False})
    for n in names:
        m_su = tables[n]["ar"]["gen"] / tables[n]["spec"]["gen"]
        p_su = pred_gen[(n, "ar")] / pred_gen[(n, "spec")]
        rows.append({"workload": n, "arm": "ratio", "stage": "rollout_speedup", "measured": m_su, "predicted": p_su,
                     "error": (p_su - m_su) / m_su, "held_out": f"{n}:spec:gen" in held})
    return FitResult(eff, sig, rows, source=str(data))


def _round(d: dict) -> dict:
    return {k: float(f"{v:.6g}") for k, v in d.items()}


def write_calibration(result: FitResult | None = None, path: str | Path | None = None,
                      cpu: Efficiency | None = None, cpu_source: str = "") -> Path:
    """Write calibrated.py (the module presets read): a GPU fit, a CPU fit, or both; the rest is kept."""
    from specrl.sim.calibrated import CALIBRATION

    path = Path(path or Path(__file__).with_name("calibrated.py"))
    cal = dict(CALIBRATION)
    if result is not None:
        cal.update({"source": f"specrl simulate fit on {Path(result.source).name}; median |error| "
                              f"{result.median_abs_error():.3f}",
                    "efficiency": _round(result.efficiency.to_dict()),
                    "workload_sigma": _round(result.workload_sigma)})
    if cpu is not None:
        cal["cpu_source"] = cpu_source
        cal["cpu_efficiency"] = _round(cpu.to_dict())
    body = pprint.pformat(cal, width=108, sort_dicts=False)
    path.write_text('"""Calibrated efficiency factors (written by `specrl simulate fit --write`; do not '
                    'hand-edit)."""\n\nCALIBRATION = ' + body + "\n")
    return path

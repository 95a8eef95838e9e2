"""Fitting the efficiency factors to measured stage tables (`specrl simulate fit`).

The fitted quantities are the ones `roofline.Efficiency` names — achieved bandwidth fraction, per-forward
overheads of target and drafter, logprob/train MFU, prepare and data fixed costs — plus one workload unknown
per paper workload, the log-normal shape σ of its response lengths (the paper publishes no length data).
Achieved FLOP/s in decode is held at a prior (0.6) because these tables cannot identify it. The generation
parameters are fitted by least squares on log(predicted/measured) with weak log-priors (so degenerate
directions, e.g. bandwidth vs per-step overhead, stay near typical values); the other stages are closed form.
`holdout` leaves named measurements out of the fit so they become predictions (`RL-Zero:spec:gen`).
`fit_cpu_efficiency` fits the CPU factors to specrl's own sync runs (`specrl simulate fit --from-run`).
"""

from __future__ import annotations

import json
import math
import pprint
import statistics
from dataclasses import dataclass, field, replace
from pathlib import Path

import numpy as np

from specrl.errors import SpecRLError
from specrl.sim.calibration.fromrun import (
    config_for_run,
    cpu_efficiency,
    metrics_file,
    pipeline_layout,
    predict_run,
    read_run_config,
    run_records,
    step_configs,
)
from specrl.sim.costs.models import get_model
from specrl.sim.costs.roofline import Efficiency
from specrl.sim.pipeline import STAGES, SimConfig, other_stages, prepare, run_generation, simulate

STAGE_MAP = {"data": "data", "prepare": "prepare", "generation": "gen", "logprob": "logprob", "training": "train"}
ARM_MAP = {"autoregressive": "ar", "speculative_k3": "spec"}
PRIORS = {"bw_eff": 0.7, "step_overhead_s": 2e-3, "draft_overhead_s": 0.5e-3}
PRIOR_WEIGHT = 0.05  # residual per e-fold away from the prior; measured residuals weigh 1 per e-fold
# A copy of shared/reference/paper_8b.json ships with the package, so `fit` works from any checkout.
DEFAULT_DATA = Path(__file__).resolve().parents[1] / "data" / "paper_8b.json"  # specrl/sim/data/


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
    from specrl.sim.calibration.calibrated import CALIBRATION

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


def _fit_inputs(path: str | Path, cpu_profile: str | None, unit: Efficiency, prompt_tokens: int):
    """(path, configs, measured medians, arm, steps): one config per step when the run recorded every step's
    lengths (the fit then matches the median of per-step predictions to the median of measured steps: linear in
    each factor while the steps keep their order, which the in-sample rows check), else one pooled config."""
    metrics_path = metrics_file(path)
    records = run_records(metrics_path)
    run_cfg = read_run_config(metrics_path.parent)
    if pipeline_layout(run_cfg)[0] != "sync":
        raise SpecRLError(f"{metrics_path}: `fit --from-run` needs a sync run (pipeline.mode: sync), whose stage "
                          "times are the stages themselves; an async run records the learner's wait as its gen "
                          "time. Fit on the sync arm and predict the async one with --from-run")
    cfg = config_for_run(run_cfg, records, cpu_profile, unit, prompt_tokens=prompt_tokens)
    steady = records[1:] or records
    per_step = step_configs(cfg, steady)
    meas = {s: statistics.median(float(r.stage_seconds.get(s, 0.0)) for r in steady) for s in STAGES}
    return metrics_path, per_step or [cfg], meas, "spec" if cfg.drafter != "none" else "ar", len(steady)


def fit_cpu_efficiency(metrics_path: str | Path | list, cpu_profile: str | None = None, prompt_tokens: int = 120,
                       long_prompt_tokens: int | None = None) -> dict:
    """Fit the CPU efficiency factors to sync runs' median stage times (closed form, 2x2 linear, or bisection).

    One run: data and prepare fixed costs are its measured medians (minus the weight-copy bytes term),
    logprob/train MFU are predicted-at-MFU-1 / measured, and the per-forward overhead solves the generation
    time, which is linear in it; the matmul efficiency `flops_eff` and the per-sequence host costs are kept
    from the calibration. A second run with longer sequences (`[short, long]`) also pins what one run cannot
    separate: the per-forward overhead against a per-sequence host cost of every decode step (two generation
    times in two batch/length regimes; GEMMs at the profile's rate) and the trainer's attention rate
    `mfu_attention` against the GEMM MFU (two train times; attention grows as L²).
    Returns {"efficiency": Efficiency, "rows": predicted vs measured after the fit (per run with two)}.
    """
    paths = list(metrics_path) if isinstance(metrics_path, list | tuple) else [metrics_path]
    if not 1 <= len(paths) <= 2:
        raise SpecRLError(f"fit --from-run takes one sync run, or two (a short- and a long-sequence one); got "
                          f"{len(paths)}")
    # keep the decode factors the engine-fidelity benchmark fitted (matmul efficiency, per-sequence host cost)
    prior = cpu_efficiency()
    unit = Efficiency(bw_eff=1.0, flops_eff=prior.flops_eff, step_overhead_s=0.0, draft_overhead_s=0.0,
                      ngram_overhead_s=0.0, spec_seq_overhead_s=prior.spec_seq_overhead_s,
                      decode_seq_overhead_s=prior.decode_seq_overhead_s, mfu_logprob=1.0, mfu_train=1.0,
                      mfu_attention=1.0 if len(paths) == 2 else 0.0,
                      prepare_fixed_s=0.0, data_s=0.0)
    prompts = [prompt_tokens, long_prompt_tokens or prompt_tokens]
    runs = [_fit_inputs(p, cpu_profile, unit, pt) for p, pt in zip(paths, prompts, strict=False)]
    path_a, cfg_a, meas, arm, steps = runs[0]

    def stages(cfgs: list[SimConfig], eff: Efficiency, a: str) -> dict:
        per = [simulate(replace(c, efficiency=eff))[a]["stages"] for c in cfgs]
        return {s: statistics.median(p[s] for p in per) for s in per[0]}

    # Eager PyTorch on a CPU pays its host cost (Python, op dispatch) per layer, so a drafter forward costs the
    # target's per-forward overhead times its share of decoder layers (an EAGLE head: 1 of the target's L). The
    # engine's measured c ~ 0.06-0.1 on SmolLM2 (docs/speculative_benchmarks.md) is this; the same overhead for
    # both (c ~ 0.7) is not. (On a GPU under CUDA graphs the 8B fit finds a per-forward cost instead.)
    layer_share = 1.0 / get_model(cfg_a[0].model).layers

    def solve_overhead(e: Efficiency) -> Efficiency:
        r0 = stages(cfg_a, e, arm)
        r1 = stages(cfg_a, replace(e, step_overhead_s=1e-3, draft_overhead_s=1e-3 * layer_share), arm)
        slope = (r1["gen"] - r0["gen"]) / 1e-3
        o = max(0.0, (meas["gen"] - r0["gen"]) / slope) if slope > 0 else 0.0
        return replace(e, step_overhead_s=o, draft_overhead_s=o * layer_share)

    eff = solve_overhead(unit)
    mfu_att = 0.0
    if len(runs) == 2:
        _, cfg_b, meas_b, arm_b, _ = runs[1]
        # Two generation regimes (A: 32-wide batches of short answers, B: narrow batches, long answers) pin the
        # per-forward overhead o and a per-sequence host cost s of every decode step, both linear: gen = g0 + n·o
        # + m·s. The GEMMs run at the profile's large-GEMM rate (flops_eff 1): the engine's k-grid shows extra
        # *verify* rows of a forward cost far less than extra *sequences* (docs/speculative_benchmarks.md: v = 1.84
        # at B=16, k=7), so the per-row cost of decode is host work per sequence, not slow skinny GEMMs.
        base = replace(unit, flops_eff=1.0, step_overhead_s=0.0, draft_overhead_s=0.0, decode_seq_overhead_s=0.0)
        rows_ = []
        for cfg, a, m in ((cfg_a, arm, meas), (cfg_b, arm_b, meas_b)):
            g0 = stages(cfg, base, a)["gen"]
            n = (stages(cfg, replace(base, step_overhead_s=1e-3, draft_overhead_s=1e-3 * layer_share), a)["gen"]
                 - g0) / 1e-3
            k_ = (stages(cfg, replace(base, decode_seq_overhead_s=1e-3), a)["gen"] - g0) / 1e-3
            rows_.append((n, k_, m["gen"] - g0))
        (na, ma_, ra), (nb, mb_, rb) = rows_
        det = na * mb_ - ma_ * nb
        o = (ra * mb_ - ma_ * rb) / det if det else -1.0
        s_ = (na * rb - ra * nb) / det if det else -1.0
        if not (o >= 0 and s_ >= 0):
            raise SpecRLError(f"the two runs' generation times do not separate a per-forward from a per-sequence "
                              f"cost (o={o:.4g} s, s={s_:.4g} s); pass runs with different batch sizes and lengths "
                              f"({paths})")
        eff = replace(base, step_overhead_s=o, draft_overhead_s=o * layer_share, decode_seq_overhead_s=s_)
        # train = gemm/mfu + attention/mfu_attention on both runs: split each unit-efficiency prediction
        half = replace(eff, mfu_attention=0.5)
        parts = []
        for cfg, a in ((cfg_a, arm), (cfg_b, arm_b)):
            t1, t2 = stages(cfg, eff, a)["train"], stages(cfg, half, a)["train"]
            parts.append((2 * t1 - t2, t2 - t1))  # (gemm seconds, attention seconds) at efficiency 1
        (ga, aa), (gb, ab) = parts
        det = ga * ab - aa * gb
        x = (meas["train"] * ab - aa * meas_b["train"]) / det if det else 0.0
        y = (ga * meas_b["train"] - meas["train"] * gb) / det if det else 0.0
        if not (det and x > 0 and y > 0):
            raise SpecRLError(f"the two runs do not separate GEMM and attention cost (their sequence lengths are too "
                              f"alike, or the longer one trains faster per token); pass a short run first and a "
                              f"run with much longer responses second ({paths})")
        mfu_att = min(1.0, 1.0 / y)
        eff = replace(eff, mfu_train=min(1.0, 1.0 / x), mfu_attention=mfu_att)
    r0 = stages(cfg_a, replace(eff, mfu_logprob=1.0, mfu_train=1.0, prepare_fixed_s=0.0, data_s=0.0), arm)
    if r0["logprob"] == 0:  # run A had no logprob forward (logprob_skipped): price one at the train MFU
        if len(runs) == 1:
            eff = replace(eff, mfu_train=min(1.0, r0["train"] / meas["train"]) if meas["train"] > 0 else 1.0)
        mfu_lp = eff.mfu_train
    elif len(runs) == 2:  # logprob: its GEMM MFU from run A, at the attention rate the train fit found
        l1 = stages(cfg_a, replace(eff, mfu_logprob=1.0, mfu_attention=1.0), arm)["logprob"]
        l2 = stages(cfg_a, replace(eff, mfu_logprob=1.0, mfu_attention=0.5), arm)["logprob"]
        g, a = 2 * l1 - l2, l2 - l1
        rest = meas["logprob"] - a / mfu_att
        mfu_lp = min(1.0, g / rest) if rest > 0 else 1.0
    else:
        mfu_lp = min(1.0, r0["logprob"] / meas["logprob"]) if meas["logprob"] > 0 else 1.0
        eff = replace(eff, mfu_train=min(1.0, r0["train"] / meas["train"]) if meas["train"] > 0 else 1.0)
    eff = replace(eff, data_s=meas["data"], prepare_fixed_s=max(0.0, meas["prepare"] - r0["prepare"]),
                  mfu_logprob=mfu_lp, mfu_attention=mfu_att)
    rows = predict_run(path_a, cpu_profile, eff, prompts[0])["rows"]
    out = {"efficiency": eff, "steps_used": steps, "rows": rows}
    if len(runs) == 2:
        out["rows_long"] = predict_run(runs[1][0], cpu_profile, eff, prompts[1])["rows"]
    return out

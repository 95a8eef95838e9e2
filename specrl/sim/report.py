"""Rendering simulator results: the JSON contract and the readable tables the CLI prints.

`to_json` makes a result JSON-safe (numpy scalars become floats) and keeps the contract fields first;
`format_result`, `format_fit` and `format_from_run` are the plain-text tables. Nothing here computes.
"""

from __future__ import annotations

import json
import math

import numpy as np

STAGES = ("data", "prepare", "gen", "logprob", "train")


def _clean(x):
    if isinstance(x, dict):
        return {k: _clean(v) for k, v in x.items()}
    if isinstance(x, list | tuple):
        return [_clean(v) for v in x]
    if isinstance(x, np.generic):
        return x.item()
    if isinstance(x, float) and not math.isfinite(x):
        return None
    return x


def to_json(result: dict, indent: int | None = 2) -> str:
    return json.dumps(_clean(result), indent=indent)


def format_result(r: dict) -> str:
    ar, spec = r["ar"], r["spec"]
    cfg = r["config"]
    lay = r["layout"]
    k = cfg["k"]
    lines = [
        f"model {r['model']['name']} on {cfg['gpus']} x {r['hardware']} ({cfg['precision']}), mode {r['mode']}"
        + (f", policy lag {cfg['policy_lag']}, {lay['gen_gpus']} gen / {lay['train_gpus']} train GPUs"
           if r["mode"] == "async" else ""),
        f"engines {lay['engines']} x {lay['gpus_per_engine']} GPU, rollouts "
        f"{cfg['workload']['prompts_per_step']} x {cfg['workload']['generations_per_prompt']}, "
        f"max {cfg['workload']['max_response_tokens']} tokens; drafter {cfg['drafter']} k={k}",
        "",
        f"{'stage':<10}{'AR s':>10}{'spec s':>10}{'ratio':>8}",
    ]
    for s in STAGES:
        a, b = ar["stages"][s], spec["stages"][s]
        lines.append(f"{s:<10}{a:>10.2f}{b:>10.2f}{a / b if b else float('nan'):>8.2f}")
    label = "step*" if r["mode"] == "async" else "step"
    lines.append(f"{label:<10}{ar['step_seconds']:>10.2f}{spec['step_seconds']:>10.2f}"
                 f"{r['step_speedup']:>8.2f}")
    lines += [
        "",
        f"acceptance length {spec['acceptance_length']:.2f}, mean draft tokens {spec['num_draft_tokens']:.2f}, "
        f"drafter cost/target step c={spec.get('draft_cost_ratio', 0.0):.3f}",
        f"rollout speedup {r['rollout_speedup']:.2f}x, step speedup {r['step_speedup']:.2f}x, "
        f"bound 1/(R/AL+1-R) {r['bound']:.2f}x at gen share R={r['gen_share']:.2f}",
        *(["step* = effective step time of the async pipeline"] if r["mode"] == "async" else []),
        f"exposed generation: AR {r['exposed_gen_seconds']['ar']:.2f} s, spec {r['exposed_gen_seconds']['spec']:.2f} s",
    ]
    if ar.get("cudagraph_max_tokens") is not None:
        share = {a: 100 * x["generation"].get("eager_step_share", 0.0) for a, x in (("ar", ar), ("spec", spec))}
        lines.append(f"CUDA graphs up to {ar['cudagraph_max_tokens']:.0f} (AR) / {spec['cudagraph_max_tokens']:.0f} "
                     f"(spec) tokens per forward; decode time outside a graph: AR {share['ar']:.0f}%, "
                     f"spec {share['spec']:.0f}%")
    if "combined_speedup_vs_sync_ar" in r:
        lines.append(f"vs sync autoregressive on the same GPUs ({r['sync_ar_step_seconds']:.2f} s/step): "
                     f"{r['combined_speedup_vs_sync_ar']:.2f}x")
    return "\n".join(lines)


def format_fit(fit: dict) -> str:
    lines = [f"{'workload':<10}{'arm':<6}{'stage':<17}{'measured':>10}{'predicted':>11}{'error':>9}"]
    for row in fit["rows"]:
        tag = "  (held out)" if row["held_out"] else ""
        lines.append(f"{row['workload']:<10}{row['arm']:<6}{row['stage']:<17}{row['measured']:>10.2f}"
                     f"{row['predicted']:>11.2f}{100 * row['error']:>+8.1f}%{tag}")
    lines.append(f"median |error| {100 * fit['median_abs_error']:.1f}%")
    eff = ", ".join(f"{k}={v:.4g}" for k, v in fit["efficiency"].items())
    lines.append(f"efficiency: {eff}")
    lines.append("workload sigma: " + ", ".join(f"{k}={v:.3f}" for k, v in fit["workload_sigma"].items()))
    return "\n".join(lines)


def format_from_run(rows: list[dict]) -> str:
    lines = [f"{'stage':<12}{'measured s':>12}{'predicted s':>13}{'error':>9}"]
    for row in rows:
        err = row["error"]
        # a stage measured at ~0 (an async learner that never waits) has no meaningful relative error
        shown = f"{100 * err:>+8.1f}%" if row["measured"] >= 0.01 and err == err else f"{'—':>9}"
        lines.append(f"{row['stage']:<12}{row['measured']:>12.3f}{row['predicted']:>13.3f}{shown}")
    return "\n".join(lines)

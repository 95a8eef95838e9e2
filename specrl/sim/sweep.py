"""Parameter sweeps and the advisor (`specrl simulate sweep` / `advise`).

`sweep` runs a k x acceptance-length grid (rollout and end-to-end speedup heatmaps) and a GPU-count x policy-lag
grid (effective step time and speedup curves) around one config, and writes both as CSV and PNG. The
autoregressive arm is cached across cells that share it, so a 100-cell sweep of the 235B preset stays well
under a minute. `advise` searches drafter (with the acceptance the user supplies per drafter), k (1..8 and
auto), policy lag and GPU split, and returns the best configuration and the runner-up with their speedups.
"""

from __future__ import annotations

import csv
import math
from dataclasses import replace
from pathlib import Path

from specrl.errors import SpecRLError
from specrl.sim.costs.speculation import Acceptance
from specrl.sim.pipeline import SimConfig, simulate

DEFAULT_KS = (1, 2, 3, 4, 5, 6, 7, 8)
DEFAULT_ALS = (1.0, 1.5, 2.0, 2.5, 3.0, 3.5, 4.0, 5.0, 6.0, 7.0, 9.0)


def grid_k_al(cfg: SimConfig, ks=DEFAULT_KS, als=DEFAULT_ALS, cache: dict | None = None) -> list[dict]:
    cache = {} if cache is None else cache
    rows = []
    for k in ks:
        for al in als:
            if al > k + 1:
                rows.append({"k": k, "acceptance_length": al, "rollout_speedup": math.nan,
                             "step_speedup": math.nan})
                continue
            r = simulate(replace(cfg, k=k, acceptance_length=al, acceptance_rates=None), ar_cache=cache)
            rows.append({"k": k, "acceptance_length": al, "rollout_speedup": r["rollout_speedup"],
                         "step_speedup": r["step_speedup"], "spec_step_seconds": r["spec"]["step_seconds"],
                         "ar_step_seconds": r["ar"]["step_seconds"]})
    return rows


def grid_gpus_lag(cfg: SimConfig, gpus=None, lags=(0, 1, 2, 4), cache: dict | None = None) -> list[dict]:
    cache = {} if cache is None else cache
    gpus = gpus or sorted({max(1, cfg.gpus // 4), max(1, cfg.gpus // 2), cfg.gpus, cfg.gpus * 2, cfg.gpus * 4})
    rows = []
    for n in gpus:
        for lag in lags:
            try:
                r = simulate(replace(cfg, gpus=n, policy_lag=lag, mode="async"), ar_cache=cache)
            except SpecRLError as exc:
                rows.append({"gpus": n, "policy_lag": lag, "error": str(exc)})
                continue
            rows.append({"gpus": n, "policy_lag": lag, "ar_step_seconds": r["ar"]["step_seconds"],
                         "spec_step_seconds": r["spec"]["step_seconds"], "step_speedup": r["step_speedup"],
                         "combined_speedup_vs_sync_ar": r["combined_speedup_vs_sync_ar"],
                         "sync_ar_step_seconds": r["sync_ar_step_seconds"]})
    return rows


def write_csv(rows: list[dict], path: Path) -> None:
    keys: list[str] = []
    for r in rows:
        keys += [k for k in r if k not in keys]
    with path.open("w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=keys)
        w.writeheader()
        w.writerows(rows)


def plot_heatmaps(rows: list[dict], path: Path, title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import numpy as np

    ks = sorted({r["k"] for r in rows})
    als = sorted({r["acceptance_length"] for r in rows})
    fig, axes = plt.subplots(1, 2, figsize=(12, 4.5))
    for ax, key, name in zip(axes, ("rollout_speedup", "step_speedup"), ("rollout", "end-to-end"), strict=True):
        z = np.full((len(ks), len(als)), np.nan)
        for r in rows:
            z[ks.index(r["k"]), als.index(r["acceptance_length"])] = r[key]
        im = ax.imshow(z, origin="lower", aspect="auto", cmap="RdYlGn", vmin=0.5, vmax=max(2.0, np.nanmax(z)))
        for i in range(len(ks)):
            for j in range(len(als)):
                if np.isfinite(z[i, j]):
                    ax.text(j, i, f"{z[i, j]:.2f}", ha="center", va="center", fontsize=7)
        ax.set_xticks(range(len(als)), [f"{a:g}" for a in als])
        ax.set_yticks(range(len(ks)), [str(k) for k in ks])
        ax.set_xlabel("acceptance length")
        ax.set_ylabel("draft length k")
        ax.set_title(f"{name} speedup")
        fig.colorbar(im, ax=ax)
    fig.suptitle(title)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def plot_curves(rows: list[dict], path: Path, title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    ok = [r for r in rows if "error" not in r]
    lags = sorted({r["policy_lag"] for r in ok})
    fig, axes = plt.subplots(1, 2, figsize=(12, 4.5))
    for lag in lags:
        pts = sorted((r["gpus"], r) for r in ok if r["policy_lag"] == lag)
        xs = [p[0] for p in pts]
        axes[0].plot(xs, [p[1]["spec_step_seconds"] for p in pts], marker="o", label=f"spec, lag {lag}")
        axes[0].plot(xs, [p[1]["ar_step_seconds"] for p in pts], ls="--", marker=".", label=f"AR, lag {lag}")
        axes[1].plot(xs, [p[1]["combined_speedup_vs_sync_ar"] for p in pts], marker="o", label=f"lag {lag}")
    sync = sorted({(r["gpus"], r["sync_ar_step_seconds"]) for r in ok})
    axes[0].plot([s[0] for s in sync], [s[1] for s in sync], color="k", label="sync AR")
    axes[0].set_ylabel("effective step seconds")
    axes[1].set_ylabel("speedup vs sync autoregressive")
    for ax in axes:
        ax.set_xscale("log", base=2)
        ax.set_xlabel("GPUs")
        ax.legend(fontsize=7)
        ax.grid(alpha=0.3)
    fig.suptitle(title)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def run_sweep(cfg: SimConfig, out: str | Path, ks=DEFAULT_KS, als=DEFAULT_ALS, gpus=None,
              lags=(0, 1, 2, 4), plots: bool = True) -> dict:
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    cache: dict = {}
    heat = grid_k_al(cfg, ks, als, cache)
    curves = grid_gpus_lag(cfg, gpus, lags, cache)
    write_csv(heat, out / "k_vs_acceptance.csv")
    write_csv(curves, out / "gpus_vs_lag.csv")
    files = [out / "k_vs_acceptance.csv", out / "gpus_vs_lag.csv"]
    title = f"{cfg.model} on {cfg.gpus} x {cfg.hardware}, drafter {cfg.drafter}, {cfg.mode}"
    if plots:
        plot_heatmaps(heat, out / "k_vs_acceptance.png", title)
        plot_curves(curves, out / "gpus_vs_lag.png", title)
        files += [out / "k_vs_acceptance.png", out / "gpus_vs_lag.png"]
    configs = sum(1 for r in heat if not math.isnan(r["rollout_speedup"])) + len(curves)
    return {"files": [str(f) for f in files], "configs": configs, "heatmap": heat, "curves": curves}


def parse_candidates(text: str | None, cfg: SimConfig) -> list[tuple[str, float | None, tuple | None]]:
    """`eagle3:2.77,ngram:1.9` -> [(drafter, AL at the config's reference k, rates)]; default: the config's."""
    if not text:
        return [(cfg.drafter, cfg.acceptance_length, cfg.acceptance_rates)]
    out = []
    for item in text.split(","):
        name, _, al = item.strip().partition(":")
        try:
            out.append((name, float(al), None))
        except ValueError:
            raise SpecRLError(f"--candidates item {item!r} must be DRAFTER:AL, e.g. eagle3:2.77,ngram:1.9") from None
    return out


def advise(cfg: SimConfig, candidates: str | None = None, ks=(1, 2, 3, 4, 5, 6, 7, 8, "auto"),
           lags=(0, 1, 2), fractions=(0.25, 0.375, 0.5, 0.625, 0.75)) -> dict:
    """Search drafter x k x (sync | async lag x GPU split); rank by effective step time."""
    trials = []
    cache: dict = {}
    modes = [("sync", 0, cfg.gen_gpu_fraction)] + [("async", lag, f) for lag in lags for f in fractions]
    ref_k = cfg.acceptance_ref_k if cfg.k == "auto" else int(cfg.k)
    for drafter, al, rates in parse_candidates(candidates, cfg):
        acc = Acceptance.from_length(al, ref_k) if rates is None and al is not None else None
        for k in ks:
            if rates is not None and k != "auto" and k > len(rates):
                continue
            # an AL is measured at the reference k; other k get the same per-position rate
            k_al = al if (acc is None or k == "auto") else acc.length(int(k))
            for mode, lag, frac in modes:
                trial = replace(cfg, drafter=drafter, k=k, mode=mode, policy_lag=lag, gen_gpu_fraction=frac,
                                acceptance_length=k_al, acceptance_rates=rates, acceptance_ref_k=ref_k)
                try:
                    r = simulate(trial, ar_cache=cache)
                except SpecRLError:
                    continue
                trials.append({"drafter": drafter, "k": k, "mode": mode, "policy_lag": lag,
                               "gen_gpu_fraction": frac if mode == "async" else None,
                               "step_seconds": r["spec"]["step_seconds"], "rollout_speedup": r["rollout_speedup"],
                               "step_speedup": r["step_speedup"],
                               "acceptance_length": r["spec"]["acceptance_length"]})
    if not trials:
        raise SpecRLError("no candidate configuration fits; check GPUs, model size and acceptance inputs")
    sync_ar = simulate(replace(cfg, drafter="none", mode="sync"))["ar"]["step_seconds"]
    for t in trials:
        t["speedup_vs_sync_ar"] = sync_ar / t["step_seconds"]
    trials.sort(key=lambda t: t["step_seconds"])
    best = trials[0]
    runner = next((t for t in trials[1:] if (t["drafter"], t["k"], t["mode"]) != (best["drafter"], best["k"],
                                                                                   best["mode"])), None)
    return {"best": best, "runner_up": runner, "sync_ar_step_seconds": sync_ar, "trials": len(trials)}


def format_advice(a: dict) -> str:
    def line(t: dict) -> str:
        mode = "sync" if t["mode"] == "sync" else f"async lag {t['policy_lag']}, gen fraction {t['gen_gpu_fraction']}"
        return (f"drafter {t['drafter']} k={t['k']} ({mode}): {t['step_seconds']:.2f} s/step, rollout "
                f"{t['rollout_speedup']:.2f}x, step {t['step_speedup']:.2f}x vs AR in that mode, "
                f"{t['speedup_vs_sync_ar']:.2f}x vs sync AR")
    out = [f"searched {a['trials']} configurations; sync autoregressive: {a['sync_ar_step_seconds']:.2f} s/step",
           "best:      " + line(a["best"])]
    if a["runner_up"]:
        out.append("runner-up: " + line(a["runner_up"]))
    return "\n".join(out)

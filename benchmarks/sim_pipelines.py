"""The simulator's sync and async pipeline models against measured specrl runs (no engine, pure arithmetic).

Run: .venv/bin/python benchmarks/sim_pipelines.py RUNSET [--prompt-tokens N] [--cpu-profile PATH]

RUNSET is a directory written by `benchmarks/pipelines.py --keep-runs` (sync-ar, sync-spec, async-ar, async-spec run
dirs; without --keep-runs that script removes them).
For each arm, `specrl simulate --from-run` predicts the stage times on the measured `cpu` profile with the
calibrated CPU factors (async arms: one device per rollout worker and one for the learner, each with its own
cores). Printed per arm: measured vs predicted step time and exposed generation (how long the learner waited
for rollouts per step), the producer's generation time, the async-over-sync step ratio (async-X vs sync-X,
the same drafter), and, to separate the pipeline rule from the stage costs, the rule
step = max(P, C, (P + C) / (L + 1)) applied to the *measured* producer time P (refit + generation) and learner
time C (data + publish + logprob + train).

Runs that recorded every step's response lengths are predicted step by step (median of per-step predictions).
`--cpu-profile benchmarks/data/cpu_2core_1thread.json` is this 2-core machine's profile with its one-thread GEMV
bandwidth (measured with the other core busy, as an async actor's neighbour is), which the cached profile lacks.
The first line and the closing JSON's `"hardware"` name this machine's processor class and cores and the runs'
dtypes (from the first arm's config.yaml), which the simulation prices.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path

import yaml

from specrl.sim.calibration.fromrun import predict_run, run_records

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import run_header  # noqa: E402

ARMS = ("sync-ar", "sync-spec", "async-ar", "async-spec")


def run_dtypes(run: Path) -> dict[str, str]:
    """The dtypes a measured run recorded in its config.yaml (resolved there; {} where it has none)."""
    path = run / "config.yaml"
    if not path.exists():
        return {}
    cfg = yaml.safe_load(path.read_text()) or {}
    got = {"rollout": (cfg.get("model") or {}).get("rollout_dtype"),
           "train": (cfg.get("policy") or {}).get("precision")}
    return {k: str(v) for k, v in got.items() if v is not None}


def measured(run: Path) -> dict:
    rows = run_records(run)
    steady = rows[1:] or rows

    def med(get) -> float:
        return statistics.median(float(get(r) or 0.0) for r in steady)

    st = {s: med(lambda r, s=s: r.stage_seconds.get(s, 0.0)) for s in ("data", "prepare", "gen", "logprob", "train")}
    out = {"step": med(lambda r: r.step_seconds), "exposed": st["gen"], "stages": st,
           "producer_gen": med(lambda r: r.async_fields and r.async_fields.gen_seconds_workers) or st["gen"],
           "refit": med(lambda r: r.async_fields and r.async_fields.refit_seconds)}
    out["P"] = out["refit"] + out["producer_gen"]
    out["C"] = st["data"] + st["prepare"] + st["logprob"] + st["train"]
    return out


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("runset")
    ap.add_argument("--prompt-tokens", type=int, default=120)
    ap.add_argument("--cpu-profile", default=None)
    ap.add_argument("--lag", type=int, default=1, help="max_trajectory_age_steps of the async arms (for the rule)")
    a = ap.parse_args()
    root = Path(a.runset)
    hw = run_header(run_dtypes(root / ARMS[0]))
    res = {}
    for arm in ARMS:
        m = measured(root / arm)
        p = predict_run(root / arm, cpu_profile=a.cpu_profile, prompt_tokens=a.prompt_tokens)
        by = {r["stage"]: r for r in p["rows"]}
        res[arm] = {"m": m, "step": by["step"]["predicted"], "exposed": by["exposed gen"]["predicted"],
                    "gen": by["gen"]["predicted"]}
    print(f"{'arm':<11}{'step meas':>10}{'pred':>8}{'err':>8}{'exposed meas':>14}{'pred':>7}{'gen meas':>10}"
          f"{'pred':>8}{'async/sync meas':>17}{'pred':>7}{'rule on measured P,C':>22}")
    for arm in ARMS:
        r, m = res[arm], res[arm]["m"]
        err = (r["step"] - m["step"]) / m["step"]
        ratio = ""
        if arm.startswith("async"):
            s = res["sync" + arm[5:]]
            ratio = f"{s['m']['step'] / m['step']:>16.2f}x{s['step'] / r['step']:>6.2f}x"
            rule = max(m["P"], m["C"], (m["P"] + m["C"]) / (a.lag + 1))
            ratio += f"{rule:>14.2f} s ({100 * (rule - m['step']) / m['step']:+.0f}%)"
        print(f"{arm:<11}{m['step']:>10.2f}{r['step']:>8.2f}{100 * err:>+7.0f}%{m['exposed']:>14.2f}"
              f"{r['exposed']:>7.2f}{m['producer_gen']:>10.2f}{r['gen']:>8.2f}{ratio}")
    print(json.dumps({"hardware": hw, **{arm: {"measured_step": res[arm]["m"]["step"],
                                               "predicted_step": res[arm]["step"]} for arm in ARMS}}))


if __name__ == "__main__":
    main()

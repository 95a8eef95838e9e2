"""Sync vs async GRPO, autoregressive vs speculative rollouts: four pipelines on one config, back to back.

Arms (same config, seeds, data and machine; each a separate `specrl train` process so thread settings cannot
leak between them):
  sync-ar     pipeline.mode=sync, speculative.drafter=none; torch uses all --threads cores for both phases
  sync-spec   pipeline.mode=sync with the config's drafter
  async-ar    pipeline.mode=async, 1 rollout worker + 1 learner, lag --lag (IS on), drafter none
  async-spec  the same with the config's drafter
The cores are split in async (worker_threads + learner_threads = --threads). Reported per arm over the steps
after the first (warm-up: model loading, first drafter catch-up): median step time, steps per hour, exposed
generation per step (sync: the gen stage; async: the learner waiting for rollouts), gen share of the step, and
the last validation accuracy; the ratio to sync-ar. For async arms it also checks the simulator's pipeline rule
(`specrl.sim.pipeline.combine`: step = max(P, C, (P + C) / (L + 1)), P = publish + refit + generation on the
workers, C = data + logprob + train on the learner) on the run's own measured stage costs against its measured
step time: a check of the overlap model, not of the per-stage cost model. Also writes an overlay of train
reward over wall-clock time. pipelines.md and pipelines.json (`"hardware"`) name the processor class, cores,
threads and the dtypes the config resolves to on this machine. The arms' run directories (OUT/<arm>) are removed
at the end unless --keep-runs; pipelines.{md,json} and pipelines_reward.png stay.

    .venv/bin/python benchmarks/pipelines.py --config examples/short.yaml --steps 8 --out runs/pipelines
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
ARMS = ("sync-ar", "sync-spec", "async-ar", "async-spec")
sys.path.insert(0, str(ROOT / "benchmarks"))
from common import KEEP_RUNS_HELP, config_dtypes, hardware_line, run_dirs, run_header  # noqa: E402

from specrl.observability.step_record import read_records  # noqa: E402


def arm_sets(arm: str, threads: int, lag: int) -> list[str]:
    sets = []
    if arm.endswith("-ar"):
        sets += ["speculative.drafter=none", "drafter.online=false"]
    if arm.startswith("async"):
        sets += ["pipeline.mode=async", "pipeline.num_rollout_workers=1", f"pipeline.worker_threads={threads // 2}",
                 f"pipeline.learner_threads={threads - threads // 2}", f"pipeline.max_trajectory_age_steps={lag}",
                 f"grpo.importance_sampling_correction={'true' if lag > 0 else 'false'}"]
    else:
        sets += ["pipeline.mode=sync"]
    return sets


def run_arm(config: str, arm: str, steps: int, threads: int, lag: int, out: Path, extra: list[str]) -> float:
    sets = [f"run.steps={steps}", "run.progress=false", "run.checkpoint_every=0", "run.tensorboard=false",
            f"grpo.val_every={steps}", *extra, *arm_sets(arm, threads, lag)]
    cmd = [sys.executable, "-m", "specrl.cli", "train", "--config", config, "--out", str(out / arm),
           "--set", "run.overwrite=true", *[x for s in sets for x in ("--set", s)]]
    env = {**os.environ, "OMP_NUM_THREADS": str(threads), "HF_HUB_OFFLINE": "1"}
    t0 = time.time()
    proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True)
    if proc.returncode != 0:
        raise SystemExit(f"{arm} failed:\n{proc.stderr[-3000:]}")
    return time.time() - t0


def summarize(run_dir: Path) -> dict:
    recs = read_records(run_dir / "metrics.jsonl")
    tail = recs[1:] or recs
    step = statistics.median(r.step_seconds for r in tail)
    exposed = statistics.median(r.async_fields.exposed_gen_seconds if r.async_fields else r.stage_seconds["gen"]
                                for r in tail)
    val = read_records(run_dir / "validation.jsonl")
    als = [r.acceptance_length for r in tail if r.acceptance_length is not None]
    predicted = None
    if tail[0].async_fields is not None:  # async: the simulator's pipeline rule on this run's measured stage costs
        from specrl.sim.pipeline import combine

        lag = int(tail[0].async_fields.max_trajectory_age_steps)
        preds = []
        for r in tail:
            st = dict(r.stage_seconds)
            st["gen"] = r.async_fields.gen_seconds_workers + r.async_fields.refit_seconds  # the generation side
            st["prepare"] = r.async_fields.publish_seconds
            preds.append(combine(st, "async", lag)[0])
        predicted = statistics.median(preds)
    return {"steps": len(recs), "step_seconds_median": step, "steps_per_hour": 3600.0 / step,
            "exposed_gen_seconds_median": exposed, "gen_share": exposed / step,
            "sim_pipeline_step_seconds": predicted,
            "acceptance_length_mean": statistics.mean(als) if als else None,
            "accuracy_first": val[0].accuracy if val else None,
            "accuracy_last": val[-1].accuracy if val else None,
            "reward_curve": [(sum(x.step_seconds for x in recs[: i + 1]), r.reward_mean)
                             for i, r in enumerate(recs)]}


def main(argv: list[str] | None = None) -> Path:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--config", default="examples/short.yaml")
    ap.add_argument("--steps", type=int, default=8)
    ap.add_argument("--threads", type=int, default=2, help="cores for every arm (async splits them)")
    ap.add_argument("--lag", type=int, default=1, help="async max_trajectory_age_steps")
    ap.add_argument("--arms", default=",".join(ARMS))
    ap.add_argument("--out", default="runs/pipelines")
    ap.add_argument("--set", dest="sets", action="append", default=[], metavar="KEY=VALUE")
    ap.add_argument("--keep-runs", action="store_true", help=KEEP_RUNS_HELP + ": here OUT/<arm>")
    a = ap.parse_args(argv)
    hw = run_header(config_dtypes(str(ROOT / a.config), a.sets), a.threads)
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    arms = a.arms.split(",")
    bad = [x for x in arms if x not in ARMS]
    if bad:
        raise SystemExit(f"--arms: unknown {bad}; choose from {list(ARMS)}")
    results = {}
    with run_dirs(a.keep_runs) as dirs:
        for arm in arms:
            dirs.add(out / arm)
            wall = run_arm(a.config, arm, a.steps, a.threads, a.lag, out, a.sets)
            results[arm] = {**summarize(out / arm), "wall_seconds": wall}
            print(f"[pipelines] {arm}: {results[arm]['step_seconds_median']:.1f} s/step", flush=True)
    base = results.get("sync-ar", {}).get("step_seconds_median")
    lines = [f"hardware: {hardware_line(hw)}", "",
             f"config {a.config}, {a.steps} steps per arm (medians over steps 2..{a.steps}), {a.threads} cores, "
             f"async lag {a.lag}", "",
             "| pipeline | s/step | steps/h | × sync-ar | exposed gen s/step | gen share | mean AL "
             "| val acc first → last | simulator pipeline rule, s/step (error) |",
             "|---|---|---|---|---|---|---|---|---|"]
    for arm, r in results.items():
        ratio = f"{base / r['step_seconds_median']:.2f}×" if base else "n/a"
        al = f"{r['acceptance_length_mean']:.2f}" if r["acceptance_length_mean"] else "—"
        p = r["sim_pipeline_step_seconds"]
        sim = f"{p:.1f} ({(p - r['step_seconds_median']) / r['step_seconds_median']:+.0%})" if p else "—"
        lines.append(f"| {arm} | {r['step_seconds_median']:.1f} | {r['steps_per_hour']:.0f} | {ratio} | "
                     f"{r['exposed_gen_seconds_median']:.2f} | {r['gen_share']:.2f} | {al} | "
                     f"{r['accuracy_first']} → {r['accuracy_last']} | {sim} |")
    table = "\n".join(lines)
    (out / "pipelines.md").write_text(table + "\n")
    (out / "pipelines.json").write_text(json.dumps({"hardware": hw, **results}, indent=2) + "\n")
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4))
    for arm, r in results.items():
        xs, ys = zip(*r["reward_curve"], strict=True)
        ax.plot(xs, ys, "-o", ms=3, label=arm)
    ax.set_xlabel("wall-clock seconds of training steps")
    ax.set_ylabel("train reward (mean)")
    ax.set_title("reward vs time: sync / async × AR / speculative")
    ax.legend(fontsize=8)
    ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(out / "pipelines_reward.png", dpi=110)
    print(table, flush=True)
    return out


if __name__ == "__main__":
    main()

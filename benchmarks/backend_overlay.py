"""Sync GRPO on the vLLM backend learning like the native one: the same config, seeds and drafter, back to back.

Arms (each a separate `specrl train` process): `native` in specrl's venv and `vllm` in the vLLM venv
(`make venv-vllm`), both with `speculative.verify=rejection` (vLLM has no seed_exact), a fixed k (vLLM has no
auto k) and the config's drafter; with eagle:default both run the same head, trained online by the learner and
refit into the backend every step. Writes `overlay.png` (train reward and validation accuracy against step and
against wall-clock time, both arms) and `overlay.md` (step time, generation share, mean AL, token_mult_prob_error
of the backend's behaviour log-probs against the learner's, validation first -> last); both record the processor
class, cores, threads and the dtypes the config resolves to on this machine (`"hardware"` in overlay.json). The
arms' run directories (OUT/native, OUT/vllm) are removed at the end unless --keep-runs; overlay.{png,md,json} stay.

    .venv/bin/python benchmarks/backend_overlay.py --steps 12 --out runs/backend-overlay
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
sys.path.insert(0, str(ROOT / "benchmarks"))
from common import KEEP_RUNS_HELP, config_dtypes, hardware_line, run_dirs, run_header  # noqa: E402

from specrl.observability.step_record import StepRecord, read_records  # noqa: E402

PYTHONS = {"native": ROOT / ".venv" / "bin" / "python", "vllm": ROOT / ".venv-vllm" / "bin" / "python"}


def arm_sets(arm: str, a) -> list[str]:
    """The --set overrides of one arm's `specrl train`."""
    return [f"run.steps={a.steps}", "run.progress=false", "run.checkpoint_every=0", "run.tensorboard=false",
            "run.overwrite=true", f"grpo.val_every={a.val_every}", "speculative.verify=rejection",
            f"speculative.num_draft_tokens={a.k}", f"run.threads={a.threads}", f"rollout.backend={arm}", *a.sets]


def run_arm(arm: str, a, out: Path) -> float:
    sets = arm_sets(arm, a)
    cmd = [str(PYTHONS[arm]), "-m", "specrl.cli", "train", "--config", a.config, "--out", str(out / arm),
           *[x for s in sets for x in ("--set", s)]]
    env = {**os.environ, "OMP_NUM_THREADS": str(a.threads), "HF_HUB_OFFLINE": "1",
           "VLLM_CPU_OMP_THREADS_BIND": "0" if a.threads == 1 else f"0-{a.threads - 1}"}
    t0 = time.time()
    proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True)
    if proc.returncode != 0:
        raise SystemExit(f"{arm} failed:\n{proc.stdout[-2000:]}\n{proc.stderr[-4000:]}")
    return time.time() - t0


def load(run_dir: Path) -> tuple[list[StepRecord], list[StepRecord]]:
    return read_records(run_dir / "metrics.jsonl"), read_records(run_dir / "validation.jsonl")


def summary(recs: list[StepRecord], val: list[StepRecord]) -> dict:
    tail = recs[1:] or recs
    als = [r.acceptance_length for r in tail if r.acceptance_length is not None]
    tmpe = [r.token_mult_prob_error for r in recs if r.token_mult_prob_error is not None]
    return {"step_seconds_median": statistics.median(r.step_seconds for r in tail),
            "gen_share_median": statistics.median(r.gen_share for r in tail),
            "acceptance_length_mean": statistics.mean(als) if als else None,
            "token_mult_prob_error_mean": statistics.mean(tmpe) if tmpe else None,
            "reward_first_quarter": statistics.mean(r.reward_mean for r in recs[: max(1, len(recs) // 4)]),
            "reward_last_quarter": statistics.mean(r.reward_mean for r in recs[-max(1, len(recs) // 4):]),
            "validation": [(v.step, v.accuracy) for v in val]}


def plot(runs: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(11, 4))
    for arm, (recs, val) in runs.items():
        steps = [r.step for r in recs]
        wall = [sum(x.step_seconds for x in recs[: i + 1]) for i in range(len(recs))]
        line = ax1.plot(steps, [r.reward_mean for r in recs], label=f"{arm}: train reward")[0]
        ax1.plot([v.step for v in val], [v.accuracy for v in val], "o--", color=line.get_color(),
                 label=f"{arm}: validation accuracy")
        ax2.plot(wall, [r.reward_mean for r in recs], color=line.get_color(), label=arm)
    ax1.set_xlabel("step")
    ax1.set_ylabel("reward / accuracy")
    ax1.legend(fontsize=8)
    ax2.set_xlabel("wall-clock seconds (sum of step times)")
    ax2.set_ylabel("train reward")
    ax2.legend(fontsize=8)
    fig.suptitle("sync GRPO: native engine vs vLLM backend (same config, seeds, drafter)")
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main(argv: list[str] | None = None) -> Path:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--config", default="examples/short.yaml")
    ap.add_argument("--steps", type=int, default=12)
    ap.add_argument("--val-every", type=int, default=6)
    ap.add_argument("--k", type=int, default=3)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--out", default="runs/backend-overlay")
    ap.add_argument("--set", dest="sets", action="append", default=[], metavar="KEY=VALUE")
    ap.add_argument("--keep-runs", action="store_true", help=KEEP_RUNS_HELP + ": here OUT/native and OUT/vllm")
    a = ap.parse_args(argv)
    hw = run_header(config_dtypes(str(ROOT / a.config), arm_sets("vllm", a)), a.threads)
    for arm, py in PYTHONS.items():
        if not py.exists():
            raise SystemExit(f"{py} is missing: run `make install` and `make venv-vllm` first ({arm} arm)")
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    runs, rows = {}, []
    with run_dirs(a.keep_runs) as dirs:
        for arm in PYTHONS:
            dirs.add(out / arm)
            wall = run_arm(arm, a, out)
            runs[arm] = load(out / arm)
            s = {**summary(*runs[arm]), "wall_seconds": wall}
            rows.append((arm, s))
            print(f"[overlay] {arm}: {s['step_seconds_median']:.1f} s/step, wall {wall:.0f} s", flush=True)
    plot(runs, out / "overlay.png")
    lines = [f"hardware: {hardware_line(hw)}", "",
             f"config {a.config}, {a.steps} steps, verify rejection, k={a.k}, {a.threads} threads", "",
             "| backend | s/step | gen share | mean AL | token_mult_prob_error | train reward first → last quarter "
             "| validation (step: accuracy) |", "|---|---|---|---|---|---|---|"]
    for arm, s in rows:
        al = f"{s['acceptance_length_mean']:.2f}" if s["acceptance_length_mean"] else "—"
        tm = f"{s['token_mult_prob_error_mean']:.3f}" if s["token_mult_prob_error_mean"] else "—"
        val = ", ".join(f"{st}: {acc:.3f}" for st, acc in s["validation"])
        lines.append(f"| {arm} | {s['step_seconds_median']:.1f} | {s['gen_share_median']:.2f} | {al} | {tm} | "
                     f"{s['reward_first_quarter']:.3f} → {s['reward_last_quarter']:.3f} | {val} |")
    table = "\n".join(lines)
    (out / "overlay.md").write_text(table + "\n")
    (out / "overlay.json").write_text(json.dumps({"hardware": hw, **dict(rows)}, indent=2) + "\n")
    print(table)
    return out


if __name__ == "__main__":
    sys.exit(main() and 0)

"""Several overlay runs (the same compare with different `run.seed`) read together: does speculation change what
is learned, with the spread between training runs counted?

One compare's TOST (compare.json, `learning.final_equivalence`) asks whether the two final policies score alike on
the held-out questions; its standard error is the questions' sampling only. Two GRPO runs of the same arm with
different samples can end far apart (a few prompts per step, a policy that finds short answers at step 10 or at
step 40), so a gap between one pair of arms is not evidence about the decoder. This reads the compares RUN... (each
holds autoregressive/ and speculative/ with `validation.jsonl`, `metrics.jsonl` and `config.yaml`), takes each
arm's held-out accuracy at one evaluation step (the last one all runs reached, or --step), and prints a markdown
table: per run its seed and both arms' accuracies, then each arm's mean and spread over runs against the mean
binomial SE of one evaluation, and `learning.tost_runs`: Welch's TOST of the arms' mean final accuracies with the
spread between runs as the noise, and Welch's test of a difference; then the reward signal over the runs
(`learning.signal` of each arm's metrics): the untrained policy's step-0 success rate (each run's first rollouts of
both arms, one mean per run, its SE from the spread between runs) and the share of groups with a non-zero
advantage over all steps. `--plot PATH` draws both arms' reward (a
5-step moving mean) and held-out accuracy per run (thin) and over runs (thick).

`--plan FILE` reads a test fixed before its runs (docs/plans/overlay_seeds.yaml: seeds, step, margin, alpha,
processor class) and refuses to report it until the compares given are exactly the planned seeds, each arm's every
step ran on the planned class and all reached the planned step: the number of runs cannot follow the p-value.
`--plan FILE --status` shows where each planned seed stands (steps, last evaluation, class) without the test.

    .venv/bin/python tools/overlay_seeds.py runs/overlay runs/overlay_s1 runs/overlay_s2 --plot seeds.png
    .venv/bin/python tools/overlay_seeds.py --plan docs/plans/overlay_seeds.yaml runs/overlay runs/overlay_s*
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import yaml

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from specrl.errors import SpecRLError  # noqa: E402
from specrl.observability.learning import (  # noqa: E402
    EQUIVALENCE_ALPHA,
    EQUIVALENCE_MARGIN,
    accuracy_points,
    reward_curve,
    signal,
    tost_runs,
)
from specrl.observability.step_record import read_records  # noqa: E402

ARMS = ("speculative", "autoregressive")
SMOOTH = 5


def read_run(run: Path, started: bool = False) -> dict:
    """{"seed", "acc": {arm: {step: point}}, "reward": {arm: reward_curve}} of one compare directory. `started`: a
    compare set up but not yet validated (config.yaml, no validation.jsonl) reads with no evaluations."""
    out: dict = {"run": str(run), "acc": {}, "reward": {}}
    for arm in ARMS:
        d = run / arm
        val, cfg = d / "validation.jsonl", d / "config.yaml"
        if started and cfg.exists() and not val.exists():
            val = None
        elif not val.exists() or not cfg.exists():
            raise SpecRLError(f"{d} has no validation.jsonl or config.yaml: pass compare directories (`specrl run` "
                              f"or `specrl train --compare`), each holding {' and '.join(ARMS)}/")
        seed = ((yaml.safe_load(cfg.read_text(encoding="utf-8")) or {}).get("run") or {}).get("seed", 0)
        if out.setdefault("seed", seed) != seed:
            raise SpecRLError(f"{run}: the arms ran with different run.seed ({out['seed']} and {seed}): not one "
                              "compare")
        out["acc"][arm] = {} if val is None else {p["step"]: p for p in accuracy_points(read_records(val, strict=True))}
        records = read_records(d / "metrics.jsonl")
        out["reward"][arm] = reward_curve(records)
        out.setdefault("signal", {})[arm] = signal(records)
        out.setdefault("classes", {})[arm] = sorted({str(r.processor_class) for r in records})
    return out


def pick_step(runs: list[dict], step: int | None) -> int:
    """The evaluation step every run's arms reached: `step` if given, else the last one common to all."""
    common = set.intersection(*(set(r["acc"][a]) for r in runs for a in ARMS))
    if step is not None:
        if step not in common:
            raise SpecRLError(f"--step {step}: not an evaluation step of every run's arms; common steps: "
                              f"{sorted(common) or 'none'}")
        return step
    last = {r["run"]: max(max(r["acc"][a]) for a in ARMS) for r in runs}
    if len(set(last.values())) > 1 or not common:
        raise SpecRLError(f"the runs' last evaluations differ ({last}): finish them (rerun each to continue it) or "
                          f"pass --step with one of {sorted(common) or 'none (no common step)'}")
    return max(common)


PLAN_KEYS = {"config": str, "seeds": list, "step": int, "margin": float, "alpha": float, "processor_class": str}


def read_plan(path: Path) -> dict:
    """A fixed test over seeds (docs/plans/overlay_seeds.yaml), its every key checked."""
    if not path.is_file():
        raise SpecRLError(f"--plan {path}: not a file; pass a plan such as docs/plans/overlay_seeds.yaml")
    plan = yaml.safe_load(path.read_text(encoding="utf-8"))
    if not isinstance(plan, dict) or set(plan) != set(PLAN_KEYS):
        got = sorted(plan) if isinstance(plan, dict) else type(plan).__name__
        raise SpecRLError(f"--plan {path}: holds {got}; a plan holds exactly the keys {sorted(PLAN_KEYS)}")
    for key, kind in PLAN_KEYS.items():
        ok = isinstance(plan[key], kind) or (kind is float and isinstance(plan[key], int))
        if not ok or isinstance(plan[key], bool):
            raise SpecRLError(f"--plan {path}: {key} is {plan[key]!r}; it must be a {kind.__name__}")
    seeds = plan["seeds"]
    if len(seeds) < 2 or len(set(seeds)) < len(seeds) or not all(type(x) is int for x in seeds):
        raise SpecRLError(f"--plan {path}: seeds {seeds!r} must be at least 2 distinct integers")
    return plan


def check_plan(plan: dict, runs: list[dict]) -> None:
    """The compares given are exactly the plan's seeds, and every step of every arm ran on the plan's class."""
    have = {r["seed"] for r in runs}
    missing, extra = sorted(set(plan["seeds"]) - have), sorted(have - set(plan["seeds"]))
    if missing or extra:
        raise SpecRLError(f"the plan's test reads the compares of seeds {plan['seeds']}; missing {missing}, not "
                          f"planned {extra}: run each missing seed (`specrl run --config {plan['config']} --set "
                          "run.seed=S --set run.name=overlay_sS`) and pass exactly the planned compares (--status "
                          "shows where each stands)")
    for r in runs:
        for arm, classes in r["classes"].items():
            if classes != [plan["processor_class"]]:
                raise SpecRLError(f"{r['run']}/{arm}: its steps ran on processor class {classes}; the plan's test "
                                  f"reads runs on {plan['processor_class']} only (run that seed on such a machine)")


def status(plan: dict, runs: list[dict]) -> str:
    """Where each planned seed stands (steps per arm, last evaluation, processor class), without the test."""
    by_seed = {r["seed"]: r for r in runs}
    rows = ["| seed | run | steps (speculative, autoregressive) | last evaluation | processor class | state |",
            "|---|---|---|---|---|---|"]
    done = 0
    for seed in plan["seeds"]:
        r = by_seed.get(seed)
        if r is None:
            rows.append(f"| {seed} | - | - | - | - | not started |")
            continue
        steps = [len(r["reward"][a]) for a in ARMS]
        if not all(r["acc"][a] for a in ARMS):
            rows.append(f"| {seed} | {r['run']} | {steps[0]}, {steps[1]} | - | - | starting |")
            continue
        last = min(max(r["acc"][a]) for a in ARMS)
        classes = sorted({c for a in ARMS for c in r["classes"][a]})
        ok = classes == [plan["processor_class"]]
        finished = last >= plan["step"] and ok
        done += finished
        state = "finished" if finished else ("another processor class" if not ok else "running or stopped")
        rows.append(f"| {seed} | {r['run']} | {steps[0]}, {steps[1]} | {last} | {', '.join(classes)} | {state} |")
    extra = sorted(set(by_seed) - set(plan["seeds"]))
    rows += ["", f"{done} of {len(plan['seeds'])} planned runs finished at step {plan['step']} on "
             f"{plan['processor_class']}" + (f"; not planned: seeds {extra}" if extra else "") +
             "; the test is reported when all have (without --status)."]
    return "\n".join(rows)


def table(runs: list[dict], step: int, margin: float, alpha: float = EQUIVALENCE_ALPHA) -> tuple[str, dict]:
    rows = ["| run | seed | speculative | autoregressive | difference |", "|---|---|---|---|---|"]
    finals: dict[str, list[float]] = {a: [] for a in ARMS}
    ses = []
    for r in runs:
        p = {a: r["acc"][a][step] for a in ARMS}
        for a in ARMS:
            finals[a].append(p[a]["accuracy"])
            ses.append(p[a]["se"])
        cell = {a: f"{p[a]['accuracy']:.3f} ± {p[a]['se']:.3f}" if p[a]["se"] is not None
                else f"{p[a]['accuracy']:.3f}" for a in ARMS}
        rows.append(f"| {r['run']} | {r['seed']} | {cell['speculative']} | {cell['autoregressive']} | "
                    f"{p['speculative']['accuracy'] - p['autoregressive']['accuracy']:+.3f} |")
    t = tost_runs(finals["speculative"], finals["autoregressive"], margin=margin, alpha=alpha)
    lo, hi = t["ci"]
    known = [s for s in ses if s is not None]
    rows += ["", f"Held-out accuracy at step {step} over {len(runs)} runs per arm: speculative {t['mean_a']:.3f} "
             f"(SD {t['sd_a']:.3f}), autoregressive {t['mean_b']:.3f} (SD {t['sd_b']:.3f}); one evaluation's "
             f"binomial SE averages {sum(known) / len(known):.3f}." if known else "",
             f"{t['test']}, margin ±{t['margin']:.2f}, alpha {t['alpha']:g}: difference {t['difference']:+.3f}, "
             f"{t['ci_level']:.0%} CI [{lo:+.3f}, {hi:+.3f}], p = {t['p_value']:.3f} "
             f"({'equivalent' if t['equivalent'] else 'not shown equivalent'}); Welch's t-test of a difference: "
             f"p = {t['difference_p_value']:.3f}."]
    return "\n".join(rows), t


def signal_summary(runs: list[dict]) -> dict:
    """The reward signal over the runs: the step-0 success rate (per run, both arms' first completions pooled: the
    same untrained policy on the same prompts; then the mean over runs, with the spread between runs as its SE, as
    a run's prompts are few) and the groups with a non-zero advantage, over both arms and per arm."""
    rates, completions, prompts = [], 0, 0
    for r in runs:
        firsts = [s for s in r["signal"].values() if s["step0_success_rate"] is not None and s["step0_completions"]]
        n = sum(s["step0_completions"] for s in firsts)
        if n:
            rates.append(sum(s["step0_success_rate"] * s["step0_completions"] for s in firsts) / n)
            completions += n
            prompts += max(s["step0_prompts"] or 0 for s in firsts)
    mean = sum(rates) / len(rates) if rates else None
    se = (sum((x - mean) ** 2 for x in rates) / (len(rates) - 1) / len(rates)) ** 0.5 if len(rates) > 1 else None
    groups = {a: (sum(r["signal"][a]["groups_nonzero_advantage"] for r in runs),
                  sum(r["signal"][a]["groups"] for r in runs)) for a in ARMS}
    return {"step0_success_rate": mean, "step0_success_rate_se": se, "step0_runs": len(rates),
            "step0_completions": completions, "step0_prompts": prompts,
            "groups_nonzero_advantage": {a: g[0] for a, g in groups.items()},
            "groups": {a: g[1] for a, g in groups.items()}}


def signal_line(sig: dict) -> str:
    parts = []
    if sig["step0_success_rate"] is not None:
        se = sig["step0_success_rate_se"]
        parts.append(f"step-0 success {sig['step0_success_rate']:.3f}" +
                     (f" ± {se:.3f} (SE between runs)" if se is not None else "") +
                     f" over {sig['step0_runs']} runs ({sig['step0_completions']} completions of the untrained "
                     f"policy on {sig['step0_prompts']} prompts)")
    nz, total = sum(sig["groups_nonzero_advantage"].values()), sum(sig["groups"].values())
    if total:
        parts.append(f"groups with a non-zero advantage {nz} of {total} ({nz / total:.2f}; " +
                     ", ".join(f"{a} {sig['groups_nonzero_advantage'][a]} of {sig['groups'][a]}" for a in ARMS) + ")")
    return "Reward signal: " + ("; ".join(parts) if parts else "none recorded in the step records") + "."


def _moving_mean(ys: list[float], w: int) -> list[float]:
    return [sum(ys[max(0, i - w + 1): i + 1]) / len(ys[max(0, i - w + 1): i + 1]) for i in range(len(ys))]


def plot(runs: list[dict], path: Path, step: int, t: dict) -> None:
    from specrl.observability.compare_plots import COLORS
    from specrl.observability.run_report import _plt

    plt = _plt()
    fig, (a1, a2) = plt.subplots(1, 2, figsize=(12, 4))
    for arm in ARMS:
        c = COLORS[arm]
        curves = [{p["step"]: p["mean"] for p in r["reward"][arm]} for r in runs]
        for cur in curves:
            xs = sorted(cur)
            a1.plot(xs, _moving_mean([cur[x] for x in xs], SMOOTH), color=c, alpha=0.35, lw=0.8)
        shared = sorted(set.intersection(*(set(cur) for cur in curves)))
        if shared:
            mean = [sum(cur[x] for cur in curves) / len(curves) for x in shared]
            a1.plot(shared, _moving_mean(mean, SMOOTH), color=c, lw=2.2, label=f"{arm}: mean of {len(runs)} runs")
        acc = [r["acc"][arm] for r in runs]
        for a in acc:
            xs = sorted(a)
            a2.plot(xs, [a[x]["accuracy"] for x in xs], "-o", ms=3, color=c, alpha=0.35, lw=0.8)
        shared = sorted(set.intersection(*(set(a) for a in acc)))
        a2.plot(shared, [sum(a[x]["accuracy"] for a in acc) / len(acc) for x in shared], "-s", ms=5, color=c,
                lw=2.2, label=f"{arm}: mean of {len(runs)} runs")
    a1.set_title(f"train reward ({SMOOTH}-step moving mean); thin: one run", fontsize=9)
    a1.set_xlabel("GRPO step")
    a1.set_ylim(0, 1)
    a2.set_title(f"held-out accuracy; step {step}: Welch TOST ±{t['margin']:.2f}, p = {t['p_value']:.3f} "
                 f"({'equivalent' if t['equivalent'] else 'not shown equivalent'})", fontsize=9)
    a2.set_xlabel("GRPO step")
    a2.set_ylim(0, 1)
    for ax in (a1, a2):
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("runs", nargs="+", type=Path, help="compare directories, one per seed")
    ap.add_argument("--step", type=int, default=None, help="the evaluation step to compare (default: the last)")
    ap.add_argument("--margin", type=float, default=None, help=f"equivalence margin (default {EQUIVALENCE_MARGIN})")
    ap.add_argument("--alpha", type=float, default=None, help=f"TOST alpha (default {EQUIVALENCE_ALPHA})")
    ap.add_argument("--plan", type=Path, default=None, help="a test fixed before its runs: its seeds, step, ...")
    ap.add_argument("--status", action="store_true", help="with --plan: where each planned seed stands, no test")
    ap.add_argument("--plot", type=Path, default=None, help="write the figure here (PNG)")
    args = ap.parse_args(argv)
    plan = read_plan(args.plan) if args.plan else None
    if args.status and not plan:
        raise SpecRLError("--status reports a plan's progress: pass --plan docs/plans/overlay_seeds.yaml with it")
    if plan and (args.step, args.margin, args.alpha) != (None, None, None):
        raise SpecRLError("--plan fixes the step, margin and alpha; drop --step, --margin and --alpha, or the plan")
    runs = [read_run(r, started=bool(plan and args.status)) for r in args.runs]
    seeds = [r["seed"] for r in runs]
    if len(set(seeds)) < len(seeds):
        raise SpecRLError(f"runs share a run.seed ({dict(zip(map(str, args.runs), seeds, strict=True))}): a run "
                          "repeated with its seed is not a replicate; give each compare its own run.seed")
    if plan and args.status:
        print(status(plan, runs))
        return 0
    if plan:
        check_plan(plan, runs)
        print(f"plan {args.plan}: {len(plan['seeds'])} runs per arm, step {plan['step']}, margin ±{plan['margin']}, "
              f"alpha {plan['alpha']}, {plan['processor_class']}\n")
        step, margin, alpha = pick_step(runs, plan["step"]), plan["margin"], plan["alpha"]
    else:
        step = pick_step(runs, args.step)
        margin = EQUIVALENCE_MARGIN if args.margin is None else args.margin
        alpha = EQUIVALENCE_ALPHA if args.alpha is None else args.alpha
    text, t = table(runs, step, margin, alpha)
    print(text)
    print(signal_line(signal_summary(runs)))
    if args.plot:
        plot(runs, args.plot, step, t)
        print(f"figure: {args.plot}")
    return 0


if __name__ == "__main__":
    try:
        sys.exit(main())
    except SpecRLError as e:
        sys.exit(f"error: {e}")

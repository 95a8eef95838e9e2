"""Auto k against the measured curve: the speed-up of every fixed k at each active batch size, and what auto chose.

Reads the `--json` output of `benchmarks/spec_vs_ar.py` run with fixed ks and `auto` at several batch sizes (each
point a side-by-side of autoregressive and speculative generation on the same prompts and seeds), prints per batch
size the best fixed k, its speed-up, auto's speed-up and mean k, and whether auto is within 5% of the best fixed k
and not below plain decoding (k = 0, speed-up 1), and draws one plot: speed-up against k per batch size, auto's
point at its mean k.

    .venv/bin/python benchmarks/spec_vs_ar.py --drafters eagle:think --batch-sizes 1,2,4,8 --ks 1,2,3,4,5,6,7,auto \
        --temperature 0.7 --new-tokens 128 --task chain_sum --answer-format reasoning --group 8 --min-requests 8 \
        --max-seq-len 640 --threads 2 --json runs/k_sweep.json
    .venv/bin/python benchmarks/k_decision.py runs/k_sweep.json --out docs/img/k_decision.png \
        [--before runs/k_sweep_before.json]

`--before` takes a second sweep (typically `--ks auto` only, run on the same machine with an earlier controller)
and prints and draws its auto point beside this one's (a hollow marker), so a controller change is shown against
the same measured curve.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections import defaultdict
from pathlib import Path

TOLERANCE = 0.05  # auto must be within 5% of the best fixed k


def summarize(rows: list[dict]) -> list[dict]:
    """Per (drafter, batch size): best fixed k (k = 0 is plain decoding, speed-up 1), auto's speed-up and k."""
    groups: dict[tuple[str, int], list[dict]] = defaultdict(list)
    for r in rows:
        groups[(r["drafter"], r["batch_size"])].append(r)
    out = []
    for (drafter, b), rs in sorted(groups.items()):
        fixed = {0: 1.0, **{r["k"]: r["speedup"] for r in rs if r["k"] != "auto"}}
        auto = next((r for r in rs if r["k"] == "auto"), None)
        best_k = max(fixed, key=fixed.get)
        row = {"drafter": drafter, "batch_size": b, "best_k": best_k, "best_speedup": fixed[best_k],
               "fixed": fixed, "auto_speedup": auto["speedup"] if auto else None,
               "auto_k_mean": auto["k_mean"] if auto else None}
        if auto:
            row["auto_over_best"] = auto["speedup"] / fixed[best_k]
            row["within_tolerance"] = row["auto_over_best"] >= 1 - TOLERANCE
            row["not_below_plain"] = auto["speedup"] >= 1 - TOLERANCE
        out.append(row)
    return out


def before_auto(rows: list[dict]) -> dict[tuple[str, int], dict]:
    """(drafter, batch size) -> the auto row of an earlier sweep."""
    return {(r["drafter"], r["batch_size"]): r for r in rows if r["k"] == "auto"}


def plot(summary: list[dict], out: Path, title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(10, 4.5))
    for i, s in enumerate(summary):
        color = f"C{i}"
        ks = sorted(s["fixed"])
        ax.plot(ks, [s["fixed"][k] for k in ks], "-o", color=color, ms=4, label=f"B = {s['batch_size']}: fixed k")
        if s["auto_speedup"] is not None:
            ax.plot([s["auto_k_mean"]], [s["auto_speedup"]], "*", color=color, ms=14, mec="black",
                    label=f"B = {s['batch_size']}: auto (mean k {s['auto_k_mean']:.1f})")
        if s.get("before_speedup") is not None:
            ax.plot([s["before_k_mean"]], [s["before_speedup"]], "o", mfc="none", mec=color, ms=10, mew=1.5,
                    label=f"B = {s['batch_size']}: auto before (mean k {s['before_k_mean']:.1f})")
    ax.axhline(1.0, color="gray", lw=1, ls="--")
    ax.set_xlabel("draft tokens per step k (0 = plain decoding)")
    ax.set_ylabel("speed-up over plain decoding (tokens/s)")
    ax.set_title(title, fontsize=9)
    ax.legend(fontsize=7, loc="center left", bbox_to_anchor=(1.01, 0.5))
    fig.tight_layout()
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, dpi=120)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("sweep", type=Path, help="spec_vs_ar.py --json output")
    ap.add_argument("--out", type=Path, default=None, help="PNG to draw")
    ap.add_argument("--before", type=Path, default=None, help="an earlier sweep whose auto points to show beside")
    a = ap.parse_args(argv)
    data = json.loads(a.sweep.read_text())
    summary = summarize(data["rows"])
    if a.before is not None:
        before = json.loads(a.before.read_text())
        print(f"before: hardware {before.get('hardware', {})}")
        old = before_auto(before["rows"])
        for s in summary:
            r = old.get((s["drafter"], s["batch_size"]))
            if r is not None:
                s["before_speedup"], s["before_k_mean"] = r["speedup"], r["k_mean"]
                s["before_over_best"] = r["speedup"] / s["best_speedup"]
    hw = data.get("hardware", {})
    print(f"hardware: {hw}")
    print(f"{'drafter':>16} {'B':>3} {'best k':>6} {'best':>6} {'auto':>6} {'auto k':>6} {'auto/best':>9} ok"
          + ("  before/best" if a.before is not None else ""))
    ok = True
    for s in summary:
        good = s.get("within_tolerance", False) and s.get("not_below_plain", False)
        ok &= good
        auto = f"{s['auto_speedup']:.2f}x" if s["auto_speedup"] is not None else "-"
        print(f"{s['drafter'][:16]:>16} {s['batch_size']:>3} {s['best_k']:>6} {s['best_speedup']:>5.2f}x {auto:>6} "
              f"{s['auto_k_mean'] or 0:>6.2f} {s.get('auto_over_best', float('nan')):>9.3f} {'yes' if good else 'NO'}"
              + (f"  {s['before_over_best']:.3f} (k {s['before_k_mean']:.1f})" if "before_over_best" in s else ""))
    if a.out:
        proc = hw.get("processor_class", "?") if isinstance(hw, dict) else "?"
        plot(summary, a.out, f"auto k vs every fixed k, {summary[0]['drafter'] if summary else ''} "
                             f"(processor {proc}, threads {hw.get('threads', '?') if isinstance(hw, dict) else '?'})")
        print(f"plot: {a.out}")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())

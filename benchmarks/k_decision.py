"""Auto k against the measured curve: the speed-up of every fixed k at each active batch size, and what auto chose.

Reads the `--json` output of `benchmarks/spec_vs_ar.py` run with fixed ks and `auto` at several batch sizes (each
point a side-by-side of autoregressive and speculative generation on the same prompts and seeds), prints per batch
size the best fixed k, its speed-up, auto's speed-up and mean k, and whether auto is within 5% of the best fixed k
and not below plain decoding (k = 0, speed-up 1), and draws one plot: speed-up against k per batch size, auto's
point at its mean k.

    .venv/bin/python benchmarks/spec_vs_ar.py --drafters eagle:think --batch-sizes 1,2,4,8 --ks 1,2,3,4,5,6,7,auto \
        --temperature 0.7 --new-tokens 128 --task chain_sum --answer-format reasoning --group 8 --min-requests 8 \
        --max-seq-len 640 --threads 2 --json runs/k_sweep.json
    .venv/bin/python benchmarks/k_decision.py runs/k_sweep.json --out docs/img/k_decision.png
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


def plot(summary: list[dict], out: Path, title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7.5, 4.5))
    for i, s in enumerate(summary):
        color = f"C{i}"
        ks = sorted(s["fixed"])
        ax.plot(ks, [s["fixed"][k] for k in ks], "-o", color=color, ms=4, label=f"B = {s['batch_size']}: fixed k")
        if s["auto_speedup"] is not None:
            ax.plot([s["auto_k_mean"]], [s["auto_speedup"]], "*", color=color, ms=14, mec="black",
                    label=f"B = {s['batch_size']}: auto (mean k {s['auto_k_mean']:.1f})")
    ax.axhline(1.0, color="gray", lw=1, ls="--")
    ax.set_xlabel("draft tokens per step k (0 = plain decoding)")
    ax.set_ylabel("speed-up over plain decoding (tokens/s)")
    ax.set_title(title, fontsize=9)
    ax.legend(fontsize=7, ncol=2)
    fig.tight_layout()
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, dpi=120)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("sweep", type=Path, help="spec_vs_ar.py --json output")
    ap.add_argument("--out", type=Path, default=None, help="PNG to draw")
    a = ap.parse_args(argv)
    data = json.loads(a.sweep.read_text())
    summary = summarize(data["rows"])
    hw = data.get("hardware", {})
    print(f"hardware: {hw}")
    print(f"{'drafter':>16} {'B':>3} {'best k':>6} {'best':>6} {'auto':>6} {'auto k':>6} {'auto/best':>9} ok")
    ok = True
    for s in summary:
        good = s.get("within_tolerance", False) and s.get("not_below_plain", False)
        ok &= good
        auto = f"{s['auto_speedup']:.2f}x" if s["auto_speedup"] is not None else "-"
        print(f"{s['drafter'][:16]:>16} {s['batch_size']:>3} {s['best_k']:>6} {s['best_speedup']:>5.2f}x {auto:>6} "
              f"{s['auto_k_mean'] or 0:>6.2f} {s.get('auto_over_best', float('nan')):>9.3f} {'yes' if good else 'NO'}")
    if a.out:
        proc = hw.get("processor_class", "?") if isinstance(hw, dict) else "?"
        plot(summary, a.out, f"auto k vs every fixed k, {summary[0]['drafter'] if summary else ''} "
                             f"(processor {proc}, threads {hw.get('threads', '?') if isinstance(hw, dict) else '?'})")
        print(f"plot: {a.out}")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())

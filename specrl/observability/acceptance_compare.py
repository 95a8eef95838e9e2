"""The acceptance-length overlay of several runs (e.g. a frozen and an online-trained drafter).

`write_acceptance_compare` writes NAME.png (AL per RL step of each run, crosses where the drafter was refreshed),
NAME.json and NAME.md (`acceptance_compare_table`: mean AL over all steps and over the first and last third of the
steps, drafter updates and refreshes). Reads step records like `specrl.observability.run_report`.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from specrl.observability.run_report import Records, _f, _figure, _finish, _mean, _records, _series


def plot_acceptance_compare(runs: dict[str, Records], path: str | Path,
                            title: str = "acceptance length over RL steps") -> Path:
    """AL per RL step of each run, one line per run; crosses mark steps where the drafter was refreshed."""
    plt, fig, ax = _figure()
    plotted = False
    for name, recs in runs.items():
        recs = _records(recs)
        xs, ys = _series(recs, "acceptance_length")
        if not ys:
            continue
        (line,) = ax.plot(xs, ys, "-o", ms=3, label=name)
        refreshed = {int(r.step) for r in recs if r.draft_refreshed}
        fresh = [(x, y) for x, y in zip(xs, ys, strict=True) if x in refreshed]
        if fresh:
            ax.plot(*zip(*fresh, strict=True), "x", ms=9, mew=2, color=line.get_color(),
                    label=f"{name}: drafter refreshed after this step")
        plotted = True
    if plotted:
        ax.legend(fontsize=8)
    else:
        ax.text(0.5, 0.5, "no run has speculative steps: no acceptance length", ha="center", va="center",
                transform=ax.transAxes)
    return _finish(plt, fig, ax, path, "RL step", "acceptance length (tokens per verify)", title)


def acceptance_compare_table(runs: dict[str, Records]) -> dict[str, dict[str, Any]]:
    """Per run: mean AL over all steps and over the first / last third (max(1, n // 3) of the n steps that
    measured an AL), total drafter updates and refreshes."""
    out = {}
    for name, recs in runs.items():
        recs = _records(recs)
        _, al = _series(recs, "acceptance_length")
        k = max(1, len(al) // 3)
        out[name] = {"steps": len(recs), "acceptance_length_mean": _mean(al),
                     "acceptance_length_first_third": _mean(al[:k]), "acceptance_length_last_third": _mean(al[-k:]),
                     "draft_updates": sum(int(r.draft_updates or 0) for r in recs),
                     "refreshes": sum(bool(r.draft_refreshed) for r in recs)}
    return out


def write_acceptance_compare(out_dir: str | Path, runs: dict[str, Records],
                             name: str = "acceptance_frozen_vs_online") -> tuple[Path, Path, Path]:
    """Write NAME.png (plot_acceptance_compare), NAME.json and NAME.md (acceptance_compare_table)."""
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    png = plot_acceptance_compare(runs, out_dir / f"{name}.png")
    table = acceptance_compare_table(runs)
    jpath = out_dir / f"{name}.json"
    jpath.write_text(json.dumps(table, indent=2) + "\n")
    rows = [
        f"# acceptance length: {' vs '.join(runs)}",
        "",
        "Mean acceptance length (tokens per policy verify) over the first and last third of the RL steps.",
        "",
        "| run | steps | AL, first third | AL, last third | AL, all steps | drafter updates | refreshes |",
        "|---|---|---|---|---|---|---|",
    ]
    for run, t in table.items():
        rows.append(f"| {run} | {t['steps']} | {_f(t['acceptance_length_first_third'], '.3f')} | "
                    f"{_f(t['acceptance_length_last_third'], '.3f')} | {_f(t['acceptance_length_mean'], '.3f')} | "
                    f"{t['draft_updates']} | {t['refreshes']} |")
    rows += ["", f"![acceptance length]({png.name})", ""]
    mpath = out_dir / f"{name}.md"
    mpath.write_text("\n".join(rows) + "\n")
    return png, jpath, mpath

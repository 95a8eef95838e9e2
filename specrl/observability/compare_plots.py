"""The plots of a compare run: both arms' learning curves on one figure, with their uncertainty.

`plot_reward_compare` draws each arm's per-step mean train reward with a band of ±1 standard error
(`specrl.observability.learning.reward_curve`), markers on every step so a 6-step run reads as 6 points per arm, the
x axis in whole steps. `plot_learning` is the overlay figure: the same reward curves on the left and held-out
accuracy of both arms at each evaluation with 95% bands (±1.96 binomial standard errors) on the right, titled with
the equivalence test of the final accuracies when there is one. Matplotlib with the Agg backend (no display).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from specrl.observability.learning import accuracy_points, reward_curve
from specrl.observability.run_report import _plt

COLORS = {"autoregressive": "#3a6ea5", "speculative": "#3aa655"}
OFFSET = {"autoregressive": -0.06, "speculative": 0.06}  # a little apart, so equal points do not hide each other


def _reward_axes(ax, runs: dict[str, Any]) -> None:
    steps: set[int] = set()
    for arm, recs in runs.items():
        pts = reward_curve(recs)
        if not pts:
            continue
        xs = [p["step"] + OFFSET.get(arm, 0.0) for p in pts]
        ys = [p["mean"] for p in pts]
        se = [p["se"] or 0.0 for p in pts]
        c = COLORS.get(arm)
        ax.fill_between(xs, [y - s for y, s in zip(ys, se, strict=True)], [y + s for y, s in zip(ys, se, strict=True)],
                        color=c, alpha=0.18, lw=0)
        ax.errorbar(xs, ys, yerr=se, fmt="-o", ms=4, capsize=2, color=c, label=f"{arm} (±1 SE)")
        steps.update(p["step"] for p in pts)
    if steps:
        ax.set_xticks(sorted(steps) if len(steps) <= 20 else sorted(steps)[:: max(1, len(steps) // 10)])
        ax.legend(fontsize=8)
    else:
        ax.text(0.5, 0.5, "no steps", ha="center", va="center", transform=ax.transAxes)
    ax.set_xlabel("GRPO step")
    ax.set_ylabel("train reward (batch mean)")
    ax.grid(alpha=0.3)


def plot_reward_compare(runs: dict[str, Any], path: str | Path, title: str = "train reward per step, both arms"
                        ) -> Path:
    """Each arm's per-step mean reward with ±1 standard-error bands on one axes."""
    plt = _plt()
    fig, ax = plt.subplots(figsize=(7, 4))
    _reward_axes(ax, runs)
    ax.set_title(title)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return Path(path)


def plot_learning(runs: dict[str, Any], validation: dict[str, Any], path: str | Path,
                  equivalence: dict[str, Any] | None = None, default_n: int | None = None) -> Path:
    """Left: train reward per step of both arms (±1 SE). Right: held-out accuracy of both arms (95% bands)."""
    plt = _plt()
    fig, (a1, a2) = plt.subplots(1, 2, figsize=(12, 4))
    _reward_axes(a1, runs)
    a1.set_title("train reward per step")
    for arm, recs in validation.items():
        pts = accuracy_points(recs, default_n)
        if not pts:
            continue
        xs = [p["step"] for p in pts]
        ys = [p["accuracy"] for p in pts]
        half = [1.96 * (p["se"] or 0.0) for p in pts]
        c = COLORS.get(arm)
        a2.fill_between(xs, [max(0.0, y - h) for y, h in zip(ys, half, strict=True)],
                        [min(1.0, y + h) for y, h in zip(ys, half, strict=True)], color=c, alpha=0.18, lw=0)
        a2.plot(xs, ys, "-s", ms=4, color=c, label=f"{arm} (95% band)")
    a2.set_ylim(0, 1)
    a2.set_xlabel("GRPO step")
    a2.set_ylabel("held-out accuracy (greedy)")
    a2.grid(alpha=0.3)
    if a2.get_legend_handles_labels()[0]:
        a2.legend(fontsize=8)
    t = "held-out accuracy"
    if equivalence:
        t += (f"; final: TOST margin ±{equivalence['margin']:.2f}, p = {equivalence['p_value']:.3f} "
              f"({'equivalent' if equivalence['equivalent'] else 'not shown equivalent'})")
    a2.set_title(t, fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return Path(path)

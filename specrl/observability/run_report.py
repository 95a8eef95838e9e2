"""End-of-run artefacts of one run: `report.md` with PNG plots, and the acceptance-length overlay of several runs.

This module reads step records (`specrl.observability.step_record.StepRecord`, the lines of `metrics.jsonl`) and
writes what a person
looks at after a run: the reward/accuracy curve, stacked stage-time bars per step and acceptance length over
steps (matplotlib, Agg backend, no display needed), plus a short markdown summary that names where the run ran
(`hardware_text`: device, processor class, torch threads, resolved rollout dtype and training precision).
The acceptance-length overlay of several runs is `specrl.observability.acceptance_compare`'s; compare mode's
artefacts (the two arms side by side) are `specrl.run.compare_report`'s and `specrl.observability.compare_plots`'.
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

from specrl.observability.metrics import STAGES, read_jsonl
from specrl.observability.step_record import StepRecord, to_record

Records = list[StepRecord] | list[dict[str, Any]]  # step records; mappings are read as StepRecord.from_json


def _records(records: Records | None) -> list[StepRecord]:
    return [to_record(r) for r in records or []]

_STAGE_COLOR = {"data": "#4c9be8", "prepare": "#b07cc6", "gen": "#3aa655", "logprob": "#e6b800",
                "train": "#d9534f"}


def _plt():
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def _figure():
    """A new 7 x 4 inch single-axes figure: (plt, fig, ax)."""
    plt = _plt()
    fig, ax = plt.subplots(figsize=(7, 4))
    return plt, fig, ax


def _finish(plt, fig, ax, path: str | Path, xlabel: str, ylabel: str, title: str, grid: bool = True) -> Path:
    """Label (and grid) the main axes, save the figure at the report's resolution, close it; return the path."""
    ax.set_xlabel(xlabel)
    ax.set_ylabel(ylabel)
    ax.set_title(title)
    if grid:
        ax.grid(alpha=0.3)
    fig.tight_layout()
    path = Path(path)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def _series(records: list[StepRecord], key: str) -> tuple[list[int], list[float]]:
    """(steps, values) of the StepRecord field `key` over the records where it is a finite number."""
    xs, ys = [], []
    for r in records:
        v = getattr(r, key)
        if isinstance(v, int | float) and not isinstance(v, bool) and math.isfinite(v):
            xs.append(int(r.step))
            ys.append(float(v))
    return xs, ys


def _mean(vals: list[float]) -> float | None:
    return sum(vals) / len(vals) if vals else None


def plot_reward(records: Records, path: Path, title: str = "reward",
                validation: Records | None = None) -> Path:
    records, validation = _records(records), _records(validation)
    plt, fig, ax = _figure()
    xs, ys = _series(records, "reward_mean")
    ax.plot(xs, ys, "-o", ms=3, lw=1, color="#3a6ea5", alpha=0.5, label="train reward (batch mean)")
    w = max(1, min(5, len(ys) // 4))
    if w > 1:
        smooth = [sum(ys[max(0, i - w + 1): i + 1]) / len(ys[max(0, i - w + 1): i + 1]) for i in range(len(ys))]
        ax.plot(xs, smooth, "-", lw=2.2, color="#3a6ea5", label=f"train reward ({w}-step moving mean)")
    ax2 = ax.twinx()
    axs, acc = _series(validation if validation else records, "accuracy")
    if acc:
        ax2.plot(axs, acc, "-s", ms=4, color="#d9534f", label="validation accuracy")
    ax2.set_ylabel("validation accuracy")
    ax2.set_ylim(0, 1)
    lines = ax.get_legend_handles_labels()[0] + ax2.get_legend_handles_labels()[0]
    ax.legend(lines, [ln.get_label() for ln in lines], loc="upper left", fontsize=8)
    return _finish(plt, fig, ax, path, "step", "reward", title)


def plot_stages(records: Records, path: Path, title: str = "stage time per step") -> Path:
    records = _records(records)
    plt, fig, ax = _figure()
    steps = [int(r.step) for r in records]
    bottom = [0.0] * len(records)
    for s in STAGES:
        h = [float(r.stage_seconds.get(s, 0.0)) for r in records]
        ax.bar(steps, h, bottom=bottom, color=_STAGE_COLOR[s], label=s, width=0.8)
        bottom = [b + x for b, x in zip(bottom, h, strict=True)]
    ax.legend(fontsize=8, ncol=5, loc="upper center", bbox_to_anchor=(0.5, -0.15))
    return _finish(plt, fig, ax, path, "step", "seconds", title, grid=False)


def plot_rollout_shape(records: Records, path: Path, max_new_tokens: int | None = None) -> Path | None:
    """Left: histogram of every response length of the run (the tail; a marker at max_new_tokens). Right: active
    sequences per decode step over the last step's rollout (the batch draining while the longest replies finish),
    coloured by the draft length k of each step. None when the records carry no lengths (older runs)."""
    records = _records(records)
    lengths = [n for r in records for n in (r.response_lengths or [])]
    if not lengths:
        return None
    plt = _plt()
    fig, (a1, a2) = plt.subplots(1, 2, figsize=(11, 4))
    a1.hist(lengths, bins=min(40, max(5, len(set(lengths)))), color="#3aa655")
    if max_new_tokens:
        hit = sum(n >= max_new_tokens for n in lengths)
        a1.axvline(max_new_tokens, color="#d9534f", ls="--", label=f"max_new_tokens {max_new_tokens} "
                   f"({hit} of {len(lengths)} hit it)")
        a1.legend(fontsize=8)
    a1.set_xlabel("response tokens")
    a1.set_ylabel("responses")
    a1.set_title(f"response lengths ({len(lengths)} responses, mean {sum(lengths) / len(lengths):.0f})")
    last = next((r for r in reversed(records) if r.batch_trace), None)
    if last is not None:
        t = [row[0] for row in last.batch_trace]
        n = [row[1] for row in last.batch_trace]
        k = [row[2] for row in last.batch_trace]
        a2.step(t, n, where="post", color="gray", lw=1)
        sc = a2.scatter(t, n, c=k, s=6, cmap="viridis", vmin=0, vmax=max(max(k), 1))
        fig.colorbar(sc, ax=a2, label="draft length k of the step (0 = plain)")
        a2.set_title(f"active batch over step {last.step}'s rollout")
    a2.set_xlabel("decode seconds")
    a2.set_ylabel("active sequences")
    a2.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return Path(path)


def plot_acceptance(records: Records, path: Path, title: str = "acceptance length") -> Path:
    records = _records(records)
    plt, fig, ax = _figure()
    xs, ys = _series(records, "acceptance_length")
    if ys:
        ax.plot(xs, ys, "-o", ms=3, color="#3aa655", label="acceptance length (tokens per verify)")
        kx, ky = _series(records, "num_draft_tokens_mean")
        if ky:
            # with auto k the mean includes plain (k=0) steps, so 1 + mean k is not a bound on AL (which counts
            # speculative steps only): it shows how much the engine speculated
            ax.plot(kx, [k + 1 for k in ky], "--", color="gray", label="1 + mean draft length k per engine step "
                    "(k = 0: plain decoding)")
        ax.legend(fontsize=8)
    else:
        ax.text(0.5, 0.5, "autoregressive run: no drafter, no acceptance length", ha="center", va="center",
                transform=ax.transAxes)
    return _finish(plt, fig, ax, path, "step", "tokens per policy forward", title)


_LANE_COLOR = {"gen": "#3aa655", "refit": "#b07cc6", "publish": "#8c6bb1", "logprob": "#e6b800",
               "train": "#d9534f"}


def plot_timeline(events: list[dict], path: Path, title: str = "async pipeline timeline") -> Path:
    """One lane per actor (learner on top, then each rollout worker); bars are generate / refit / logprob /
    train / publish; white space in a lane is that actor idle."""
    plt = _plt()
    lanes = sorted({e["lane"] for e in events}, key=lambda x: (x != "learner", x))
    fig, ax = plt.subplots(figsize=(10, 1.4 + 0.6 * len(lanes)))
    seen = set()
    for y, lane in enumerate(lanes):
        for e in (e for e in events if e["lane"] == lane):
            label = e["kind"] if e["kind"] not in seen else None
            seen.add(e["kind"])
            ax.barh(y, e["end"] - e["start"], left=e["start"], height=0.6, color=_LANE_COLOR.get(e["kind"], "#999"),
                    label=label, edgecolor="none")
    ax.set_yticks(range(len(lanes)), lanes)
    ax.invert_yaxis()
    ax.legend(fontsize=7, loc="upper left", bbox_to_anchor=(1.01, 1.0))
    return _finish(plt, fig, ax, path, "seconds since the run started", "", title, grid=False)


def async_summary(records: Records) -> dict[str, Any] | None:
    """Means of the async pipeline's per-step fields, or None for a sync run."""
    fields = [r.async_fields for r in _records(records)]
    if not fields or fields[0] is None:
        return None
    fields = [f for f in fields if f is not None]

    def mean(key: str) -> float | None:
        return _mean([float(getattr(f, key)) for f in fields if getattr(f, key) is not None])

    return {"exposed_gen_seconds_mean": mean("exposed_gen_seconds"),
            "gen_seconds_workers_mean": mean("gen_seconds_workers"),
            "learner_idle_ratio_mean": mean("learner_idle_ratio"),
            "trajectory_age_mean": mean("trajectory_age_mean"),
            "trajectory_age_max": max(int(f.trajectory_age_max or 0) for f in fields),
            "dropped_stale_groups": sum(int(f.dropped_stale_groups or 0) for f in fields),
            "refit_seconds_mean": mean("refit_seconds"),
            "publish_seconds_mean": mean("publish_seconds")}


LOGPROB_FOLDED = "logprob: folded into train (one update per batch)"


def summarize(records: Records) -> dict[str, Any]:
    """Run-level numbers for report.md and compare.json."""
    records = _records(records)
    if not records:
        return {"steps": 0}
    _, rewards = _series(records, "reward_mean")
    _, acc = _series(records, "accuracy")
    gen = sum(float(r.stage_seconds.get("gen", 0.0)) for r in records)
    total = sum(float(r.step_seconds) for r in records)
    k = max(1, len(rewards) // 4)
    _, al = _series(records, "acceptance_length")
    return {
        "steps": len(records),
        "reward_first": rewards[0] if rewards else None,
        "reward_last": rewards[-1] if rewards else None,
        "reward_first_quarter_mean": _mean(rewards[:k]),
        "reward_last_quarter_mean": _mean(rewards[-k:]),
        "accuracy_first": acc[0] if acc else None,
        "accuracy_last": acc[-1] if acc else None,
        "gen_seconds": gen,
        "step_seconds": total,
        "step_seconds_mean": total / len(records),
        "gen_share": gen / total if total > 0 else None,
        "acceptance_length_mean": _mean(al),
        "generated_tokens": sum(int(r.generated_tokens or 0) for r in records),
        "draft_tokens": _total(records, "draft_tokens"),
        "accepted_tokens": _total(records, "accepted_tokens"),
        "verify_steps": _total(records, "verify_steps"),
        "sequence_steps": _total(records, "sequence_steps"),
    }


def _total(records: list, key: str) -> int | None:
    vals = [getattr(r, key) for r in records if getattr(r, key) is not None]
    return int(sum(vals)) if vals else None


def _f(v: Any, spec: str = ".3f") -> str:
    return "n/a" if v is None else format(v, spec)


def hardware_text(records: Records) -> str:
    """Where the records' steps ran, from their resolved hardware fields: `cpu, processor class AVX512-BF16, 2 torch
    threads; rollouts bfloat16, training bf16-mixed` (a range where the thread count changed between steps)."""
    records = _records(records)

    def values(key: str) -> list:
        return sorted({getattr(r, key) for r in records if getattr(r, key) is not None}, key=str)

    def one(key: str) -> str:
        return " / ".join(str(v) for v in values(key)) or "not recorded"

    threads = sorted({int(r.torch_threads) for r in records if r.torch_threads is not None})
    th = ("" if not threads else f", {threads[0]}–{threads[-1]} torch threads" if len(threads) > 1
          else ", 1 torch thread" if threads[0] == 1 else f", {threads[0]} torch threads")
    return (f"{one('device')}, processor class {one('processor_class')}{th}; rollouts {one('rollout_dtype')}, "
            f"training {one('precision')}")


def write_report(run_dir: str | Path, records: Records, config_text: str = "",
                 extra: dict[str, Any] | None = None, validation: Records | None = None,
                 max_new_tokens: int | None = None) -> Path:
    """Write report.md and its three PNG plots into run_dir; return the path of report.md.

    `validation` (records with `step` and `accuracy`, including step 0 = before training) feeds the accuracy
    curve and the first → last accuracy row; without it the per-step `accuracy` fields are used.
    """
    run_dir = Path(run_dir)
    run_dir.mkdir(parents=True, exist_ok=True)
    records, validation = _records(records), _records(validation)
    plot_reward(records, run_dir / "reward.png", validation=validation)
    plot_stages(records, run_dir / "stages.png")
    plot_acceptance(records, run_dir / "acceptance.png")
    shape = plot_rollout_shape(records, run_dir / "rollout_shape.png", max_new_tokens)
    s = summarize(records)
    if validation:
        _, vacc = _series(validation, "accuracy")
        if vacc:
            s["accuracy_first"], s["accuracy_last"] = vacc[0], vacc[-1]
    lines = [
        f"# specrl run `{run_dir.name}`",
        "",
        f"{s['steps']} GRPO steps.",
        "",
        "| metric | value |",
        "|---|---|",
        f"| train reward, first quarter of steps → last quarter | {_f(s.get('reward_first_quarter_mean'))} → "
        f"{_f(s.get('reward_last_quarter_mean'))} |",
        f"| validation accuracy, first → last evaluation | {_f(s.get('accuracy_first'))} → "
        f"{_f(s.get('accuracy_last'))} |",
        f"| mean step time (s) | {_f(s.get('step_seconds_mean'), '.2f')} |",
        f"| gen share of step time | {_f(s.get('gen_share'), '.2f')} |",
        f"| mean acceptance length | {_f(s.get('acceptance_length_mean'), '.2f')} |",
        f"| generated tokens | {s.get('generated_tokens', 0)} |",
        f"| hardware | {hardware_text(records)} |",
    ]
    for k, v in (extra or {}).items():
        lines.append(f"| {k} | {v} |")
    lines += [
        "",
        "## Reward and validation accuracy",
        "![reward](reward.png)",
        "",
        "## Stage time per step (data → prepare → gen → logprob → train)",
        "![stages](stages.png)",
        "",
        *([LOGPROB_FOLDED, ""] if records and all(r.logprob_skipped for r in records) else []),
        "## Acceptance length (tokens emitted per policy forward during generation)",
        "![acceptance](acceptance.png)",
        "",
        *(["## Rollout shape: response lengths and the active batch over one rollout", "![rollout shape]"
           "(rollout_shape.png)", ""] if shape is not None else []),
        "Per-step numbers: `metrics.jsonl`; live curves: `tensorboard --logdir " + str(run_dir) + "`.",
    ]
    a = async_summary(records)
    events = read_jsonl(run_dir / "timeline.jsonl")  # any JSONL; a torn last line is skipped
    if a is not None:
        lines += ["", "## Async pipeline", "", "| metric | value |", "|---|---|",
                  f"| exposed generation per step (s; the learner waiting for rollouts) | "
                  f"{_f(a['exposed_gen_seconds_mean'], '.2f')} |",
                  f"| generation per step on the workers (s) | {_f(a['gen_seconds_workers_mean'], '.2f')} |",
                  f"| learner idle ratio | {_f(a['learner_idle_ratio_mean'], '.2f')} |",
                  f"| trajectory age, mean / max (policy versions) | {_f(a['trajectory_age_mean'], '.2f')} / "
                  f"{a['trajectory_age_max']} |",
                  f"| stale groups dropped and regenerated | {a['dropped_stale_groups']} |",
                  f"| refit / publish per step (s) | {_f(a['refit_seconds_mean'], '.2f')} / "
                  f"{_f(a['publish_seconds_mean'], '.2f')} |"]
    if events:
        plot_timeline(events, run_dir / "timeline.png")
        lines += ["", "One lane per actor; white space is idle time.", "", "![timeline](timeline.png)"]
    if config_text:
        lines += ["", "## Resolved config", "```yaml", config_text.rstrip(), "```"]
    path = run_dir / "report.md"
    path.write_text("\n".join(lines) + "\n")
    return path

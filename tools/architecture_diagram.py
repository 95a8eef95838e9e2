"""Draw docs/img/architecture.png: specrl's layers, one synchronous RL step, and the asynchronous pipeline.

Run `python tools/architecture_diagram.py [OUT.png]` after changing a layer or the step's data flow, so the picture
in docs/architecture.md stays true. matplotlib only (Agg backend, no display needed).
"""

from __future__ import annotations

import sys
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
from matplotlib.patches import FancyArrowPatch, FancyBboxPatch  # noqa: E402

OUT = Path(__file__).resolve().parents[1] / "docs" / "img" / "architecture.png"

# (rank, [(package, what it holds), ...]), bottom to top; packages of one rank may not import each other
LAYERS = [
    (0, [("specrl.errors · fileio", "SpecRLError · NonFiniteError · atomic writes")]),
    (1, [("cpu · device · plugins", "threads · device · extensions"),
         ("specrl.observability", "step record · metrics writers · run report"),
         ("specrl.checkpoint", "step directories · DCP state")]),
    (2, [("specrl.model", "transformer · HF checkpoints · loader\npresets · packed"),
         ("specrl.data", "tasks · datasets · rewards"),
         ("specrl.config", "the leaf: sections · vllm section\nschema (TrainConfig) · hardware")]),
    (3, [("specrl.rollout", "protocol · drafter protocol · sampling · engine · sequences\n"
                            "spec_decode/: verify · adaptive · seq_budget")]),
    (4, [("specrl.algorithms", "grpo · losses · logprobs · rollouts · batch")]),
    (5, [("specrl.drafters", "registry · kinds/: ngram · suffix · draft_model · eagle · mtp · hybrid\n"
                             "storage/: io · manifest · shipped · default · export\n"
                             "training/: offline · online · DrafterTrainer · build/ (draft init, draft build)")]),
    (6, [("specrl.backends", "registry · vLLM (+ its options, worker) · losslessness probe")]),
    (8, [("specrl.trainer", "config_check · protocol · optim · producer · learner · sync_trainer · weight_sync")]),
    (9, [("specrl.parallel", "FSDP2 learner rank"), ("specrl.sim", "performance simulator · costs/ · calibration/")]),
    (10, [("specrl.run", "loop · session · compare · run directory · certificate")]),
    (11, [("specrl.cluster", "Ray: actors · async driver · learner ranks")]),
    (12, [("specrl.cli · api", "the `specrl` command · train() from Python")]),
    (13, [("specrl.integrations", "TRL's GRPOTrainer: rollout_func")]),
]
PALETTE = ["#e8e8e8", "#d6e6f5", "#d4edda", "#e6dcf0", "#fbe5c8", "#fde2e1", "#fff3bf", "#dfe7ea"]
COLORS = {rank: PALETTE[rank % len(PALETTE)] for rank, _ in LAYERS}
STAGES = [
    ("data", "#4c9be8", "next prompts of\nthe task; n samples\nper prompt (GRPO\ngroups)"),
    ("prepare", "#b07cc6", "learner: WeightSync\n.push(version,\npolicy, drafter)"),
    ("gen", "#3aa655", "producer: requests\n-> Rollouts with\nbehaviour log-probs\n+ spec metrics"),
    ("logprob", "#e6b800", "learner recomputes\nlog-probs under the\npolicy (and drafter\nfeatures)"),
    ("train", "#d9534f", "GRPO clipped loss\n(+ optional TIS);\nthen DrafterTrainer:\nupdate, staleness"),
]


def box(ax, x, y, w, h, color, title=None, body=None, title_size=10, body_size=8, dashed=False, title_dy=0.12,
        body_dy=0.45):
    ax.add_patch(FancyBboxPatch((x, y), w, h, boxstyle="round,pad=0.02,rounding_size=0.08", fc=color, ec="#444",
                                lw=1.0, ls="--" if dashed else "-"))
    if title and body:
        ax.text(x + 0.12, y + h - title_dy, title, ha="left", va="top", fontsize=title_size, weight="bold")
        ax.text(x + 0.12, y + h - body_dy, body, ha="left", va="top", fontsize=body_size, linespacing=1.25)
    elif title:
        ax.text(x + w / 2, y + h / 2, title, ha="center", va="center", fontsize=title_size, weight="bold")


def arrow(ax, a, b, color="#333", dashed=False, rad=0.0, lw=1.4):
    ax.add_patch(FancyArrowPatch(a, b, arrowstyle="-|>", mutation_scale=14, color=color, lw=lw,
                                 ls="--" if dashed else "-", connectionstyle=f"arc3,rad={rad}"))


def draw_layers(ax):
    ax.text(0.3, 9.75, "Layers: a module imports its own package or lower ranks only", fontsize=12,
            weight="bold", va="top")
    ax.text(0.3, 9.38, "enforced by tests/test_layers.py (no upward imports, no cycles)", fontsize=9,
            style="italic", va="top")
    row_h, gap, y0, x0, full_w = 0.6, 0.08, 0.3, 0.3, 6.9
    for i, (rank, packages) in enumerate(LAYERS):
        y = y0 + i * (row_h + gap)
        w = (full_w - 0.1 * (len(packages) - 1)) / len(packages)
        for j, (name, body) in enumerate(packages):
            box(ax, x0 + j * (w + 0.1), y, w, row_h, COLORS[rank], f"{rank}  {name}", body, title_size=8.5,
                body_size=6.6, title_dy=0.06, body_dy=0.25)
    top = y0 + len(LAYERS) * (row_h + gap) - gap
    arrow(ax, (7.55, top - 0.1), (7.55, y0 + 0.1), color="#666", lw=2.2)
    ax.text(7.7, (top + y0) / 2, "imports point down", rotation=-90, ha="left", va="center", fontsize=9,
            color="#444")


def draw_sync_step(ax):
    x0, w, gap, y = 8.35, 1.36, 0.12, 8.55
    ax.text(x0, 9.75, "One synchronous RL step (specrl.trainer.sync_trainer = producer + learner)", fontsize=12,
            weight="bold", va="top")
    centers = []
    for i, (name, color, caption) in enumerate(STAGES):
        x = x0 + i * (w + gap)
        box(ax, x, y, w, 0.55, color, name, title_size=10)
        ax.text(x + 0.05, y - 0.1, caption, ha="left", va="top", fontsize=7.4, linespacing=1.2)
        centers.append(x + w / 2)
        if i:
            arrow(ax, (x - gap - 0.02, y + 0.275), (x + 0.02, y + 0.275))
    bx, bw, by, bh = x0, 5 * w + 4 * gap, 5.0, 1.05
    box(ax, bx, by, bw, bh, "#d4edda", "rollout backend (RolloutBackend protocol: native engine or vLLM)",
        "generate(requests, params) -> GenerationResult    load_weights(which, named_tensors, version)\n"
        "capabilities (verify modes, drafter kinds, max k, exact seeds)    policy_version", title_size=9.5,
        body_size=8)
    p, g = centers[1], centers[2]
    arrow(ax, (p, 7.15), (p, by + bh + 0.04), color="#7a3f95")
    ax.text(p - 0.08, 6.6, "load_weights(\"policy\" |\n\"drafter\", HF names,\nversion)", ha="right",
            va="center", fontsize=7.6, color="#7a3f95")
    arrow(ax, (g - 0.12, 7.05), (g - 0.12, by + bh + 0.04), color="#1e7b34")
    arrow(ax, (g + 0.12, by + bh + 0.04), (g + 0.12, 6.95), color="#1e7b34")
    ax.text(g + 0.24, 6.55, "generate(requests, params)\n-> GenerationResult: token ids,\nbehaviour log-probs, "
            "finish\nreason, policy_version; metrics", ha="left", va="center", fontsize=7.6, color="#1e7b34")


def draw_async(ax):
    x0, y_top = 8.35, 4.45
    ax.text(x0, y_top, "Asynchronous pipeline (specrl.cluster, Ray)", fontsize=12, weight="bold",
            va="top")
    wx, ww, wh = x0, 2.45, 0.78
    ys = [2.9, 1.95, 0.6]
    for y, label in zip(ys, ["rollout worker 1", "rollout worker 2", "rollout worker N"], strict=True):
        box(ax, wx, y, ww, wh, "#d4edda", label, "producer + its own\nbackend + drafter", title_size=9,
            body_size=7.6)
    ax.text(wx + ww / 2, 1.62, "...", ha="center", va="center", fontsize=12)
    bx, bw = 11.3, 1.75
    box(ax, bx, 1.85, bw, 1.0, "#fff3bf", "in-flight groups\n(trajectory buffer)", title_size=9.5)
    lx, lw_ = 13.65, 2.0
    box(ax, lx, 1.85, lw_, 1.0, "#fde2e1", "learner actor", "logprob + train\n(+ drafter)", title_size=9.5,
        body_size=7.6)
    for y in ys:
        arrow(ax, (wx + ww + 0.03, y + wh / 2), (bx - 0.03, 2.35), color="#1e7b34")
    arrow(ax, (bx + bw + 0.03, 2.35), (lx - 0.03, 2.35), color="#a33")
    arrow(ax, (lx + lw_ / 2, 2.9), (wx + ww - 0.3, 3.72), color="#7a3f95", dashed=True, rad=0.25)
    ax.text(12.25, 3.05, "weights + version via the object store,\nonce per optimizer step", ha="center",
            va="bottom", fontsize=7.6, color="#7a3f95")
    ax.text(bx, 1.55, "step s trains only on groups with\npolicy_version >= s - 1 - max_trajectory_age_steps",
            ha="left", va="top", fontsize=7.6, color="#a33")


def main(out: Path = OUT) -> Path:
    fig = plt.figure(figsize=(16, 10))
    ax = fig.add_axes((0, 0, 1, 1))
    ax.set_xlim(0, 16)
    ax.set_ylim(0, 10)
    ax.axis("off")
    draw_layers(ax)
    draw_sync_step(ax)
    draw_async(ax)
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, dpi=100)
    plt.close(fig)
    return out


if __name__ == "__main__":
    print(main(Path(sys.argv[1]) if len(sys.argv) > 1 else OUT))

"""The data-scaling curve of a drafter build: separate trainings on the first N rollout shards, each evaluated.

For every shard count N in the recipe's `curve` below the build's whole data, `run_separate_curve` trains a fresh
head with the recipe's own settings (draft vocabulary chosen by coverage of those N shards' responses, the same
epochs, learning-rate schedule, batch size and seed) on the first N shards' features only, into
`WORK/curve/shards-NNNN/` — resumable from its checkpoint there, like the build's train stage — and evaluates it on
the recipe's held-out prompts at one k. The build's own head (`WORK/train/drafter`, all shards) is the last point.
Rows go to `WORK/eval/curve_separate.json` as each point finishes; a point already evaluated there with the same
k, prompts and length is read back, not redone, so a killed run continues where it stopped. Unlike the snapshot
curve (`release.run_curve`: one training's snapshots), each point here is a full schedule on that much data.
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable
from pathlib import Path

from specrl.drafters.training.build.recipe import Recipe
from specrl.drafters.training.build.stages import (
    _claim,
    _load_target,
    data_root,
    stage_record,
    train_head,
    whole_shards,
)
from specrl.errors import SpecRLError
from specrl.fileio import write_text_atomic

CURVE_FILE = "curve_separate.json"


def curve_dir(work: Path, shards: int) -> Path:
    return Path(work) / "curve" / f"shards-{shards:04d}"


def _read_rows(f: Path) -> list[dict]:
    if not f.exists():
        return []
    try:
        rows = json.loads(f.read_text())
    except json.JSONDecodeError:
        raise SpecRLError(f"{f} is not valid JSON; delete it to evaluate the curve's points again") from None
    return rows if isinstance(rows, list) else []


def run_separate_curve(recipe: Recipe, work: Path, prompts: Callable, target=None, k: int | None = None,
                       n_prompts: int | None = None, max_new_tokens: int | None = None, progress: bool = True,
                       stop_after: int | None = None, log=print, partial: bool = False) -> list[dict]:
    """Train on the first N shards for each N in recipe.curve (below all shards), evaluate each head and the build's
    full head at k on the held-out prompts; returns the rows (also in WORK/eval/curve_separate.json), by N. With
    `partial`, while the data is still being made: only the counts N whose first N shards have rollouts and
    features already, and not the build's own head."""
    from specrl.drafters.storage.io import load_drafter, save_drafter
    from specrl.drafters.training.build.heldout import evaluate_drafter
    from specrl.drafters.training.build.release import _heldout
    from specrl.drafters.training.build.stages import run_features

    _claim(work, recipe)
    full = stage_record(work, "train")
    if not partial and (not full or not full.get("finished")):
        raise SpecRLError(f"build {work}: the build's own head is not trained yet; run `specrl draft build` (its "
                          "train stage) first: the curve's last point is that head")
    counts = sorted({n for n in recipe.curve if n < recipe.n_shards})
    if not counts:
        raise SpecRLError(f"recipe {recipe.name!r}: its curve field lists no shard count below the build's "
                          f"{recipe.n_shards} shards; give counts such as [3, 6, 11, 22]")
    target, tokenizer, stops = _load_target(recipe, target)
    if partial:
        infos, feats = _present(recipe, work, target)
        counts = [n for n in counts if n <= len(feats)]
        if not counts:
            raise SpecRLError(f"build {work}: the first {len(feats)} shards have rollouts and features; the recipe's "
                              f"curve {list(recipe.curve)} has no count within them (run the rollouts and features "
                              "stages further, or give a smaller count in the recipe's curve)")
    else:
        infos = whole_shards(recipe, work)
        feats = run_features(recipe, work, target, progress=progress)  # a no-op when every feature is current
    held = _heldout(recipe, prompts, tokenizer, n_prompts)
    k = k or recipe.k
    length = max_new_tokens or recipe.max_new_tokens
    out_file = work / "eval" / CURVE_FILE
    setting = {"k": k, "prompts": len(held), "max_new_tokens": length, "temperature": recipe.temperature}
    kept = _read_rows(out_file)
    others = [r for r in kept if r.get("setting") != setting]  # other settings' points stay in the file
    rows = [r for r in kept if r.get("setting") == setting]
    done = {r["shards"] for r in rows}
    for n in counts if partial else [*counts, recipe.n_shards]:
        if n in done:
            log(f"[specrl] curve: {n} shards already evaluated, read back from {out_file}")
            continue
        t0 = time.perf_counter()
        if n == recipe.n_shards:
            d = work / "train" / "drafter"
            train = {k_: full.get(k_) for k_ in ("steps", "epochs", "tokens_seen", "seconds", "sequences")}
            train["response_tokens"] = full.get("response_tokens")
            drafter = load_drafter(d, target, expected_kind=recipe.kind)
        else:
            out = curve_dir(work, n)
            d = out / "drafter"
            drafter, res, coverage = train_head(recipe, work, target, infos[:n], feats[:n], out,
                                                progress=progress, stop_after=stop_after, log=log)
            if not res["finished"]:
                log(f"[specrl] curve: the {n}-shard training stopped at step {res['steps']}/{res['total_steps']}; "
                    "run again to continue it")
                return rows
            save_drafter(drafter, d)
            train = {k_: res.get(k_) for k_ in ("steps", "epochs", "tokens_seen", "seconds", "sequences")}
            train["response_tokens"] = sum(f.response_tokens for f in feats[:n])
            train["draft_vocab_size"] = coverage["size"]
        ev = evaluate_drafter(target, drafter, held, recipe.temperature, length, stops, ks=(k,), seed=recipe.seed,
                              cost_batches=(), ttt_steps=recipe.ttt_steps, log=lambda *_: None)
        rows.append({"shards": n, "setting": setting, "train": train, "drafter": str(d),
                     "acceptance_length": ev["acceptance_length"][str(k)], "heldout_top1": ev["heldout_top1"],
                     "seconds": time.perf_counter() - t0})
        rows.sort(key=lambda r: r["shards"])
        log(f"[specrl] curve: {n} shards ({train['response_tokens']} response tokens): AL "
            f"{rows[[r['shards'] for r in rows].index(n)]['acceptance_length']:.3f} at k={k}, "
            f"top-1 {ev['heldout_top1']:.3f}")
        (work / "eval").mkdir(parents=True, exist_ok=True)
        write_text_atomic(out_file, json.dumps(others + rows, indent=1) + "\n")
    return rows


def _present(recipe: Recipe, work: Path, target) -> tuple[list, list]:
    """The longest run of shards 0..m-1 whose rollouts are whole and whose feature files are current (made from
    those shards with the recipe's settings), as (rollout infos, feature infos); nothing is extracted."""
    from specrl.drafters.kinds.eagle import default_layers
    from specrl.drafters.training.build.features import current_features

    root = data_root(work)
    infos = whole_shards(recipe, work, partial=True)
    infos = [s for i, s in enumerate(infos) if s.index == i]  # the unbroken prefix
    layers = default_layers(target.args.num_layers)
    feats = []
    for s in infos:
        try:
            feats += current_features(root / "features", [s], layers, recipe.target_topk, fix="")
        except SpecRLError:
            break
    return infos[: len(feats)], feats


def plot_separate_curve(rows: list[dict], out: Path, title: str, snapshots: list[dict] | None = None) -> Path:
    """AL against the distinct response tokens trained on; the one-run snapshot curve beside it when given."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6.4, 3.8))
    xs = [r["train"]["response_tokens"] / 1e3 for r in rows]
    ax.plot(xs, [r["acceptance_length"] for r in rows], "o-", label="separate trainings on the first N shards "
            "(full schedule each)")
    for r, x in zip(rows, xs, strict=True):
        ax.annotate(f"{r['shards']} sh", (x, r["acceptance_length"]), textcoords="offset points", xytext=(4, -12),
                    fontsize=7)
    if snapshots:
        first = [s for s in snapshots if s.get("epoch", 0) <= 1.0 + 1e-9]
        ax.plot([s["tokens_seen"] / 1e3 for s in first], [s["acceptance_length"] for s in first], "s--",
                alpha=0.6, label="snapshots within epoch 1 of the full training")
    ax.set_xscale("log")
    ax.set_xlabel("distinct response tokens trained on (thousands, log scale)")
    ax.set_ylabel(f"held-out AL at k={rows[0]['setting']['k']}")
    ax.set_title(title, fontsize=9)
    ax.grid(alpha=0.3, which="both")
    ax.legend(fontsize=7, loc="lower right")
    fig.tight_layout()
    Path(out).parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, dpi=120)
    plt.close(fig)
    return Path(out)

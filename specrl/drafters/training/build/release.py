"""Stages 4-5 of `specrl draft build` and the scaling curve: package the trained head, evaluate it honestly.

`run_package` writes the trained head (`WORK/train/drafter`) in the shipped dtype with its manifest into
`WORK/package` (`shipped.package`); `run_eval` runs the evaluator (`heldout.py`) on the packaged head — the files
that ship, in the dtype that ships — on the recipe's held-out prompts (the task's validation split, never rolled
out by the build), at the recipe's temperature and length, writes `WORK/eval/eval.json` and puts the result into
the manifest. `run_curve` evaluates the snapshots the training saved along its one run (`fit.py`: after N/n_shards
of the first epoch for N in recipe.curve, then at the end of each later epoch) at one k, for the scaling curve of
AL against the response tokens the head had trained on, and `plot_curve` draws it.
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable
from pathlib import Path

from specrl.drafters.training.build.recipe import Recipe
from specrl.drafters.training.build.stages import _claim, _load_target, _record, stage_record
from specrl.errors import SpecRLError
from specrl.fileio import write_text_atomic


def _heldout(recipe: Recipe, prompts: Callable, tokenizer, n: int | None) -> list[list[int]]:
    _, held = prompts(tokenizer)
    held = list(held)[: recipe.heldout_prompts if n is None else n]
    if not held:
        raise SpecRLError(f"recipe {recipe.name!r}: the task's validation split gave no held-out prompts")
    return held


def run_package(recipe: Recipe, work: Path, target=None, dest: Path | None = None) -> Path:
    """Stage 4: the trained head in the shipped dtype + manifest (eval filled in by stage 5)."""
    from specrl.drafters.storage.io import load_drafter
    from specrl.drafters.storage.shipped import package, package_size

    _claim(work, recipe)
    train = stage_record(work, "train")
    if not train or not train.get("finished"):
        raise SpecRLError(f"build {work}: the head is not trained yet (no finished {work}/train/stage.json); run "
                          "the train stage first (`specrl draft build --stage train`)")
    target, _, _ = _load_target(recipe, target)
    t0 = time.perf_counter()
    drafter = load_drafter(work / "train" / "drafter", target, expected_kind=recipe.kind)
    keep = ("steps", "epochs", "train_loss", "loss_per_epoch", "tokens_seen", "seconds", "threads", "sequences",
            "response_tokens", "vocab")
    out = package(drafter, target, dest or work / "package", recipe.name, recipe.as_dict(), train["data_hash"],
                  None, extra={"train": {k: train.get(k) for k in keep}})
    _record(work, "package", {"seconds": time.perf_counter() - t0, "dir": str(out), "bytes": package_size(out)})
    return out


def run_eval(recipe: Recipe, work: Path, prompts: Callable, target=None, drafter_dir: Path | None = None,
             ks=None, n_prompts: int | None = None, max_new_tokens: int | None = None, log=print,
             measure_only: bool = False) -> dict:
    """Stage 5: held-out evaluation of the packaged head (or of `drafter_dir`); into WORK/eval and the manifest.
    Each k's measurement is kept in WORK/eval/per_k/ as it finishes, so a killed stage resumes at the first k not
    done; `measure_only` measures `ks` into that folder and stops (separate processes can share the k's)."""
    import hashlib

    import torch

    from specrl.drafters.storage.io import load_drafter
    from specrl.drafters.storage.shipped import FILES, MANIFEST, check_shipped, sha256_of
    from specrl.drafters.training.build.heldout import DEFAULT_KS, evaluate_drafter

    _claim(work, recipe)
    d = Path(drafter_dir) if drafter_dir is not None else work / "package"
    if not (d / "config.json").exists():
        raise SpecRLError(f"no drafter at {d}: run the package stage first (`specrl draft build --stage package`)")
    target, tokenizer, stops = _load_target(recipe, target)
    t0 = time.perf_counter()
    drafter = load_drafter(d, target, expected_kind=recipe.kind)
    held = _heldout(recipe, prompts, tokenizer, n_prompts)
    new_tokens = max_new_tokens or recipe.max_new_tokens
    key = {"files": {f: sha256_of(d / f) for f in FILES},
           "prompts": hashlib.sha256(json.dumps(held).encode()).hexdigest(), "temperature": recipe.temperature,
           "max_new_tokens": new_tokens, "seed": recipe.seed}
    ev = evaluate_drafter(target, drafter, held, recipe.temperature, new_tokens, stops, ks=ks or DEFAULT_KS,
                          seed=recipe.seed, ttt_steps=recipe.ttt_steps, log=log,
                          cache=(work / "eval" / "per_k", key), measure_only=measure_only)
    if measure_only:
        return ev
    ev["drafter"] = str(d)
    (work / "eval").mkdir(parents=True, exist_ok=True)
    write_text_atomic(work / "eval" / "eval.json", json.dumps(ev, indent=1) + "\n")
    if (d / MANIFEST).exists():
        m = check_shipped(d, target)
        m["eval"] = ev
        write_text_atomic(d / MANIFEST, json.dumps(m, indent=1) + "\n")
    _record(work, "eval", {"seconds": time.perf_counter() - t0, "threads": torch.get_num_threads(),
                           "acceptance_length": ev["acceptance_length"]})
    return ev


def run_curve(recipe: Recipe, work: Path, prompts: Callable, target=None, k: int | None = None,
              n_prompts: int | None = None, max_new_tokens: int | None = None, log=print) -> list[dict]:
    """AL at k (default recipe.k) of every training snapshot (and the final head): `WORK/eval/curve.json`."""
    from specrl.drafters.storage.io import load_drafter
    from specrl.drafters.training.build.heldout import evaluate_drafter

    train = stage_record(work, "train")
    if not train or not train.get("snapshots"):
        raise SpecRLError(f"build {work}: no training snapshots to evaluate; run the train stage first")
    target, tokenizer, stops = _load_target(recipe, target)
    held = _heldout(recipe, prompts, tokenizer, n_prompts)
    k = k or recipe.k
    rows = []
    points = list(train["snapshots"])
    if train.get("finished") and not any(s["step"] == train["steps"] for s in points):
        points.append({"step": train["steps"], "epoch": train["epochs"], "tokens_seen": train["tokens_seen"],
                       "path": str(work / "train" / "drafter"), "shards": None})
    for s in points:
        drafter = load_drafter(s["path"], target, expected_kind=recipe.kind)
        ev = evaluate_drafter(target, drafter, held, recipe.temperature, max_new_tokens or recipe.max_new_tokens,
                              stops, ks=(k,), seed=recipe.seed, cost_batches=(), ttt_steps=recipe.ttt_steps,
                              log=lambda *_: None)
        rows.append({**{key: s.get(key) for key in ("step", "epoch", "tokens_seen", "shards")},
                     "k": k, "acceptance_length": ev["acceptance_length"][str(k)], "heldout_top1": ev["heldout_top1"],
                     "prompts": len(held)})
        log(f"[specrl] curve: step {s['step']} ({s['tokens_seen']} tokens seen): AL {rows[-1]['acceptance_length']:.3f}"
            f" at k={k}, top-1 {ev['heldout_top1']:.3f}")
        (work / "eval").mkdir(parents=True, exist_ok=True)
        write_text_atomic(work / "eval" / "curve.json", json.dumps(rows, indent=1) + "\n")
    return rows


def plot_curve(rows: list[dict], out: Path, title: str) -> Path:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    xs = [r["tokens_seen"] / 1e3 for r in rows]
    ys = [r["acceptance_length"] for r in rows]
    fig, ax = plt.subplots(figsize=(6, 3.6))
    ax.plot(xs, ys, "o-")
    for r, x, y in zip(rows, xs, ys, strict=True):
        ax.annotate(f"ep {r['epoch']:.2g}", (x, y), textcoords="offset points", xytext=(4, -12), fontsize=7)
    ax.set_xlabel("response tokens trained on (thousands; epochs 2+ count repeats)")
    ax.set_ylabel(f"held-out AL at k={rows[0]['k']}")
    ax.set_title(title, fontsize=9)
    ax.grid(alpha=0.3)
    fig.tight_layout()
    Path(out).parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, dpi=120)
    plt.close(fig)
    return Path(out)

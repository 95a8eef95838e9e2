"""Seconds per training step of a drafter head (`specrl draft build`'s train stage), to size a recipe's epochs.

Builds fresh heads of each --kinds for the --model target (eagle: EAGLE-3 with --ttt-steps of training-time test;
parallel: max_k drafts per forward) and times `fit`'s step (forward, loss, backward, AdamW) on batches of the
recipe's batch size whose sequence and prompt lengths are those of a build's rollouts (--lengths-from BUILD_DIR:
every row of its whole rollout shards), with random target features and top-K: the step's cost depends on the
shapes, not on the values. --steps batches are timed per (kind, loss), the middle batch of each of --steps equal
slices of the length-sorted batches (so their mean stands for an epoch's), after one warm-up step; the epoch
estimate is that mean times the epoch's steps. Prints one row per (kind, loss) and writes --json ({"hardware":
processor class, cores, threads, dtypes; "rows"}).

    .venv/bin/python benchmarks/drafter_train_step.py --lengths-from builds/think --sequences 2816 \\
        --kinds eagle,parallel --losses ce,ce+tv --steps 6 --threads 1 --json drafter_train_step.json
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import run_header  # noqa: E402


def row_lengths(build: Path) -> list[tuple[int, int]]:
    """(sequence length, prompt length) of every row of a build's rollout shards (damaged or partial ones skipped)."""
    from specrl.drafters.training.build.shards import CorruptShard, check_shard, read_shard

    out = []
    for p in sorted((build / "rollouts").glob("shard-*.jsonl")):
        try:
            check_shard(p)
        except CorruptShard:
            continue
        out += [(len(r["prompt_ids"]) + len(r["response_ids"]), len(r["prompt_ids"])) for r in read_shard(p)]
    if not out:
        raise SystemExit(f"no whole rollout shard under {build / 'rollouts'}")
    return out


def example(n: int, plen: int, t2d, a, vocab: int, feat: int):
    """A training row of n tokens (prompt plen) with random features and top-K (ids in the draft vocabulary)."""
    from specrl.drafters.training.offline import Example

    ids = torch.randint(0, vocab, (n, a.topk))
    return Example(tokens=torch.randint(0, vocab, (n,)), feats=torch.randn(n, feat).bfloat16(),
                   top_idx=ids if t2d is None else t2d[ids], top_p=torch.softmax(torch.randn(n, a.topk), -1).half(),
                   top1=ids[:, 0], loss_from=plen)


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--lengths-from", required=True, type=Path, help="a build directory: its rollouts' lengths")
    ap.add_argument("--kinds", default="eagle,parallel")
    ap.add_argument("--losses", default="ce")
    ap.add_argument("--steps", type=int, default=6, help="timed steps per (kind, loss)")
    ap.add_argument("--sequences", type=int, default=None, help="sequences per epoch (default: the rows read)")
    ap.add_argument("--batch-size", type=int, default=8)
    ap.add_argument("--draft-vocab", type=int, default=8192)
    ap.add_argument("--topk", type=int, default=32)
    ap.add_argument("--ttt-steps", type=int, default=3)
    ap.add_argument("--max-k", type=int, default=7)
    ap.add_argument("--train-dtype", default="bfloat16", choices=("float32", "bfloat16"))
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--json", default=None)
    a = ap.parse_args(argv)
    torch.set_num_threads(a.threads)
    hw = run_header({"train": a.train_dtype}, threads=a.threads)
    from specrl.drafters.trainable import Objective
    from specrl.drafters.training.build.recipe import Recipe, build_class
    from specrl.drafters.training.offline import _pad, batch_loss
    from specrl.model.loader import load_model

    target, _ = load_model(a.model, dtype="float32")
    rows = sorted(row_lengths(a.lengths_from))
    batches = [rows[i: i + a.batch_size] for i in range(0, len(rows), a.batch_size)]
    # the middle batch of each of `steps` equal slices of the length-sorted batches: their mean stands for an epoch's
    picked = [batches[min(int((i + 0.5) * len(batches) / a.steps), len(batches) - 1)] for i in range(a.steps)]
    vocab = list(range(min(a.draft_vocab, target.args.vocab_size)))
    out = []
    for kind in a.kinds.split(","):
        for loss in a.losses.split(","):
            torch.manual_seed(0)
            recipe = Recipe(name="bench", kind=kind, max_k=a.max_k, loss=loss)
            head = build_class(kind).from_recipe(target, recipe, draft_vocab=vocab)
            head.prepare_training(target)
            head.objective = Objective(loss)
            t2d = head.target_to_draft()
            opt = torch.optim.AdamW([p for p in head.parameters() if p.requires_grad], lr=1e-3)
            times = []
            for i, b in enumerate([picked[0], *picked]):
                batch = _pad([example(n, p, t2d, a, len(vocab), 3 * target.args.hidden_size) for n, p in b], "cpu")
                t0 = time.perf_counter()
                with torch.autocast("cpu", dtype=torch.bfloat16, enabled=a.train_dtype == "bfloat16"):
                    value, _ = batch_loss(head, batch, a.ttt_steps)
                opt.zero_grad(set_to_none=True)
                value.backward()
                opt.step()
                if i:  # the first is a warm-up
                    times.append(time.perf_counter() - t0)
            mean = sum(times) / len(times)
            seqs = a.sequences or len(rows)
            steps = math.ceil(seqs / a.batch_size)
            r = {"kind": kind, "loss": loss, "seconds_per_step": mean, "step_seconds": times,
                 "batch_tokens": [sum(n for n, _ in b) for b in picked], "steps_per_epoch": steps,
                 "epoch_seconds": mean * steps, "sequences": seqs,
                 **({"max_k": a.max_k} if kind == "parallel" else {"ttt_steps": a.ttt_steps})}
            print(f"[bench] {kind} {loss}: {mean:.2f} s/step over {len(times)} steps of {a.batch_size} sequences; "
                  f"{steps} steps per epoch of {seqs} sequences -> {mean * steps / 60:.1f} min per epoch",
                  flush=True)
            out.append(r)
    doc = {"hardware": hw, "model": a.model, "lengths_from": str(a.lengths_from), "batch_size": a.batch_size,
           "draft_vocab": len(vocab), "rows": out}
    if a.json:
        Path(a.json).write_text(json.dumps(doc, indent=1) + "\n")
    return doc


if __name__ == "__main__":
    main()

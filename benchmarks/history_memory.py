"""Memory of the history index over a long run: epochs of the same prompts through the suffix drafter's index.

Each epoch indexes `--samples` rollouts of `--tokens` tokens for each of `--prompts` prompts, as a run whose train
split is `--prompts` prompts would (one group per prompt, the rollouts of every epoch kept up to `--max-history`
per prompt, at most `--max-groups` prompts). After each epoch it prints what the index holds (`memory()`: groups,
sequences, tokens, n-gram entries) and the Python heap it takes (tracemalloc), so the plateau the sliding window
sets, and the bytes per held token, are measured rather than assumed. The rollouts are synthetic: a prompt's
samples share long phrases (drawn from a per-prompt phrase book) with random words between, so n-grams repeat
across samples and epochs as in GRPO groups; the index's size depends on the token counts, not on which tokens.
Writes OUT (JSON, with the `"hardware"` record).

    .venv/bin/python benchmarks/history_memory.py --prompts 16 --samples 8 --tokens 512 --epochs 12 \\
        [--max-history 64] [--max-groups 4096] [--out runs/history_memory.json]
"""

from __future__ import annotations

import argparse
import json
import random
import sys
import tracemalloc
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import run_header  # noqa: E402


def rollout(rng: random.Random, phrases: list[list[int]], tokens: int) -> list[int]:
    out: list[int] = []
    while len(out) < tokens:
        out += rng.choice(phrases) if rng.random() < 0.7 else [rng.randrange(49152) for _ in range(rng.randint(1, 4))]
    return out[:tokens]


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--prompts", type=int, default=16)
    ap.add_argument("--samples", type=int, default=8)
    ap.add_argument("--tokens", type=int, default=512)
    ap.add_argument("--epochs", type=int, default=12)
    ap.add_argument("--max-history", type=int, default=None)
    ap.add_argument("--max-groups", type=int, default=None)
    ap.add_argument("--out", type=Path, default=Path("runs/history_memory.json"))
    a = ap.parse_args(argv)
    import torch

    from specrl.drafters.base import DraftBatch
    from specrl.drafters.kinds.suffix import MAX_GROUPS, MAX_HISTORY, SuffixDrafter

    hardware = run_header({}, threads=1)
    drafter = SuffixDrafter(max_history=a.max_history or MAX_HISTORY, max_groups=a.max_groups or MAX_GROUPS)
    rng = random.Random(0)
    books = [[[rng.randrange(49152) for _ in range(rng.randint(3, 12))] for _ in range(40)] for _ in range(a.prompts)]
    rows = []
    tracemalloc.start()
    print(f"{'epoch':>5} {'groups':>6} {'sequences':>9} {'tokens':>9} {'entries':>9} {'heap MB':>8} {'B/token':>8}")
    for epoch in range(a.epochs):
        for p in range(a.prompts):
            seqs = [rollout(rng, books[p], a.tokens) for _ in range(a.samples)]
            n = len(seqs)
            batch = DraftBatch(tokens=seqs, positions=torch.tensor([a.tokens] * n), seeds=torch.full((n,), epoch),
                               request_ids=torch.arange(n), group_ids=[p] * n, temperature=torch.ones(n),
                               top_p=torch.ones(n), top_k=torch.zeros(n, dtype=torch.long))
            drafter.continuations(batch, 3)
        mem = drafter.memory()
        heap = tracemalloc.get_traced_memory()[0]
        row = {"epoch": epoch + 1, **mem, "heap_bytes": heap, "bytes_per_token": heap / max(1, mem["tokens"])}
        rows.append(row)
        print(f"{row['epoch']:>5} {mem['groups']:>6} {mem['sequences']:>9} {mem['tokens']:>9} "
              f"{mem['index_entries']:>9} {heap / 2**20:>8.1f} {row['bytes_per_token']:>8.0f}", flush=True)
    tracemalloc.stop()
    out = {"hardware": hardware, "args": {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(a).items()},
           "max_history": drafter.max_history, "max_groups": drafter.max_groups, "epochs": rows}
    a.out.parent.mkdir(parents=True, exist_ok=True)
    a.out.write_text(json.dumps(out, indent=2) + "\n")
    print(f"[bench] wrote {a.out}")
    return out


if __name__ == "__main__":
    main()

"""What the draft vocabulary's size costs in acceptance, and what it saves in draft cost: the shipped EAGLE head cut.

The shipped `eagle:think` head drafts over 3,687 tokens (the stop tokens, then every response token of its build's
rollouts, most frequent first). This script cuts it to its first N entries (the stop tokens and the N - stops most
frequent tokens: the head's own rows for them, nothing retrained) and runs the drafter evaluator
(`specrl.drafters.training.build.heldout`) on each cut: held-out AL at k (the recipe's held-out prompts, temperature and
length) and the cost c per draft token at B = --cost. A cut can only lose acceptance where the target's sample
falls outside the kept tokens or the dropped rows held the head's argmax, so the AL at N against the full head is
what that vocabulary costs for this head (a head trained at N could place its mass differently; this is the cost
of the cut, not of a retrained head).

    .venv/bin/python benchmarks/draft_vocab_cost.py --sizes 256,512,1024,2048,3687 --prompts 16 --threads 1 \
        [--k 3] [--cost 8] [--json runs/draft_vocab_cost.json]
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import dtype_name, run_header  # noqa: E402


def cut(target, drafter, size: int):
    """A copy of an EAGLE drafter that drafts over the first `size` entries of its draft vocabulary only."""
    from specrl.drafters.kinds.eagle import EagleDrafter
    from specrl.errors import SpecRLError

    full = int(drafter.d2t.numel())
    if not 1 <= size <= full:
        raise SpecRLError(f"--sizes: {size} is outside 1..{full} (the head's draft vocabulary)")
    d = EagleDrafter(target, layers=drafter.fuse_layers, draft_vocab=drafter.d2t[:size].tolist(),
                     intermediate_size=drafter.args.intermediate_size)
    d.load_state_dict({k: v[:size] if k in ("lm_head.weight", "d2t") else v
                       for k, v in drafter.state_dict().items()})
    return d.to(drafter.dtype).eval().requires_grad_(False)


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--sizes", default="256,512,1024,2048,3687", help="draft vocabulary sizes to cut the head to")
    ap.add_argument("--prompts", type=int, default=16, help="held-out prompts (the recipe's validation split)")
    ap.add_argument("--k", type=int, default=3)
    ap.add_argument("--cost", type=int, default=8, help="batch size at which to time the cost c (0: none)")
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--json", default=None)
    a = ap.parse_args(argv)
    import torch

    from specrl.cli.drafts import _recipe_prompts
    from specrl.drafters.storage.default import resolve_drafter
    from specrl.drafters.training.build.heldout import evaluate_drafter
    from specrl.drafters.training.build.stages import _load_target
    from specrl.errors import SpecRLError

    try:
        sizes = sorted({int(x) for x in a.sizes.split(",") if x.strip()})
    except ValueError:
        raise SpecRLError(f"--sizes must be comma-separated integers, got {a.sizes!r}") from None
    torch.set_num_threads(a.threads)
    recipe, source = _recipe_prompts("think")
    hw = run_header({"rollout": dtype_name(recipe.rollout_dtype)}, a.threads)
    target, tokenizer, stops = _load_target(recipe, None)
    shipped = resolve_drafter("eagle:think", target)
    _, held = source(tokenizer)
    held = list(held)[: a.prompts]
    rows = []
    for size in sizes:
        d = cut(target, shipped, size)
        ev = evaluate_drafter(target, d, held, recipe.temperature, recipe.max_new_tokens, stops, ks=(a.k,),
                              seed=recipe.seed, cost_batches=(a.cost,) if a.cost else ())
        c = ev["cost"].get(str(a.cost), {})
        rows.append({"draft_vocab": size, "acceptance_length": ev["acceptance_length"][str(a.k)],
                     "top1": ev["heldout_top1"], "c": c.get("c"), "draft_token_ms": c.get("draft_token_ms"),
                     "plain_step_ms": c.get("plain_step_ms")})
        r = rows[-1]
        print(f"draft vocabulary {size:5d}: AL {r['acceptance_length']:.3f} at k={a.k}, top-1 {r['top1']:.3f}"
              + (f", c {r['c']:.4f} at B={a.cost}" if r["c"] is not None else ""), flush=True)
    out = {"hardware": hw, "k": a.k, "prompts": len(held), "temperature": recipe.temperature,
           "max_new_tokens": recipe.max_new_tokens, "cost_batch": a.cost, "rows": rows}
    if a.json:
        Path(a.json).write_text(json.dumps(out, indent=2) + "\n")
        print(f"[bench] wrote {a.json}")
    return out


if __name__ == "__main__":
    main()

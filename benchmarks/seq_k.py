"""Per-step k vs per-sequence k (`RolloutEngine(per_sequence_k=True)`) on SmolLM2-135M, side by side in one run.

For each batch size B, answer length and k (fixed or auto), two engines on the same model and prompts (B chain_sum
prompts by default, one wave of continuous batching) run interleaved, in alternating order per repeat, with the same
seeds: per-step k (every row drafts the step's k) and per-sequence k (row i keeps k_i <= k from its own recent
acceptance, `specrl.rollout.spec_decode.seq_budget`). Printed per point: tokens/s of both arms and their ratio
(median of the
per-repeat ratios), the acceptance length AL (1 + accepted drafts per row and speculative step), drafts per row and
step (`drafts`), the mean verified width (columns of the verify forward, `width`; per-row budgets shrink it only when
the longest row in the batch is shorter) and the share of rows that drafted nothing (`k_i=0`).

`--shapes` also times the forward the engine does not use: rows with k_i = 0 in a separate plain forward [B0, 1] beside
[B - B0, k+1], against the one padded forward [B, k+1] (target layers and LM head, a KV cache of --ctx positions,
contiguous slot ranges: an upper bound on what a split would gain, since the real split would also gather the
rows' slots), for B0 / B in 1/4, 1/2, 3/4.

    .venv/bin/python benchmarks/seq_k.py --batch-sizes 8,32 --new-tokens 32,128 --ks 3,auto --threads 1 --shapes
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import DTYPES, dtype_name, median, run_header  # noqa: E402


def arm_stats(m: dict, before: dict, after: dict) -> dict:
    """Figures of one generate call from its metrics and the budget spy's counters (rows, zero rows)."""
    steps = max(1, m["spec_steps"])
    width = sum(k * c for k, c in m["k_histogram"].items()) / steps if m["k_histogram"] else 0.0
    rows = after["rows"] - before["rows"]
    return dict(tok_s=m["tokens_per_second"], al=m["acceptance_length"],
                drafts=m["draft_tokens"] / max(1, m["verify_steps"]), width=width,
                zero=(after["zero"] - before["zero"]) / rows if rows else 0.0)


def spy_budgets(engine) -> dict:
    """Count rows and rows at k_i = 0 over the engine's budget calls (per-sequence arm only)."""
    counts = {"rows": 0, "zero": 0}
    if engine.budget is None:
        return counts
    orig = engine.budget.budgets

    def budgets(n, k):
        b = orig(n, k)
        counts["rows"] += n
        counts["zero"] += int((b == 0).sum())
        return b

    engine.budget.budgets = budgets
    return counts


def time_shapes(model, batch_sizes: list[int], k: int, ctx: int, reps: int) -> list[dict]:
    """Seconds of one padded verify forward [B, k+1] vs [B-B0, k+1] + [B0, 1] (interleaved, medians)."""
    rows = []
    for b in batch_sizes:
        cache = model.new_cache(b, ctx + k + 2)
        torch.manual_seed(0)
        v = model.args.vocab_size

        def fwd(lo, hi, width, cache=cache, v=v):
            tokens = torch.randint(0, v, (hi - lo, width))
            pos = torch.arange(ctx, ctx + width)[None, :].expand(hi - lo, width)
            hidden, _ = model.forward_hidden(tokens, pos, cache.slots(lo, hi), kv_len=ctx + width)
            model.logits(hidden)

        with torch.no_grad():
            for b0 in (b // 4, b // 2, 3 * b // 4):
                one, two = [], []
                fwd(0, b, k + 1)  # warm up
                for _ in range(reps):
                    t = time.perf_counter()
                    fwd(0, b, k + 1)
                    one.append(time.perf_counter() - t)
                    t = time.perf_counter()
                    fwd(0, b - b0, k + 1)
                    fwd(b - b0, b, 1)
                    two.append(time.perf_counter() - t)
                rows.append(dict(batch_size=b, zero_rows=b0, k=k, padded_s=median(one), split_s=median(two),
                                 ratio=median(one) / median(two)))
    return rows


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--drafter", default="eagle:default")
    ap.add_argument("--batch-sizes", default="8,32")
    ap.add_argument("--new-tokens", default="32,128")
    ap.add_argument("--ks", default="3,auto")
    ap.add_argument("--temperature", type=float, default=1.0)
    ap.add_argument("--task", default="chain_sum")
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--threads", type=int, default=torch.get_num_threads())
    ap.add_argument("--verify", default="rejection")
    ap.add_argument("--max-seq-len", type=int, default=512)
    ap.add_argument("--shapes", action="store_true", help="also time a split forward against the padded one")
    ap.add_argument("--shape-reps", type=int, default=15)
    ap.add_argument("--ctx", type=int, default=200, help="--shapes: cached positions per row")
    ap.add_argument("--json", default=None)
    ap.add_argument("--dtype", default="auto", choices=DTYPES)
    a = ap.parse_args()
    torch.set_num_threads(a.threads)
    a.dtype = dtype_name(a.dtype)
    hw = run_header({"model": a.dtype}, a.threads)
    from specrl import RolloutEngine, SamplingParams, load_model
    from specrl.data.tasks import ANSWER_FORMATS, PromptFormatter, make_task, resolve_answer_format
    from specrl.drafters.storage.default import resolve_drafter
    from specrl.model.tokenizer import stop_token_ids

    model, tok = load_model("smollm2-135m", dtype=getattr(torch, a.dtype))
    stops = stop_token_ids(tok, model.args)
    _, val = make_task(a.task, difficulty="easy", train_size=64, val_size=64, seed=0)
    fmt = PromptFormatter(tok, instruction=ANSWER_FORMATS[resolve_answer_format(a.task, "auto")])
    prompts = [fmt.encode(p.question) for p in val.problems]
    print(f"drafter={a.drafter} task={a.task} T={a.temperature} verify={a.verify} threads={a.threads} "
          f"repeats={a.repeats} (interleaved, alternating order)")
    print(f"{'B':>3} {'new':>4} {'k':>5} | {'step tok/s':>10} {'AL':>5} {'drafts':>6} {'width':>5} | "
          f"{'seq tok/s':>9} {'AL':>5} {'drafts':>6} {'width':>5} {'k_i=0':>5} | {'seq/step':>8}")
    rows = []
    for b in [int(x) for x in a.batch_sizes.split(",")]:
        ids = [prompts[i % len(prompts)] for i in range(b)]
        for new in [int(x) for x in a.new_tokens.split(",")]:
            for k in [x if x == "auto" else int(x) for x in a.ks.split(",")]:
                engines = {}
                for arm, on in (("step", False), ("seq", True)):
                    eng = RolloutEngine(model, max_batch_size=b, max_seq_len=a.max_seq_len,
                                        drafter=resolve_drafter(a.drafter, model), num_draft_tokens=k,
                                        verify=a.verify, per_sequence_k=on)
                    eng.generate(ids, SamplingParams(max_new_tokens=4))  # warm up
                    engines[arm] = (eng, spy_budgets(eng))
                got = {"step": [], "seq": []}
                for r in range(a.repeats):
                    sp = SamplingParams(temperature=a.temperature, max_new_tokens=new, stop_token_ids=stops,
                                        seed=r)
                    for arm in (("step", "seq") if r % 2 == 0 else ("seq", "step")):
                        eng, counts = engines[arm]
                        before = dict(counts)
                        m = eng.generate(ids, sp).metrics
                        got[arm].append(arm_stats(m, before, counts))
                med = {arm: {key: median([g[key] for g in got[arm]]) for key in got[arm][0]} for arm in got}
                ratio = median([s["tok_s"] / p["tok_s"] for s, p in zip(got["seq"], got["step"], strict=True)])
                rows.append(dict(batch_size=b, new_tokens=new, k=k, step=med["step"], seq=med["seq"], ratio=ratio))
                p, s = med["step"], med["seq"]
                print(f"{b:>3} {new:>4} {k!s:>5} | {p['tok_s']:>10.1f} {p['al']:>5.2f} {p['drafts']:>6.2f} "
                      f"{p['width']:>5.2f} | {s['tok_s']:>9.1f} {s['al']:>5.2f} {s['drafts']:>6.2f} {s['width']:>5.2f} "
                      f"{s['zero']:>5.0%} | {ratio:>7.2f}x", flush=True)
    shapes = []
    if a.shapes:
        print(f"split forward vs padded (k=3, ctx={a.ctx}, median of {a.shape_reps}):")
        print(f"{'B':>3} {'B0':>3} {'padded ms':>9} {'split ms':>8} {'padded/split':>12}")
        shapes = time_shapes(model, [int(x) for x in a.batch_sizes.split(",")], 3, a.ctx, a.shape_reps)
        for s in shapes:
            print(f"{s['batch_size']:>3} {s['zero_rows']:>3} {s['padded_s'] * 1e3:>9.1f} {s['split_s'] * 1e3:>8.1f} "
                  f"{s['ratio']:>11.2f}x", flush=True)
    if a.json:
        with open(a.json, "w") as f:
            json.dump({"hardware": hw, "rows": rows, "shapes": shapes}, f, indent=1)


if __name__ == "__main__":
    main()

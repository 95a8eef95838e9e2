"""Where an 8B preset's generation time goes, per draft length: why large k slows an 8B preset down.

Run: .venv/bin/python benchmarks/sim_kshare.py [--preset paper-8b-rl-think] [--ks 3:2.77,5:3.23,7:3.48]
     [--cudagraph-max-tokens N]      (a bare K keeps the preset's per-position acceptance rate, like `--k K`)

For the preset's autoregressive arm and each K:AL (speculative arm at draft length K with acceptance length AL)
it prints: rollouts per engine and the CUDA-graph capture size; the generation time and rollout speed-up; the
share of the slowest engine's decode time spent at each batch size; the share outside a CUDA graph; and S, the
mean cost of one speculative step in autoregressive steps (AL / speed-up: the quantity a k-slowdown must raise).
Then the step model's own S(k) = (k drafter forwards + one verify) / one AR step at fixed batches, at 4 000
cached tokens per sequence. No engine runs; about a second per arm. The first line names the processor class and
cores of the machine that ran the simulation and the preset's simulated precisions.
"""

from __future__ import annotations

import argparse
import sys
from dataclasses import replace
from pathlib import Path

from specrl.sim.costs.speculation import Acceptance
from specrl.sim.pipeline import cudagraph_max_tokens, prepare, run_generation
from specrl.sim.scenarios import get_preset

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import run_header  # noqa: E402

BUCKETS = ((1, 8), (9, 32), (33, 128), (129, 256), (257, 10**9))


def shares(trace: list) -> list[float]:
    total = sum(n * dt for _, _, n, dt, _ in trace) or 1.0
    return [sum(n * dt for b, _, n, dt, _ in trace if lo <= b <= hi) / total for lo, hi in BUCKETS]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--preset", default="paper-8b-rl-think")
    ap.add_argument("--ks", default="3:2.77,5:3.23,7:3.48", help="K:AL pairs")
    ap.add_argument("--cudagraph-max-tokens", type=int, default=None)
    args = ap.parse_args()
    base = get_preset(args.preset)
    run_header({"simulated": base.precision, "simulated_train": base.train_precision})
    if args.cudagraph_max_tokens is not None:
        base = replace(base, cudagraph_max_tokens=args.cudagraph_max_tokens)
    acc = Acceptance.from_length(base.acceptance_length, int(base.k))
    try:
        arms = [(int(p.split(":")[0]), float(p.split(":")[1]) if ":" in p else acc.length(int(p)))
                for p in args.ks.split(",")]
    except ValueError:
        raise SystemExit(f"--ks must be K:AL pairs or bare K, like 3:2.77,5:3.23 or 3,5,7; got {args.ks!r}") from None
    ctx = prepare(base)
    n = ctx.responses.shape[1]
    print(f"{args.preset}: {n} rollouts on {ctx.layout.engines} engines = {n / ctx.layout.engines:.0f} per engine, "
          f"max_num_seqs {base.max_num_seqs}")
    head = "".join(f"{f'B {lo}-{hi}' if hi < 10**9 else f'B>{lo - 1}':>10}" for lo, hi in BUCKETS)
    print(f"{'arm':<8}{'AL':>5}{'graphs<=':>9}{'gen s':>8}{'speedup':>8}{'S':>6}{head}{'eager':>7}")
    trace: list = []
    ar, _ = run_generation(ctx, False, trace)
    ar_s = ar.seconds
    print(f"{'AR':<8}{1.0:>5.2f}{_graphs(ctx, False):>9}{ar_s:>8.1f}{1.0:>8.2f}{1.0:>6.2f}"
          + "".join(f"{100 * x:>9.0f}%" for x in shares(trace)) + f"{100 * ar.eager_share:>6.0f}%")
    steps = {}
    for k, al in arms:
        c = prepare(base.with_(k=k, acceptance_length=al))
        trace = []
        res, step = run_generation(c, True, trace)
        steps[k] = step
        sp = ar_s / res.seconds
        print(f"{'k=' + str(k):<8}{al:>5.2f}{_graphs(c, True):>9}{res.seconds:>8.1f}{sp:>8.2f}{al / sp:>6.2f}"
              + "".join(f"{100 * x:>9.0f}%" for x in shares(trace)) + f"{100 * res.eager_share:>6.0f}%")
    print("\nstep model at fixed batch B (4 000 cached tokens per sequence): S(k) = (k drafts + verify) / AR step")
    print(f"{'B':>5}{'AR ms':>8}" + "".join(f"{'S(' + str(k) + ')':>8}" for k, _ in arms))
    for b in (1, 8, 32, 128, 256):
        kv = 4000.0 * b
        ar_t = steps[arms[0][0]].ar_seconds(b, kv)
        print(f"{b:>5}{1e3 * ar_t:>8.2f}" + "".join(f"{s.spec_seconds(b, kv, k) / ar_t:>8.2f}"
                                                   for (k, _), s in zip(arms, steps.values(), strict=True)))


def _graphs(ctx, speculative: bool) -> str:
    k = int(ctx.cfg.k) if speculative else 0
    g = cudagraph_max_tokens(ctx.cfg, ctx.hw, k)
    return "none" if g == float("inf") else f"{g:.0f}"


if __name__ == "__main__":
    main()

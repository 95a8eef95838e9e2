"""Learner stage seconds (logprob + train) of one learner with T threads vs N data-parallel ranks of T/N threads.

The batch is `make run`'s (examples/short.yaml: 4 prompts x 8 samples, 32 response tokens, micro-batch 16,
bf16-mixed, SmolLM2-135M): real chat prompts, random response tokens, random rewards. Arm `single`: the
in-process `Learner` with --threads torch threads. Arm `ranks`: a `LearnerGroup` of --world-size ranks with
--threads / --world-size threads each (FSDP2 over gloo on loopback, the rollouts shipped through Ray's object
store: the cost a run pays). Arms alternate; each reports the median of --repeats steps after one warm-up. The
JSON record names the processor class (`benchmarks/common.py`'s `run_header`), the cores, dtypes and torch's
version, so a figure is never read without its machine.

    .venv/bin/python benchmarks/learner_scaling.py --threads 2 --world-size 2 --repeats 3 --out scaling.json
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
ROOT = Path(__file__).resolve().parents[1]


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser()
    ap.add_argument("--config", default=str(ROOT / "examples" / "short.yaml"))
    ap.add_argument("--model", default=None, help="override model.name (a preset or a checkpoint directory)")
    ap.add_argument("--threads", type=int, default=2, help="the single learner's threads = world size x rank threads")
    ap.add_argument("--world-size", type=int, default=2)
    ap.add_argument("--response-tokens", type=int, default=32)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--out", default=None, help="write the JSON record here too")
    a = ap.parse_args(argv)
    if a.threads % a.world_size:
        raise SystemExit(f"--threads ({a.threads}) must be a multiple of --world-size ({a.world_size})")
    import torch
    from common import prompt_ids, run_header

    from specrl.algorithms.rollouts import Rollouts
    from specrl.cluster.learner_group import LearnerGroup
    from specrl.config.hardware import resolve_hardware
    from specrl.model.hf_checkpoint import parse_dtype
    from specrl.model.loader import load_model
    from specrl.trainer.config_check import load_config
    from specrl.trainer.learner import Learner

    sets = ["speculative.drafter=none", "drafter.online=false", f"learner.world_size={a.world_size}",
            f"learner.threads={a.threads // a.world_size}"]
    if a.model:
        sets.append(f"model.name={a.model}")
    cfg = resolve_hardware(load_config(a.config, sets))
    hardware = run_header({"model": cfg.model.dtype, "train": cfg.policy.precision}, threads=a.threads)
    g = cfg.grpo
    n = g.num_prompts_per_step * g.num_generations
    torch.set_num_threads(a.threads)
    policy, tok = load_model(cfg.model.name, dtype=parse_dtype(cfg.model.dtype))
    gen = torch.Generator().manual_seed(0)
    prompts = prompt_ids(tok, n)
    vocab = policy.args.vocab_size
    responses = [torch.randint(3, vocab, (a.response_tokens,), generator=gen).tolist() for _ in range(n)]
    single = Learner(cfg.model_copy(update={"learner": cfg.learner.model_copy(update={"world_size": 1})}),
                     policy.train())
    group = LearnerGroup(cfg)
    times: dict[str, list[float]] = {"single": [], "ranks": []}
    try:
        for i in range(a.repeats + 1):
            for arm, learner in (("single", single), ("ranks", group)):
                r = Rollouts(list(range(n)), prompts, responses, [[-1.0] * a.response_tokens] * n, ["length"] * n,
                             torch.randn(n, generator=gen), [False] * n, [None] * n,
                             policy_versions=[learner.version] * n)
                t = time.perf_counter()
                learner.learn(r, {"data": 0.0, "prepare": 0.0, "gen": 0.0})
                if i:  # the first round warms up
                    times[arm].append(time.perf_counter() - t)
    finally:
        group.close()
    med = {k: statistics.median(v) for k, v in times.items()}
    rec = {"benchmark": "learner_scaling", "hardware": hardware,
           "model": cfg.model.name, "weights_dtype": cfg.model.dtype, "precision": cfg.policy.precision,
           "batch_sequences": n, "response_tokens": a.response_tokens,
           "micro_batch": cfg.policy.train_micro_batch_size, "repeats": a.repeats,
           "single": {"ranks": 1, "threads": a.threads, "seconds_median": med["single"], "seconds": times["single"]},
           "ranks": {"ranks": a.world_size, "threads_per_rank": a.threads // a.world_size,
                     "seconds_median": med["ranks"], "seconds": times["ranks"]},
           "single_over_ranks": med["single"] / med["ranks"]}
    print(json.dumps(rec, indent=2))
    print(f"learner stage (logprob + train), {n} sequences: 1 rank x {a.threads} threads {med['single']:.2f} s, "
          f"{a.world_size} ranks x {a.threads // a.world_size} thread(s) {med['ranks']:.2f} s "
          f"(ratio {rec['single_over_ranks']:.2f}; > 1: the ranks are faster)")
    if a.out:
        Path(a.out).write_text(json.dumps(rec, indent=2) + "\n")
    return rec


if __name__ == "__main__":
    main()

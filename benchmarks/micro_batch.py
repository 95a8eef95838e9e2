"""The learner's train stage at several `policy.train_micro_batch_size` values on one GRPO batch, interleaved.

The main job's batch shape: --prompts real chat prompts x --group samples each, response lengths drawn uniformly
from --lengths LO,HI (seeded; the main job's replies run ~50-256 tokens), so a micro-batch of several sequences
pays for padding to its longest one as a run does. One `Learner` (the policy's own copy, fp32 master weights) per
micro-batch size, --precision as `make run` trains (auto: bf16-mixed on CPUs with bf16 units, fp32 elsewhere); the
stage is what `Learner.learn` runs at the defaults: one optimizer step per batch, the train forward supplying the
proximal log-probs. The sizes' order rotates every repeat; the table gives each size's median seconds and its
speed-up over the first size. The output names the processor class, cores, threads and precision.

    .venv/bin/python benchmarks/micro_batch.py --threads 2 --micro 1,2,4,8 --repeats 5
"""

from __future__ import annotations

import argparse
import copy
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))


def sizes(text: str) -> list[int]:
    """--micro's comma-separated positive integers, no repeats."""
    try:
        out = [int(s) for s in text.split(",")]
    except ValueError:
        raise argparse.ArgumentTypeError(f"--micro takes comma-separated integers such as 1,8; got {text!r}") from None
    if not out or min(out) < 1 or len(set(out)) != len(out):
        raise argparse.ArgumentTypeError(f"--micro takes distinct integers >= 1 such as 1,8; got {text!r}")
    return out


def span(text: str) -> tuple[int, int]:
    """--lengths' LO,HI: response lengths drawn from LO..HI inclusive, 1 <= LO <= HI."""
    try:
        lo, hi = (int(s) for s in text.split(","))
    except ValueError:
        raise argparse.ArgumentTypeError(f"--lengths takes LO,HI such as 50,256; got {text!r}") from None
    if not 1 <= lo <= hi:
        raise argparse.ArgumentTypeError(f"--lengths needs 1 <= LO <= HI; got {text!r}")
    return lo, hi


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--prompts", type=int, default=1)
    ap.add_argument("--group", type=int, default=8)
    ap.add_argument("--lengths", type=span, default=(50, 256))
    ap.add_argument("--micro", type=sizes, default=[1, 8])
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--precision", default="auto", choices=["auto", "fp32", "bf16-mixed"])
    ap.add_argument("--model", default="smollm2-135m")
    a = ap.parse_args(argv)
    if a.repeats < 1 or a.prompts < 1 or a.group < 1:
        ap.error(f"--repeats, --prompts and --group must be >= 1; got {a.repeats}, {a.prompts}, {a.group}")
    import torch

    from specrl.device import resolve_precision

    torch.set_num_threads(a.threads)
    a.precision = resolve_precision(a.precision, "cpu", "--precision")
    from common import hardware_line, prompt_ids, run_header

    hw = run_header({"model": "float32", "train": a.precision}, a.threads)
    from specrl import load_model
    from specrl.algorithms.batch import collate
    from specrl.algorithms.rollouts import Rollouts
    from specrl.trainer.config_check import validate_config
    from specrl.trainer.learner import Learner

    n = a.prompts * a.group
    policy, tok = load_model(a.model, dtype=torch.float32)
    g = torch.Generator().manual_seed(0)
    prompts = [p for p in prompt_ids(tok, a.prompts) for _ in range(a.group)]  # groups share a prompt
    lo, hi = a.lengths
    lengths = torch.randint(lo, hi + 1, (n,), generator=g).tolist()
    responses = [torch.randint(100, 40000, (k,), generator=g).tolist() for k in lengths]
    roll = Rollouts(list(range(n)), prompts, responses, [[-1.0] * k for k in lengths], ["length"] * n,
                    torch.randn(n, generator=g), [False] * n, [None] * n)
    learners = {}
    for m in a.micro:
        cfg = validate_config({"model": {"name": a.model},
                               "grpo": {"num_prompts_per_step": a.prompts, "num_generations": a.group},
                               "policy": {"train_micro_batch_size": m, "learning_rate": 1e-9,
                                          "precision": a.precision}}, "micro_batch")
        learners[str(m)] = Learner(cfg, copy.deepcopy(policy))
    arms = list(learners)

    def train(m: str) -> float:
        learner = learners[m]
        t = time.perf_counter()
        learner.stage_train(collate(roll, learner.collate_spec))
        return time.perf_counter() - t

    for m in arms:  # warm-up
        train(m)
    got: dict[str, list[float]] = {m: [] for m in arms}
    for r in range(a.repeats):
        for m in arms[r % len(arms):] + arms[: r % len(arms)]:
            got[m].append(train(m))
    med = {m: statistics.median(v) for m, v in got.items()}
    tokens = sum(len(p) for p in prompts) + sum(lengths)
    print(f"threads={a.threads}; batch {n} sequences ({a.prompts} prompts x {a.group}), {tokens} tokens, responses "
          f"{min(lengths)}-{max(lengths)} tokens; {a.precision}; one optimizer step per batch; median of "
          f"{a.repeats} rotated runs; {hardware_line(hw)}")
    print(f"| train_micro_batch_size | train s | tokens/s | speed-up over {arms[0]} |")
    print("|---|---|---|---|")
    for m in arms:
        print(f"| {m} | {med[m]:.2f} | {tokens / med[m]:.0f} | {med[arms[0]] / med[m]:.2f}× |")


if __name__ == "__main__":
    main()

"""This machine's decode speed, measured at start-up: the unit in which `specrl.run.sizing` predicts a run's time.

Two 2-core CPUs of one processor class can differ several-fold in speed (a shared host's memory bandwidth sets the
time of a small model's decode step), so a table of seconds per class cannot say how long a step takes here. The
probe loads the run's policy in its rollout dtype, builds the plain (no drafter) engine the autoregressive arm uses,
at the run's batch size and torch threads, and times `steps` decode steps of `max_batch_size` 64-token prompts
(the difference of two generates of different lengths, so the prefill cancels, after a warm-up one): the seconds
per plain decode step. A reading is the faster of two tries (a busy moment only slows a try), and the probe is the
mean of `readings` readings: one reading on a shared host scatters by ~15% (six read 96-147 ms on one machine,
docs/results.md), and sizing from one fast reading planned more work than the run then had time for. It takes
about ten seconds and changes nothing the run does later (the run loads its own model and sets its own threads).
"""

from __future__ import annotations

import time
from typing import Any

PROMPT_TOKENS = 64


def decode_step_seconds(cfg: Any, steps: int = 24, warmup: int = 4, readings: int = 3) -> float:
    """Seconds per plain decode step of `cfg`'s policy at `generation.max_batch_size` rows, on `cfg.run.device`
    with `cfg.run.threads` (`cfg` resolved: its rollout dtype and device are concrete): the mean of `readings`
    readings, each the faster of two tries."""
    if readings < 1 or steps < 1 or warmup < 0:
        raise ValueError(f"the probe needs readings >= 1, steps >= 1 and warmup >= 0, got {readings}, {steps}, "
                         f"{warmup}")
    import torch

    from specrl.cpu import ThreadGovernor
    from specrl.model.loader import load_model
    from specrl.rollout.engine import RolloutEngine
    from specrl.rollout.protocol import RolloutRequest
    from specrl.rollout.sampling import SamplingParams

    before = torch.get_num_threads()
    try:
        ThreadGovernor(cfg.run.threads, "run.threads")
        model, _ = load_model(cfg.model.name, dtype=getattr(torch, cfg.model.rollout_dtype), device=cfg.run.device)
        b = cfg.generation.max_batch_size
        vocab = model.args.vocab_size
        engine = RolloutEngine(model, max_batch_size=b, max_seq_len=PROMPT_TOKENS + steps + warmup + 8)
        reqs = [RolloutRequest([1 + (i * 7 + j) % (vocab - 1) for j in range(PROMPT_TOKENS)], request_id=i)
                for i in range(b)]
        def timed(n: int) -> float:
            t0 = time.perf_counter()
            engine.generate(reqs, SamplingParams(temperature=1.0, max_new_tokens=n, seed=0))
            return time.perf_counter() - t0

        timed(warmup)  # kernels and caches warm
        # prefill + `warmup` steps, then prefill + `warmup + steps`: the prefill cancels; the faster of two tries
        def reading() -> float:
            return min(max(timed(warmup + steps) - timed(warmup), 1e-9) for _ in range(2)) / steps

        return sum(reading() for _ in range(readings)) / readings
    finally:
        torch.set_num_threads(before)

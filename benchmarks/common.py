"""Shared benchmark helpers: the prompt set, thread setup and a median-of-interleaved-runs timer."""

from __future__ import annotations

import os
import statistics
import time

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")

from specrl.cli import DEMO_PROMPTS as PROMPTS  # noqa: E402  (one prompt set for the demo and benchmarks)


def prompt_ids(tok, batch_size: int) -> list[list[int]]:
    from specrl.model.tokenizer import encode_chat

    base = [encode_chat(tok, p) for p in PROMPTS]
    return [base[i % len(base)] for i in range(batch_size)]


def timed(fn) -> tuple[float, object]:
    t = time.perf_counter()
    out = fn()
    return time.perf_counter() - t, out


def median(xs: list[float]) -> float:
    return statistics.median(xs)

"""The rollout workload of one RL step: prompts x generations with long-tailed response lengths.

Response lengths come from a log-normal (mean and shape of the uncapped distribution) cut at the max-tokens
cap — truncation at the cap is what a real engine does — or from an empirical histogram file (`length,count`
CSV rows, or one length per line). Lengths are drawn by stratified quantiles and shuffled with a seed, so a
workload is deterministic and low-variance while still spreading long sequences across engines at random.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from specrl.errors import SpecRLError


@dataclass(frozen=True)
class Workload:
    prompts_per_step: int = 512
    generations_per_prompt: int = 16
    max_response_tokens: int = 16384
    prompt_tokens: int = 256
    response_mean: float = 4000.0
    response_sigma: float = 1.0
    length_histogram: str | None = None
    seed: int = 0
    length_sample: tuple[float, ...] | None = None  # measured response lengths (a run's), used like a histogram
    # the sample *is* the step's rollouts, in rollout order (one recorded step of a run): no quantiles, no shuffle
    length_in_order: bool = False

    def __post_init__(self) -> None:
        for f in ("prompts_per_step", "generations_per_prompt", "max_response_tokens", "prompt_tokens"):
            if int(getattr(self, f)) < 1:
                raise SpecRLError(f"workload {f}={getattr(self, f)} must be >= 1")
        if self.length_sample is not None and (not self.length_sample or min(self.length_sample) < 1):
            raise SpecRLError("workload length_sample must be a non-empty list of response lengths >= 1")
        if self.length_in_order and (self.length_sample is None or len(self.length_sample) != self.rollouts):
            got = "none" if self.length_sample is None else len(self.length_sample)
            raise SpecRLError(f"workload length_in_order needs a length_sample of exactly the step's "
                              f"{self.rollouts} rollouts (prompts_per_step x generations_per_prompt), got {got}")
        if self.response_mean <= 0 or self.response_sigma < 0:
            raise SpecRLError(f"response length needs mean > 0 and sigma >= 0; got mean={self.response_mean} "
                              f"sigma={self.response_sigma}")

    @property
    def rollouts(self) -> int:
        return self.prompts_per_step * self.generations_per_prompt

    def response_lengths(self) -> np.ndarray:
        """Response lengths in rollout order (generations of a prompt are consecutive)."""
        n = self.rollouts
        if self.length_in_order:
            return np.clip(np.round(np.asarray(self.length_sample, dtype=float)), 1, self.max_response_tokens)
        u = (np.arange(n) + 0.5) / n
        if self.length_histogram or self.length_sample is not None:
            if self.length_sample is not None:
                values, counts = np.unique(np.asarray(self.length_sample, dtype=float), return_counts=True)
            else:
                values, counts = read_histogram(self.length_histogram)
            cdf = np.cumsum(counts) / counts.sum()
            lengths = values[np.minimum(np.searchsorted(cdf, u), len(values) - 1)].astype(float)
        elif self.response_sigma == 0:
            lengths = np.full(n, self.response_mean)
        else:
            s = self.response_sigma
            mu = math.log(self.response_mean) - s * s / 2
            from scipy.special import ndtri

            lengths = np.exp(mu + s * ndtri(u))
        lengths = np.clip(np.round(lengths), 1, self.max_response_tokens)
        return np.random.default_rng(self.seed).permutation(lengths)

    def prompt_lengths(self) -> np.ndarray:
        return np.full(self.rollouts, float(self.prompt_tokens))


def read_histogram(path: str | Path) -> tuple[np.ndarray, np.ndarray]:
    """Read `length,count` rows (header optional) or one length per line."""
    p = Path(path)
    if not p.exists():
        raise SpecRLError(f"length histogram {p} does not exist; give a CSV of `length,count` rows")
    values, counts = [], []
    for lineno, line in enumerate(p.read_text().splitlines(), 1):
        line = line.strip()
        if not line or line.startswith("#"):
            continue
        parts = [x.strip() for x in line.split(",")]
        try:
            v = float(parts[0])
            c = float(parts[1]) if len(parts) > 1 else 1.0
        except ValueError:
            if lineno == 1:
                continue  # header
            raise SpecRLError(f"{p}:{lineno}: expected `length,count` numbers, got {line!r}") from None
        if v < 1 or c < 0:
            raise SpecRLError(f"{p}:{lineno}: length must be >= 1 and count >= 0, got {line!r}")
        values.append(v)
        counts.append(c)
    if not values or sum(counts) <= 0:
        raise SpecRLError(f"{p}: no lengths with positive counts")
    order = np.argsort(values)
    return np.asarray(values)[order], np.asarray(counts)[order]

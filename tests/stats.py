"""Goodness-of-fit helper for the distribution tests: chi-square with sparse cells pooled."""

import numpy as np
from scipy.stats import chisquare


def gof_pvalue(counts, probs, min_expected: float = 5.0) -> float:
    counts = np.asarray(counts, dtype=np.float64)
    probs = np.asarray(probs, dtype=np.float64)
    n = counts.sum()
    exp = probs / probs.sum() * n
    assert counts[exp == 0].sum() == 0, "a sample landed on a zero-probability outcome"
    keep = exp >= min_expected
    obs = np.append(counts[keep], counts[~keep].sum())
    ex = np.append(exp[keep], exp[~keep].sum())
    if ex[-1] == 0:
        obs, ex = obs[:-1], ex[:-1]
    ex = ex * obs.sum() / ex.sum()
    return float(chisquare(obs, ex).pvalue)

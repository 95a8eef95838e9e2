"""Shared pieces of the exact-distribution tests: the tiny setting, exact continuation probabilities from
plain forwards, and a chi-square goodness-of-fit with sparse cells pooled."""

import itertools

import numpy as np
import torch
from scipy.stats import chisquare

from specrl.rollout.sampling import probs_from_logits

V = 8  # vocabulary of the tiny target: every 3-token continuation can be enumerated
DIST_PROMPT = [1, 2, 1]
N_SAMPLES = 20000
SETTINGS = {
    "T0.7": dict(temperature=0.7),
    "T1.0": dict(temperature=1.0),
    "T1.5": dict(temperature=1.5),
    "top_p": dict(temperature=1.0, top_p=0.8),
    "top_k": dict(temperature=1.2, top_k=3),
}


def exact_distribution(target, sp, length: int = 3) -> dict:
    """P(continuation) for every continuation of `length` tokens after DIST_PROMPT, from plain full forwards."""
    conts = list(itertools.product(range(V), repeat=length))
    seqs = torch.tensor([DIST_PROMPT + list(c) for c in conts])
    with torch.no_grad():
        logits, _ = target(seqs)
    rows = logits[:, len(DIST_PROMPT) - 1: -1]  # [N, length, V]
    shape = rows.shape[:2]
    p = probs_from_logits(rows, torch.full(shape, float(sp.temperature)), torch.full(shape, float(sp.top_p)),
                          torch.full(shape, sp.top_k, dtype=torch.long))
    chosen = p.gather(-1, seqs[:, len(DIST_PROMPT):, None]).squeeze(-1).double()
    return dict(zip(conts, chosen.prod(-1).tolist(), strict=True))


def speculative_pvalue(engine, target, sp) -> float:
    """Draw N_SAMPLES speculative continuations of DIST_PROMPT and test them against the exact distribution.

    Also asserts 0 < acceptance rate < 1, so both the accept and the reject paths ran."""
    exact = exact_distribution(target, sp, sp.max_new_tokens)
    outs = engine.generate([DIST_PROMPT] * N_SAMPLES, sp)
    m = outs.metrics
    assert 0 < m["acceptance_rate"] < 1, m
    keys = list(exact)
    index = {c: i for i, c in enumerate(keys)}
    counts = [0] * len(keys)
    for o in outs:
        counts[index[tuple(o.token_ids)]] += 1
    return gof_pvalue(counts, [exact[c] for c in keys])


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

"""Shared pieces of the exact-distribution tests: the tiny setting, exact continuation probabilities from
plain forwards, a chi-square goodness-of-fit with sparse cells pooled, and the suite's family-wise error rate.

Family-wise error rate: the suite's chi-square cases (CHI_SQUARE_CASES) form one family tested at
FAMILY_ALPHA = 1e-3 with Bonferroni's correction: each case fails when its p-value is below
ALPHA = FAMILY_ALPHA / N_CHI_SQUARE, equivalently when its adjusted p-value min(1, N_CHI_SQUARE * p) (what
`speculative_pvalue` returns) is below FAMILY_ALPHA. So a correct implementation fails some case with
probability <= 1e-3 over a fresh draw of the noise (any change in how random numbers are consumed re-draws it);
the seeds are fixed, so a given checkout passes or fails deterministically. Bonferroni's "any case fails"
decision is exactly Holm's (Holm's first step is the Bonferroni test of the smallest p-value), so nothing is lost
by testing each case on its own. `test_verify_power.py::test_family_size_matches_the_suite` checks the counts
below against the tests' parametrizations.
"""

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


# every chi-square test of the suite and its number of parametrized cases
CHI_SQUARE_CASES = {
    "tests/test_spec_proof.py::test_exact_distribution": 40,
    "tests/test_spec_proof.py::test_bonus_path_exact_distribution": 12,
    "tests/test_drafter_eagle_mtp.py::test_exact_distribution": 40,
    "tests/test_verify_power.py::test_verify_matches_exact_outcome_distribution": 9,
    "tests/test_seq_budget.py::test_rejection_with_budgets_keeps_the_exact_distribution": 2,
    "tests/test_spec_proof.py::test_exact_distribution_with_confidence_cut": 16,
    "tests/test_confidence_cut.py::test_rejection_with_the_cut_keeps_the_exact_distribution": 3,
    "tests/test_spec_proof.py::test_exact_distribution_with_a_stop_token": 8,
}
N_CHI_SQUARE = sum(CHI_SQUARE_CASES.values())
FAMILY_ALPHA = 1e-3  # the suite's false-alarm probability (over all chi-square cases together)
ALPHA = FAMILY_ALPHA / N_CHI_SQUARE  # each case's level


def adjusted(pvalue: float) -> float:
    """Bonferroni-adjusted p-value: compare with FAMILY_ALPHA."""
    return min(1.0, N_CHI_SQUARE * pvalue)


def copy_prompt(target) -> list[int]:
    """A prompt for the copying drafters (n-gram, suffix), which draft nothing without a match: segments
    1, t, a_t, b_t for every token t, with a_t, b_t the target's greedy continuation there, ending in 1. Whatever
    token t the prefill samples, the row's context ends in (1, t), which occurred before followed by a_t, b_t:
    every row has a draft, and a likely one, so the accept and bonus paths run."""
    prompt = [1]
    with torch.no_grad():
        for t in range(V):
            prompt.append(t)
            for _ in range(2):
                logits, _ = target(torch.tensor([prompt]))
                prompt.append(int(logits[0, -1].argmax()))
            prompt.append(1)
    return prompt


def exact_distribution(target, sp, length: int = 3, prompt: list[int] = DIST_PROMPT) -> dict:
    """P(continuation) for every continuation of `length` tokens after `prompt`, from plain full forwards."""
    conts = list(itertools.product(range(V), repeat=length))
    seqs = torch.tensor([prompt + list(c) for c in conts])
    with torch.no_grad():
        logits, _ = target(seqs)
    rows = logits[:, len(prompt) - 1: -1]  # [N, length, V]
    shape = rows.shape[:2]
    p = probs_from_logits(rows, torch.full(shape, float(sp.temperature)), torch.full(shape, float(sp.top_p)),
                          torch.full(shape, sp.top_k, dtype=torch.long))
    chosen = p.gather(-1, seqs[:, len(prompt):, None]).squeeze(-1).double()
    return dict(zip(conts, chosen.prod(-1).tolist(), strict=True))


def stopped(cont: tuple[int, ...], stop_token_ids: tuple[int, ...]) -> tuple[int, ...]:
    """A continuation as the engine returns it: cut after its first stop token (which it keeps)."""
    for i, t in enumerate(cont):
        if t in stop_token_ids:
            return cont[: i + 1]
    return cont


def exact_outcomes(target, sp, prompt: list[int] = DIST_PROMPT) -> dict:
    """P(outcome) for every outcome of sampling `sp.max_new_tokens` tokens after `prompt`: with stop tokens, an
    outcome is a continuation cut at its first stop token, whose probability is the sum over the full-length
    continuations it begins (the tokens after a stop sum to 1)."""
    out: dict = {}
    for c, p in exact_distribution(target, sp, sp.max_new_tokens, prompt).items():
        key = stopped(c, sp.stop_token_ids)
        out[key] = out.get(key, 0.0) + p
    return out


def speculative_pvalue(engine, target, sp, prompt: list[int] = DIST_PROMPT) -> float:
    """Draw N_SAMPLES speculative continuations of `prompt` and test them against the exact distribution (of the
    outcomes cut at a stop token, where `sp` has any: `exact_outcomes`);
    returns the family-adjusted p-value (`adjusted`), to be compared with FAMILY_ALPHA (= 1e-3).

    Also asserts 0 < acceptance rate < 1, so both the accept and the reject paths ran."""
    exact = exact_outcomes(target, sp, prompt)
    outs = engine.generate([prompt] * N_SAMPLES, sp)
    m = outs.metrics
    assert 0 < m["acceptance_rate"] < 1, m
    keys = list(exact)
    index = {c: i for i, c in enumerate(keys)}
    counts = [0] * len(keys)
    for o in outs:
        out = tuple(o.token_ids)
        assert out in index, f"{out} is no outcome of sampling {sp} (tokens after a stop token, or too many)"
        counts[index[out]] += 1
    return adjusted(gof_pvalue(counts, [exact[c] for c in keys]))


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

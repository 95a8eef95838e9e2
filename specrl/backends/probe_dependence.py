"""The losslessness probe's independence tests: is a backend's sample jointly distributed as the policy's, not only
token by token?

The probe's chi-square tests (`specrl.backends.probe`, `specrl.backends.probe_positions`) test the marginal law of
the randomised PIT values u_t. Under the null they are also independent: across the positions of one continuation
(the Rosenblatt transform of a sequential sample) and across continuations (each request has its own noise). A
sampler can keep every marginal right and break independence: one uniform reused for two positions of a sequence,
or two continuations of one prompt drawn with the same noise (request ids or seeds that collide), which makes GRPO
groups of identical samples. Two tests catch those, each on disjoint pairs so that the pairs are i.i.d. uniform on
the unit square under the null and a chi-square goodness-of-fit test over a `bins` x `bins` grid is exact in
distribution:

* `serial`: positions (0, 1), (2, 3), ... of every continuation;
* `siblings`: continuations (0, 1), (2, 3), ... of each prompt, at every position.

They form one family at their own level (`DEPENDENCE_ALPHA`, Bonferroni: half each), beside the marginal tests'
alpha, so a probe's false-alarm rate is alpha + DEPENDENCE_ALPHA. A test with fewer than `MIN_PAIRS` pairs is
not run; each reports its power as the smallest Cohen's w it detects (`detectable_w`).
"""

from __future__ import annotations

import torch

from specrl.backends.probe_positions import detectable_w

DEPENDENCE_ALPHA = 1e-4  # the two tests together (each at half)
BINS = 4  # per axis: 16 cells
MIN_PAIRS = 5 * BINS * BINS  # >= 5 expected pairs per cell


def pair_test(a: torch.Tensor, b: torch.Tensor, bins: int = BINS) -> tuple[float, int, float, list[int]]:
    """Chi-square test that pairs (a_i, b_i) are uniform on the unit square (independent uniforms): (statistic,
    dof, p-value, cell counts row-major by a's bin); pairs holding a NaN (a token out of the reference's support)
    are left out."""
    from scipy.stats import chi2

    ok = ~(torch.isnan(a) | torch.isnan(b))
    ia = (a[ok].double() * bins).long().clamp(0, bins - 1)
    ib = (b[ok].double() * bins).long().clamp(0, bins - 1)
    counts = torch.bincount(ia * bins + ib, minlength=bins * bins).double()
    n = float(counts.sum())
    expected = n / (bins * bins)
    stat = float(((counts - expected) ** 2 / expected).sum()) if n else float("nan")
    dof = bins * bins - 1
    return stat, dof, float(chi2.sf(stat, dof)) if n else float("nan"), [int(c) for c in counts.tolist()]


def dependence_pairs(u: torch.Tensor, rows_per_prompt: list[int], num_tokens: int) -> dict[str, tuple]:
    """The two tests' disjoint pairs from the probe's PIT values `u` [N] (continuations in `pit_values`' order: the
    prompts' rows one after another, `rows_per_prompt` of them each, `num_tokens` per row)."""
    grid = u.reshape(-1, num_tokens)
    even = num_tokens - num_tokens % 2
    serial = (grid[:, 0:even:2].flatten(), grid[:, 1:even:2].flatten())
    firsts, seconds, start = [], [], 0
    for n in rows_per_prompt:
        block = grid[start:start + n - n % 2]
        firsts.append(block[0::2])
        seconds.append(block[1::2])
        start += n
    siblings = (torch.cat(firsts).flatten(), torch.cat(seconds).flatten())
    return {"serial": serial, "siblings": siblings}


def dependence_tests(u: torch.Tensor, rows_per_prompt: list[int], num_tokens: int,
                     alpha: float = DEPENDENCE_ALPHA, power: float = 0.99) -> list[dict]:
    """One row per test: name, pairs, statistic, dof, p-value, its alpha, the w it detects at `power`, whether it
    ran (enough pairs) and whether it rejected independence."""
    if sum(rows_per_prompt) * num_tokens != u.numel():
        raise ValueError(f"{u.numel()} PIT values are not {sum(rows_per_prompt)} rows x {num_tokens} tokens")
    out = []
    each = alpha / 2
    for name, (a, b) in dependence_pairs(u, rows_per_prompt, num_tokens).items():
        stat, dof, p, counts = pair_test(a, b)
        n = sum(counts)  # the pairs without a NaN
        row = {"test": name, "pairs": n, "alpha": each, "tested": n >= MIN_PAIRS, "rejected": False,
               "statistic": None, "dof": dof, "p_value": None,
               "detectable_w": detectable_w(n, dof, each, power) if n else float("inf")}
        if row["tested"]:
            row.update(statistic=stat, p_value=p, rejected=p < each)
        out.append(row)
    return out


def summary(rows: list[dict]) -> str:
    """`serial p=0.41 over 768 pairs; siblings p=0.73 over 768 pairs` (or `serial not run (40 pairs < 80)`)."""
    return "; ".join(f"{r['test']} p={r['p_value']:.3g} over {r['pairs']} pairs" if r["tested"] else
                     f"{r['test']} not run ({r['pairs']} pairs < {MIN_PAIRS})" for r in rows)

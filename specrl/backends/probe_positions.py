"""The losslessness probe per draft position: which tokens the verifier emitted where, and a test for each.

A native engine's drafter is wrapped for the probe's `generate` call by `RoleRecorder`, which sees every verify
step's rows (request id, position of the first draft, real drafts d, tokens emitted e) on their way to the drafter.
From those, every sampled token gets its role: `draft j` (the j-th token of a verify step, emitted as the accepted
j-th draft or as the replacement of a rejected one), `bonus` (the token after all d >= 1 real drafts were
accepted), `no draft` (a verify step's row with d = 0, drawn by the verifier from p) or `plain` (the prefill's
first token and plain decoding steps). A role is fixed before its token is drawn (it depends only on the drafts and
the earlier tokens), so under the null each role's randomised PIT values are still i.i.d. Uniform(0, 1) (a
predictable selection from an i.i.d. sequence), and each role gets its own chi-square test: a bias confined to one
position (a bonus token drawn from the wrong position) is not diluted by the pooled sample. The position tests form
one family under Holm's procedure at their share of the probe's alpha; a role with fewer than `MIN_TOKENS` tokens
gets no test, and its power (the smallest Cohen's w detected at the stated power, at the family's Bonferroni level,
which Holm's first step uses; `detectable_w`, the probe's power formula, lives here) says whether it counts as
tested at the target bias.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

MIN_TOKENS = 50  # a position's chi-square needs >= 5 expected tokens in each of its 10 bins
PLAIN, BONUS, UNDRAFTED = "plain", "bonus", "no draft"


class RoleRecorder:
    """A drafter wrapper that records each verify step's rows and forwards everything to the drafter it wraps."""

    def __init__(self, drafter):
        self._inner = drafter
        self.rows: list[tuple[int, int, int, int]] = []  # (request id, first draft position, real drafts, emitted)

    def __getattr__(self, name):  # everything but on_verified is the wrapped drafter's
        return getattr(self._inner, name)

    def on_verified(self, batch, proposal, num_emitted, captured):
        if proposal is not None:
            n, kv = proposal.tokens.shape
            nd = proposal.num_drafts.tolist() if proposal.num_drafts is not None else [kv] * n
            self.rows.extend(zip(batch.request_ids.tolist(), batch.positions.tolist(), nd, num_emitted.tolist(),
                                 strict=True))
        return self._inner.on_verified(batch, proposal, num_emitted, captured)


def detectable_w(num_tokens: int, dof: int, alpha: float, power: float) -> float:
    """Smallest Cohen's w a chi-square test with `dof` degrees of freedom detects with the given power."""
    from scipy.optimize import brentq
    from scipy.stats import chi2, ncx2

    crit = chi2.isf(alpha, dof)
    lam = brentq(lambda x: ncx2.sf(crit, dof, x) - power, 1e-6, 1e5)
    return float((lam / num_tokens) ** 0.5)


def role_names(k_max: int) -> list[str]:
    """Role code -> name: 0 plain, 1..k_max the draft depths, k_max + 1 bonus, k_max + 2 no draft."""
    return [PLAIN, *(f"draft {j}" for j in range(1, k_max + 1)), BONUS, UNDRAFTED]


def token_roles(rows: Sequence[tuple[int, int, int, int]], prompt_len: dict[int, int], sample_of: dict[int, int],
                num_samples: int, num_tokens: int, k_max: int) -> tuple[list[list[int]], dict[int, int]]:
    """(role codes [num_samples][num_tokens], {real drafts d: verify-step rows}) from a recorder's rows (plain
    lists: the caller makes the tensor where its PIT values live)."""
    codes = [[0] * num_tokens for _ in range(num_samples)]
    lengths: dict[int, int] = {}
    for rid, pos, d, e in rows:
        if rid not in sample_of:
            continue
        lengths[d] = lengths.get(d, 0) + 1
        s, o = sample_of[rid], pos - prompt_len[rid]
        for i in range(e):
            if o + i < num_tokens:
                codes[s][o + i] = i + 1 if i < d else (k_max + 1 if d > 0 else k_max + 2)
    return codes, dict(sorted(lengths.items()))


def holm(pvalues: Sequence[float], alpha: float) -> list[bool]:
    """Holm's step-down procedure: which hypotheses are rejected at family-wise error rate alpha."""
    order = sorted(range(len(pvalues)), key=lambda i: pvalues[i])
    rejected = [False] * len(pvalues)
    for rank, i in enumerate(order):
        if pvalues[i] > alpha / (len(pvalues) - rank):
            break
        rejected[i] = True
    return rejected


def position_tests(u: torch.Tensor, codes: torch.Tensor, k_max: int, bins: int, alpha: float, power: float,
                   target_w: float) -> list[dict]:
    """One row per role: tokens, chi-square p-value (None below MIN_TOKENS), whether Holm rejects it at `alpha`,
    the smallest Cohen's w it detects with `power`, and whether that reaches `target_w` ("tested")."""
    from scipy.stats import chi2

    ok = ~torch.isnan(u)
    rows = []
    for code, name in enumerate(role_names(k_max)):
        x = u[ok & (codes == code)]
        row = {"position": name, "tokens": int(x.numel()), "p_value": None, "rejected": False,
               "detectable_w": float("inf"), "tested": False}
        if x.numel() >= MIN_TOKENS:
            counts = torch.histc(x, bins=bins, min=0.0, max=1.0)
            expected = x.numel() / bins
            row["p_value"] = float(chi2.sf(float(((counts - expected) ** 2 / expected).sum()), bins - 1))
        rows.append(row)
    tested = [r for r in rows if r["p_value"] is not None]
    for r, rej in zip(tested, holm([r["p_value"] for r in tested], alpha), strict=True):
        r["rejected"] = rej
        r["detectable_w"] = detectable_w(r["tokens"], bins - 1, alpha / len(tested), power)
        r["tested"] = r["detectable_w"] <= target_w
    return rows

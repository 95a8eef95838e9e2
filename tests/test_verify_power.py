"""Direct test of THE verifier (`specrl.rollout.spec_decode.verify.verify`) against exact outcome probabilities.

10^6 synthetic rows per case (vocabulary 4, random target p and drafter q per row and position, 25% of their
entries zeroed as top-k/top-p targets and reduced-vocabulary drafters do; noise from the real position-keyed
`uniform`) go through `verify` in one vectorised call, for k = 1, 2, 3 in `rejection` mode with sampled drafts
(x ~ q) and with one-hot drafts (draft_probs=None), and in `seed_exact` mode. Each row's outcome is the cell
(a = number accepted, rank of the emitted token at position a in that row's exact P(. | a)); the exact cell
probabilities come from the rejection-sampling rule (`outcome_probs`). The statistic is the quadratic form
d' S^+ d of the observed-minus-expected cell counts d with their exact covariance S (rows independent, not
identically distributed): chi-square with rank(S) = 6, 9, 12 degrees of freedom for k = 1, 2, 3. Each case fails
at the suite's per-case level ALPHA = 1e-3 / 81 (tests/stats.py: family-wise false-alarm rate 1e-3). Also
asserted: the accepted prefix is the drafts, no outcome of probability 0 occurs, and in seed_exact every emitted
token is the inverse-CDF draw from p with the sample noise (token for token).

Power (measured by `.venv/bin/python tools/mutation_check.py --power`; noncentral chi-square with the planted
bug's exact shift of the expected counts, plus re-seeded simulation):
* over-acceptance by 1% (accept when u*q < 1.01*p): noncentrality 124-366 against critical values 32.6-44.5,
  so each of the 6 rejection cases misses it with probability <= 4.9e-9 (weakest: one-hot drafts, k = 1);
  simulated, 30 of 30 re-seeded runs caught it (smallest statistic 116). By 0.5%: each case has power
  0.65-0.9999, the 6 together 1 - 1.2e-10. 0.25% is below the resolution (power 0.38 together).
* a bonus drawn from the wrong position (p_{k-1} instead of p_k): noncentrality >= 3.7e5, never missed.
* `tools/mutation_check.py` (run by `make test`) plants these and more bugs and fails unless each is caught.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import pytest
import torch
from scipy.stats import chi2, ncx2

from specrl.errors import SpecRLError
from specrl.rollout.sampling import STREAM_ACCEPT, STREAM_RESIDUAL, STREAM_SAMPLE, sample_inverse_cdf, uniform
from specrl.rollout.spec_decode.verify import verify
from tests.stats import ALPHA

V = 4  # vocabulary of the synthetic rows
N_ROWS = 1_000_000
ZERO_FRACTION = 0.25  # share of p and q entries set to 0 (top-k/top-p targets, reduced-vocabulary drafters)
# (mode, one-hot drafts?, k); seed_exact ignores q, so it is tested once per k
CASES = [(m, oh, k) for k in (1, 2, 3) for m, oh in (("rejection", False), ("rejection", True), ("seed_exact", False))]


def case_id(case) -> str:
    mode, onehot, k = case
    return f"{mode}-{'onehot' if onehot else 'q'}-k{k}"


def case_seed(case) -> int:
    mode, onehot, k = case
    return 1000 * k + 10 * int(onehot) + (mode == "seed_exact")


@dataclass
class Rows:
    p: torch.Tensor  # [n, k+1, V] float32 target probabilities
    q: torch.Tensor | None  # [n, k, V] float32 draft probabilities, None = one-hot drafts
    x: torch.Tensor  # [n, k] draft tokens
    u_sample: torch.Tensor
    u_accept: torch.Tensor
    u_residual: torch.Tensor


def _dists(logits: torch.Tensor, g: torch.Generator) -> torch.Tensor:
    """softmax(logits) with ~ZERO_FRACTION of the entries zeroed (never a row's largest), as float32."""
    zero = torch.rand(logits.shape, generator=g, dtype=torch.float64) < ZERO_FRACTION
    zero &= logits < logits.max(-1, keepdim=True).values
    return torch.softmax(logits.masked_fill(zero, float("-inf")), dim=-1).float()


def make_rows(n: int, k: int, onehot: bool, seed: int) -> Rows:
    """n synthetic verify inputs. Target logits are N(0, s^2) with s ~ U(0.5, 3) per row (flat to peaked); a
    drafter's logits are the target's plus N(0, t^2) noise with t ~ U(0, 2) per row (close to far), so the ratios
    p/q cover the whole range, much of it near 1 where over-acceptance shows most. Sampling drafts are x ~ q;
    one-hot drafts are the drafter's argmax for half of the rows and a uniform token for the other half."""
    g = torch.Generator().manual_seed(seed)

    def normal(*shape):
        return torch.randn(*shape, generator=g, dtype=torch.float64)

    lp = normal(n, k + 1, V) * (0.5 + 2.5 * torch.rand(n, 1, 1, generator=g, dtype=torch.float64))
    lq = lp[:, :k] + normal(n, k, V) * 2 * torch.rand(n, 1, 1, generator=g, dtype=torch.float64)
    p = _dists(lp, g)
    if onehot:
        q = None
        x = torch.where(torch.rand(n, k, generator=g) < 0.5, lq.argmax(-1), torch.randint(0, V, (n, k), generator=g))
    else:
        q = _dists(lq, g)
        x = torch.multinomial(q.reshape(-1, V), 1, generator=g).reshape(n, k)
    s = torch.tensor(seed)
    rid = torch.arange(n)[:, None]
    pos = torch.arange(k + 1)[None, :]
    return Rows(p, q, x, uniform(s, rid, pos, STREAM_SAMPLE), uniform(s, rid, pos[:, :k], STREAM_ACCEPT),
                uniform(s, rid, pos[:, :k], STREAM_RESIDUAL))


def outcome_probs(rows: Rows, mode: str, accept_scale: float = 1.0, bonus_pos: int | None = None) -> torch.Tensor:
    """Exact P(num_accepted = a, emitted token at position a = y) per row: [n, (k+1)*V] float64, cell a*V + y.

    rejection: draft i is accepted with probability min(1, p_i(x_i)/q_i(x_i)) given all before it were; at the
    first rejection j the token is drawn from norm(max(0, p_j - q_j)); with all k accepted the bonus is drawn from
    p_k. One-hot drafts: q_i = one-hot(x_i). seed_exact: token i is drawn from p_i, and draft i is accepted iff
    it equals that token. `accept_scale` and `bonus_pos` give the distribution of two planted bugs (acceptance
    min(1, c p/q) instead of min(1, p/q); the bonus drawn from p at another position), for power calculations.
    """
    n, k1, _ = rows.p.shape
    k = k1 - 1
    p = rows.p.double()
    p = p / p.sum(-1, keepdim=True)
    q = (torch.zeros(n, k, V, dtype=torch.float64).scatter(-1, rows.x[..., None], 1.0) if rows.q is None
         else rows.q.double())
    p_x = p[:, :k].gather(-1, rows.x[..., None]).squeeze(-1)
    q_x = q.gather(-1, rows.x[..., None]).squeeze(-1)
    if mode == "seed_exact":
        alpha = p_x
        resid = p[:, :k].scatter(-1, rows.x[..., None], 0.0)  # the policy's token, given it is not x
    else:
        alpha = (accept_scale * p_x / q_x).clamp_max(1.0)
        resid = (p[:, :k] - q).clamp_min(0.0)
    mass = resid.sum(-1, keepdim=True)
    resid = torch.where(mass > 0, resid / mass.clamp_min(1e-300), p[:, :k])
    before = torch.cat([torch.ones(n, 1, dtype=torch.float64), alpha.cumprod(-1)], dim=1)  # P(first j accepted)
    out = torch.empty(n, k1, V, dtype=torch.float64)
    out[:, :k] = (before[:, :k] * (1 - alpha))[..., None] * resid
    out[:, k] = before[:, k, None] * p[:, k if bonus_pos is None else bonus_pos]
    return out.reshape(n, k1 * V)


def observed_cells(res, rows: Rows, probs: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Each row's outcome cell and the cells' per-row probabilities, in the row's own order.

    The cell of a row is (a = num_accepted, rank of the emitted token y among the tokens ordered by their exact
    P(y | a) for that row): cell a*V + rank. Ranking inside each row aligns rows with different p and q, so a bug
    that moves probability between tokens (a bonus from the wrong position, a wrong residual) shows up in the
    totals over rows instead of cancelling out. Also asserts the accepted prefix is the drafts."""
    n, k = rows.x.shape
    a = res.num_accepted
    assert res.tokens.shape == (n, k + 1) and bool(((a >= 0) & (a <= k)).all())
    assert torch.equal(res.num_emitted, a + 1)
    prefix = torch.arange(k)[None, :] < a[:, None]
    assert torch.equal(res.tokens[:, :k][prefix], rows.x[prefix]), "an emitted prefix token is not the draft"
    y = res.tokens.gather(1, a[:, None]).squeeze(1)
    by_a = probs.reshape(n, k + 1, V)
    ranked, order = by_a.sort(dim=-1, descending=True, stable=True)
    rank = (order[torch.arange(n), a] == y[:, None]).long().argmax(-1)
    return a * V + rank, ranked.reshape(n, (k + 1) * V), order


def quadratic_stat(cells: torch.Tensor, probs: torch.Tensor) -> tuple[float, int, np.ndarray]:
    """(d' S^+ d, rank S, pseudo-inverse basis) for d = observed - expected counts per cell and S their exact
    covariance sum_rows diag(P_r) - P_r P_r' (rows independent, not identically distributed): asymptotically
    chi-square with rank(S) degrees of freedom under the null (multivariate CLT over 10^6 rows)."""
    c = probs.shape[1]
    expected = probs.sum(0)
    counts = torch.bincount(cells, minlength=c).double()
    assert bool((counts[expected == 0] == 0).all()), "an outcome of probability 0 occurred"
    cov = torch.diag(expected) - probs.T @ probs
    w, vec = np.linalg.eigh(cov.numpy())
    keep = w > w.max() * 1e-9
    basis = vec[:, keep] / np.sqrt(w[keep])  # S^+ = basis @ basis.T
    z = (counts - expected).numpy() @ basis
    return float(z @ z), int(keep.sum()), basis


@dataclass
class CaseResult:
    stat: float
    df: int
    pvalue: float
    critical: float  # the statistic's rejection threshold at ALPHA
    rows: Rows
    probs: torch.Tensor  # [n, cells] exact cell probabilities in each row's order
    order: torch.Tensor  # [n, k+1, V] the token behind each rank
    basis: np.ndarray


def prepare_case(case, n: int = N_ROWS, seed: int | None = None) -> tuple[Rows, torch.Tensor]:
    """The case's synthetic rows and their exact outcome probabilities (reusable across verifiers)."""
    mode, onehot, k = case
    rows = make_rows(n, k, onehot, case_seed(case) if seed is None else seed)
    return rows, outcome_probs(rows, mode)


def run_case(case, verify_fn=verify, n: int = N_ROWS, seed: int | None = None, prepared=None) -> CaseResult:
    """Run `verify_fn` on n synthetic rows of this case and test the outcomes against the exact distribution."""
    mode, onehot, k = case
    rows, exact = prepare_case(case, n, seed) if prepared is None else prepared
    res = verify_fn(mode, rows.p, rows.x, rows.q, rows.u_sample, rows.u_accept, rows.u_residual)
    if mode == "seed_exact":  # token for token the inverse-CDF draw from p with the position's sample noise
        policy = sample_inverse_cdf(rows.p, rows.u_sample)
        emitted = torch.arange(k + 1)[None, :] <= res.num_accepted[:, None]
        assert torch.equal(res.tokens[emitted], policy[emitted]), "seed_exact emitted a token that is not p's draw"
    cells, probs, order = observed_cells(res, rows, exact)
    stat, df, basis = quadratic_stat(cells, probs)
    return CaseResult(stat, df, float(chi2.sf(stat, df)), float(chi2.isf(ALPHA, df)), rows, probs, order, basis)


def analytic_power(result: CaseResult, mode: str, **bug) -> tuple[float, float]:
    """(P(the case fails), noncentrality) under a planted bug whose outcome distribution is
    `outcome_probs(..., **bug)`: the statistic is then noncentral chi-square with noncentrality d' S^+ d, d the
    bug's shift of the expected cell counts."""
    n, k1, _ = result.order.shape
    bugged = outcome_probs(result.rows, mode, **bug).reshape(n, k1, V).gather(-1, result.order).reshape(n, k1 * V)
    shift = (bugged - result.probs).sum(0).numpy() @ result.basis
    lam = float(shift @ shift)
    return float(ncx2.sf(result.critical, result.df, lam)), lam


@pytest.mark.parametrize("case", CASES, ids=case_id)
def test_verify_matches_exact_outcome_distribution(case):
    r = run_case(case)
    assert r.pvalue > ALPHA, f"{case_id(case)}: chi-square {r.stat:.1f} on {r.df} df, p = {r.pvalue:.2e}"


def test_exact_formula_is_lossless():
    """The expected-value model above is a lossless rule: for k = 1, drafts x ~ q (or any fixed one-hot draft, or
    seed_exact) give a first emitted token distributed exactly as p_0 (so the test checks the right target)."""
    rows = make_rows(2000, 1, onehot=False, seed=7)
    for mode in ("rejection", "seed_exact"):
        first = torch.zeros(2000, V, dtype=torch.float64)
        for x in range(V):  # average over x ~ q
            r = Rows(rows.p, rows.q, torch.full((2000, 1), x), rows.u_sample, rows.u_accept, rows.u_residual)
            cell = outcome_probs(r, mode).reshape(2000, 2, V)
            emitted = cell[:, 0] + torch.nn.functional.one_hot(torch.tensor(x), V).double() * cell[:, 1].sum(-1, True)
            weight = rows.q[:, 0, x].double()[:, None]
            first += torch.where(weight > 0, weight * emitted, 0.0)  # x with q(x) = 0 is never drafted
        p0 = rows.p[:, 0].double() / rows.p[:, 0].double().sum(-1, keepdim=True)
        assert torch.allclose(first, p0, atol=1e-6), mode  # q is float32: sums to 1 within ~1e-7
    for x in range(V):  # one-hot drafts: any fixed x
        r = Rows(rows.p, None, torch.full((2000, 1), x), rows.u_sample, rows.u_accept, rows.u_residual)
        cell = outcome_probs(r, "rejection").reshape(2000, 2, V)
        first = cell[:, 0] + torch.nn.functional.one_hot(torch.tensor(x), V).double() * cell[:, 1].sum(-1, True)
        p0 = rows.p[:, 0].double() / rows.p[:, 0].double().sum(-1, keepdim=True)
        assert torch.allclose(first, p0, atol=1e-12)


def test_family_size_matches_the_suite():
    """CHI_SQUARE_CASES (the family behind ALPHA) counts every parametrized chi-square case of the suite."""
    import importlib
    import math

    from tests.stats import CHI_SQUARE_CASES

    for nodeid, count in CHI_SQUARE_CASES.items():
        path, name = nodeid.split("::")
        fn = getattr(importlib.import_module(path[:-3].replace("/", ".")), name)
        sizes = [len(m.args[1]) for m in getattr(fn, "pytestmark", []) if m.name == "parametrize"]
        assert math.prod(sizes) == count, (nodeid, sizes)


# ---------------------------------------------------------------- the verifier's input checks
def _inputs(n=3, k=2, with_q=True, seed=0):
    r = make_rows(n, k, onehot=not with_q, seed=seed)
    return [r.p, r.x, r.q, r.u_sample, r.u_accept, r.u_residual]


@pytest.mark.parametrize("mode", ["rejection", "seed_exact"])
def test_draft_tokens_with_k_minus_1_columns_is_an_error(mode):
    args = _inputs()
    args[1] = args[1][:, :1]  # [n, k-1]: used to broadcast and emit an unchecked token
    with pytest.raises(SpecRLError, match=r"draft_tokens.*\(3, 1\).*k=2"):
        verify(mode, *args)


@pytest.mark.parametrize("which,index,bad", [
    ("draft_probs", 2, lambda t: t[:, :1]), ("u_sample", 3, lambda t: t[:, :2]), ("u_accept", 4, lambda t: t[:2]),
    ("u_residual", 5, lambda t: t[:, :, None]), ("draft_tokens", 1, lambda t: t[0]),
])
def test_other_shape_mismatches_are_errors(which, index, bad):
    args = _inputs()
    args[index] = bad(args[index])
    with pytest.raises(SpecRLError, match=rf"verify: {which} has shape"):
        verify("rejection", *args)
    with pytest.raises(SpecRLError, match=r"target_probs.*k\+1, V\]"):
        verify("rejection", args[0][0], *_inputs()[1:])


def test_float_draft_tokens_are_an_error():
    args = _inputs()
    args[1] = args[1].float()
    with pytest.raises(SpecRLError, match=r"draft_tokens.*integer.*torch\.float32"):
        verify("rejection", *args)


def test_draft_with_zero_draft_probability_is_an_error_naming_the_row():
    args = _inputs(n=5)
    q, x = args[2].clone(), args[1]
    q[3, 1, x[3, 1]] = 0.0  # a drafter claiming q(x) = 0 for a token it proposed
    args[2] = q
    with pytest.raises(SpecRLError, match=rf"bug: row 3 .*token {int(x[3, 1])}\b"):
        verify("rejection", *args)
    verify("seed_exact", *args)  # seed_exact never uses q: still exact, no error


def test_uniform_is_strictly_inside_the_unit_interval():
    """The top 53 bits all ones used to give (2^53 - 0.5) / 2^53, which rounds to exactly 1.0."""
    from specrl.rollout.sampling import _srl, _unit_interval

    edge = torch.tensor([-1, -2048, -2047, 0, 2047, -(2 ** 63), 2 ** 63 - 1])  # top 53 bits all ones / all zeros
    u = _unit_interval(edge)
    assert bool((u < 1).all()) and bool((u > 0).all())
    assert u[0].item() == 1 - 2 ** -53 and u[3].item() == 0.5 / 2 ** 53
    bits = torch.randint(-(2 ** 63), 2 ** 63 - 1, (100_000,), generator=torch.Generator().manual_seed(0))
    old = (_srl(bits, 11).double() + 0.5) / float(1 << 53)  # the previous formula: unchanged below 1
    assert torch.equal(_unit_interval(bits), old)
    draws = uniform(torch.tensor(0), torch.arange(1000)[:, None], torch.arange(100)[None, :], STREAM_SAMPLE)
    assert bool((draws > 0).all() and (draws < 1).all())

"""Whether a run learned, with its uncertainty: reward curves with standard errors, the reward signal, held-out
accuracy and an equivalence test of two arms' final accuracies.

Pure functions of step records (`metrics.jsonl`) and validation records (`validation.jsonl`), no plotting:
`reward_curve` gives each step's mean train reward with its standard error (the batch's sample std over the root of
its sample count); `signal` the step-0 success rate (the first step's rollouts come from the untrained policy) and
the groups with a non-zero GRPO advantage, per step and over the run (a group whose rewards are all equal gives no
gradient); `accuracy_points` held-out accuracy at each evaluation with its binomial standard error, and
`learning_line` the first and last of them; `tost_two_proportions` the two one-sided tests (TOST, normal
approximation with unpooled standard error) that two proportions differ by less than a margin, which the overlay
run applies to the arms' final held-out accuracies. That test covers the held-out questions' sampling only: it asks
whether two trained policies score alike, not whether training runs of the two arms end alike, which also varies
with the run's own samples. `tost_runs` tests that: Welch's TOST on the final accuracies of several training runs
(seeds) per arm, so the spread between runs is in the standard error. compare.json carries these dicts; the plots
are `specrl.observability.compare_plots`'.
"""

from __future__ import annotations

import math
from typing import Any

from specrl.errors import SpecRLError
from specrl.observability.step_record import StepRecord, to_record

EQUIVALENCE_MARGIN = 0.15  # final held-out accuracies of the two arms: equivalent if they differ by < 15 points
EQUIVALENCE_ALPHA = 0.05


def _recs(records: Any) -> list[StepRecord]:
    return [to_record(r) for r in records or []]


def proportion_se(p: float, n: int) -> float:
    """Binomial standard error sqrt(p (1 − p) / n)."""
    if n < 1 or not 0.0 <= p <= 1.0:
        raise SpecRLError(f"a proportion needs 0 <= p <= 1 and n >= 1, got p={p}, n={n}")
    return math.sqrt(p * (1.0 - p) / n)


def reward_curve(records: Any) -> list[dict[str, Any]]:
    """Per step: {"step", "mean", "se", "n"}; se = the batch's reward std / sqrt(samples) (None for one sample)."""
    out = []
    for r in _recs(records):
        if r.reward_mean is None:
            continue
        n = len(r.response_lengths) or None
        se = r.reward_std / math.sqrt(n) if r.reward_std is not None and n and n > 1 else None
        out.append({"step": int(r.step), "mean": float(r.reward_mean), "se": se, "n": n})
    return out


def signal(records: Any) -> dict[str, Any]:
    """The reward signal of a run: step-0 success rate (share of the first step's completions scored right) with its
    standard error and the prompts it comes from (the first step's groups: with few prompts it is those prompts'
    rate, not the task's), and the groups with a non-zero advantage per step and over the run."""
    recs = _recs(records)
    first = recs[0] if recs else None
    p0 = first.train_accuracy if first is not None else None
    n0 = len(first.response_lengths) if first is not None else 0
    per_step = [{"step": int(r.step), "groups": r.groups, "nonzero": r.groups_nonzero_advantage}
                for r in recs if r.groups is not None]
    groups = sum(s["groups"] for s in per_step)
    nonzero = sum(s["nonzero"] for s in per_step)
    return {"step0_success_rate": p0,
            "step0_success_rate_se": proportion_se(p0, n0) if p0 is not None and n0 else None,
            "step0_completions": n0 or None,
            "step0_prompts": first.groups if first is not None else None,
            "nonzero_advantage_per_step": per_step,
            "groups": groups, "groups_nonzero_advantage": nonzero,
            "nonzero_advantage_share": nonzero / groups if groups else None,
            "steps_with_signal": sum(s["nonzero"] > 0 for s in per_step)}


def accuracy_points(validation: Any, default_n: int | None = None) -> list[dict[str, Any]]:
    """Per evaluation: {"step", "accuracy", "n", "se"}; n from the record (`val_questions`) or `default_n`."""
    out = []
    for r in _recs(validation):
        if r.accuracy is None:
            continue
        n = (r.validation or {}).get("val_questions") or default_n
        out.append({"step": int(r.step), "accuracy": float(r.accuracy), "n": n,
                    "se": proportion_se(float(r.accuracy), int(n)) if n else None})
    return out


def learning_line(validation: Any, default_n: int | None = None) -> dict[str, Any] | None:
    """{"first": point, "last": point, "change", "change_se"}: held-out accuracy at the start and the end."""
    pts = accuracy_points(validation, default_n)
    if not pts:
        return None
    a, b = pts[0], pts[-1]
    se = math.sqrt(a["se"] ** 2 + b["se"] ** 2) if a["se"] is not None and b["se"] is not None else None
    return {"first": a, "last": b, "change": b["accuracy"] - a["accuracy"], "change_se": se}


def _phi(z: float) -> float:
    return 0.5 * (1.0 + math.erf(z / math.sqrt(2.0)))


def tost_two_proportions(x1: int, n1: int, x2: int, n2: int, margin: float = EQUIVALENCE_MARGIN,
                         alpha: float = EQUIVALENCE_ALPHA) -> dict[str, Any]:
    """Two one-sided z-tests that |p1 − p2| < margin (unpooled standard error). `equivalent` when both reject at
    `alpha`, i.e. the (1 − 2·alpha) confidence interval of p1 − p2 lies inside (−margin, margin)."""
    if n1 < 1 or n2 < 1 or not (0 <= x1 <= n1 and 0 <= x2 <= n2):
        raise SpecRLError(f"TOST needs 0 <= successes <= trials >= 1, got {x1}/{n1} and {x2}/{n2}")
    if not 0 < margin < 1 or not 0 < alpha < 0.5:
        raise SpecRLError(f"TOST needs 0 < margin < 1 and 0 < alpha < 0.5, got margin {margin}, alpha {alpha}")
    p1, p2 = x1 / n1, x2 / n2
    diff = p1 - p2
    se = math.sqrt(p1 * (1 - p1) / n1 + p2 * (1 - p2) / n2)
    if se == 0.0:  # both proportions at 0 or 1: the difference is exact
        p_value = 0.0 if abs(diff) < margin else 1.0
        lo = hi = diff
    else:
        p_value = max(1.0 - _phi((diff + margin) / se), _phi((diff - margin) / se))
        z = -_norm_ppf(alpha)
        lo, hi = diff - z * se, diff + z * se
    return {"test": "TOST, two proportions (normal approximation, unpooled SE)", "margin": margin, "alpha": alpha,
            "p1": p1, "n1": n1, "p2": p2, "n2": n2, "difference": diff, "se": se,
            "ci": [lo, hi], "ci_level": 1 - 2 * alpha, "p_value": p_value, "equivalent": p_value < alpha}


def _norm_ppf(q: float) -> float:
    """Inverse of the standard normal CDF by bisection (accurate to 1e-10; alpha is a handful of values)."""
    lo, hi = -10.0, 10.0
    for _ in range(200):
        mid = (lo + hi) / 2
        if _phi(mid) < q:
            lo = mid
        else:
            hi = mid
    return (lo + hi) / 2


def final_equivalence(validation: dict[str, Any], default_n: int | None = None) -> dict[str, Any] | None:
    """TOST of the arms' last held-out accuracies (speculative vs autoregressive), or None without both."""
    last = {}
    for arm in ("speculative", "autoregressive"):
        pts = accuracy_points(validation.get(arm), default_n)
        if not pts or not pts[-1]["n"]:
            return None
        last[arm] = pts[-1]
    s, a = last["speculative"], last["autoregressive"]
    out = tost_two_proportions(round(s["accuracy"] * s["n"]), s["n"], round(a["accuracy"] * a["n"]), a["n"])
    return {**out, "step": s["step"], "arms": ["speculative", "autoregressive"]}


def tost_runs(a: list[float], b: list[float], margin: float = EQUIVALENCE_MARGIN,
              alpha: float = EQUIVALENCE_ALPHA) -> dict[str, Any]:
    """Welch's two one-sided t-tests that the mean final accuracies of two arms' training runs (one value per run,
    e.g. per seed) differ by less than `margin`, with the spread between runs as the noise; `equivalent` when the
    (1 − 2·alpha) interval of mean(a) − mean(b) lies inside (−margin, margin). Also Welch's two-sided t-test of a
    difference (`difference_p_value`): a small one is evidence that the arms learn differently."""
    from scipy.stats import t as student_t

    if len(a) < 2 or len(b) < 2:
        raise SpecRLError(f"TOST over training runs needs at least 2 runs per arm (a spread between runs), got "
                          f"{len(a)} and {len(b)}: run the compare with more seeds")
    if not all(0.0 <= x <= 1.0 for x in [*a, *b]):
        raise SpecRLError(f"TOST over training runs takes accuracies in [0, 1], got {a} and {b}")
    if not 0 < margin < 1 or not 0 < alpha < 0.5:
        raise SpecRLError(f"TOST needs 0 < margin < 1 and 0 < alpha < 0.5, got margin {margin}, alpha {alpha}")
    ma, mb = sum(a) / len(a), sum(b) / len(b)
    va = sum((x - ma) ** 2 for x in a) / (len(a) - 1)
    vb = sum((x - mb) ** 2 for x in b) / (len(b) - 1)
    diff = ma - mb
    se = math.sqrt(va / len(a) + vb / len(b))
    if se == 0.0:  # every run of both arms ended at its arm's value: the difference is exact
        df, p_value, p_diff, lo, hi = math.inf, (0.0 if abs(diff) < margin else 1.0), float(diff == 0.0), diff, diff
    else:
        terms = [v / n for v, n in ((va, len(a)), (vb, len(b)))]
        df = se ** 4 / sum(x * x / (n - 1) for x, n in zip(terms, (len(a), len(b)), strict=True) if x > 0)
        p_value = max(float(student_t.sf((diff + margin) / se, df)), float(student_t.cdf((diff - margin) / se, df)))
        p_diff = float(2 * student_t.sf(abs(diff) / se, df))
        q = float(student_t.ppf(1 - alpha, df))
        lo, hi = diff - q * se, diff + q * se
    return {"test": "Welch TOST over training runs (t, unequal variances)", "margin": margin, "alpha": alpha,
            "mean_a": ma, "sd_a": math.sqrt(va), "n_a": len(a), "mean_b": mb, "sd_b": math.sqrt(vb), "n_b": len(b),
            "difference": diff, "se": se, "df": df, "ci": [lo, hi], "ci_level": 1 - 2 * alpha, "p_value": p_value,
            "equivalent": p_value < alpha, "difference_p_value": p_diff}

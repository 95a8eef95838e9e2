"""A run's own losslessness certificate: the verifier's distribution test on the run's own decoding path.

At the end of a speculative sync run, `certify` samples continuations of the task's validation prompts through the
rollout engine the run's rollouts used — the same object, so its own k policy (auto k with the choices it learned per
batch size, per-row draft lengths where the run has them), verify mode, batch size and drafter as synced, on the
final policy weights, at the run's temperature / top-p / top-k — and tests them against that policy's exact
distribution with the losslessness probe (`specrl.backends.probe`: a chi-square test of the randomised probability
integral transform of every sampled token, pooled, and one per draft position under Holm's procedure; and the
independence of those values across a continuation's positions and across a prompt's continuations,
`specrl.backends.probe_dependence`). Before it samples it states its plan (`plan`: tokens, continuations, the bias it
detects at power `POWER`, seconds estimated from the run's own generation tokens/s), sized from a target bias
(`run.certificate.target_w`, Cohen's w: the tokens needed grow as 1 / w^2) and capped by a budget
(`run.certificate.budget_seconds`; auto = a token budget of 3x the tokens the run generated, so a seeded run's
certificate does not depend on timing): where the budget cannot reach the target, the plan and the result state the
bias it can detect instead. The result (p-value, tokens, the k values and draft lengths the run's policy exercised,
and per position its tokens, test and power: "not tested" where too few tokens for the target, "not used by the run"
where neither the certificate nor the run's steps drafted that deep) is printed beside the speed-up and written to
`certificate.json`; a compare fails when it does not pass. Greedy runs (T = 0) are checked token for token elsewhere
and get no certificate; an async run's engines live in Ray workers and are not probed here (the start-up probe covers
vLLM).
"""

from __future__ import annotations

import json
import math
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from specrl.errors import SpecRLError

TARGET_W = 0.10  # the default bias (Cohen's w) the pooled test is sized to detect with power POWER
POWER = 0.99
ALPHA = 1e-3  # the certificate's false-alarm rate: half for the pooled test, half for the position tests (Holm)
BINS = 10
MIN_TOKENS = 200  # the smallest certificate a budget may leave (every tested position needs >= 50)
MAX_PROMPTS = 4
NUM_SAMPLES = 192  # the fewest continuations `sample_size` returns (the TRL callback's default)
LONGEST = 64  # the longest continuation (tokens_each)
UNUSED = "not used by the run"  # a position's status where it had no tokens and the run never drafted that deep


def tokens_each(k_max: int, max_new_tokens: int = 0) -> int:
    """Tokens per continuation: room for two verify steps at the deepest k, at least 8, and as much of the run's own
    reply length as `LONGEST` allows (each continuation costs its prompt twice, in the engine's prefill and in the
    reference forward, so longer continuations test more tokens per second, and deeper into a reply)."""
    return max(8, 2 * (k_max + 1), min(LONGEST, max_new_tokens))


def plan(k_max: int, num_prompts: int, target_w: float = TARGET_W, budget_seconds: float | None = None,
         tokens_per_second: float | None = None, alpha: float = ALPHA, max_new_tokens: int = 0,
         budget_tokens: int | None = None) -> dict[str, Any]:
    """The certificate's size before it samples: the tokens that detect `target_w` at power POWER (pooled test at
    alpha / 2), capped by `budget_tokens` and by what `budget_seconds` buys at `tokens_per_second` (when both are
    known), and the bias Cohen's w that size detects. `limited_by` is "target_w" or "budget"; `reaches_target`
    says whether the stated bias is the target."""
    from specrl.backends.probe import detectable_w, tokens_needed

    if budget_seconds is not None and not budget_seconds > 0:
        raise SpecRLError(f"the certificate's budget must be > 0 seconds (or None: no budget), got {budget_seconds!r}")
    if tokens_per_second is not None and not tokens_per_second > 0:
        raise SpecRLError(f"the certificate's estimate needs the run's generation tokens/s > 0, got "
                          f"{tokens_per_second!r}")
    if budget_tokens is not None and not budget_tokens > 0:
        raise SpecRLError(f"the certificate's token budget must be > 0 (or None: no budget), got {budget_tokens!r}")
    each = tokens_each(k_max, max_new_tokens)
    need = tokens_needed(target_w, BINS - 1, alpha / 2, POWER)
    limited = "target_w"
    caps = [int(budget_tokens)] if budget_tokens is not None else []
    if budget_seconds is not None and tokens_per_second is not None:
        caps.append(int(budget_seconds * tokens_per_second))
    if caps and min(caps) < need:
        need, limited = max(MIN_TOKENS, min(caps)), "budget"
    continuations = max(num_prompts, -(-need // each))
    tokens = continuations * each
    w = detectable_w(tokens, BINS - 1, alpha / 2, POWER)
    return {"tokens": tokens, "continuations": continuations, "tokens_each": each, "target_w": target_w,
            "detectable_w": w, "reaches_target": w <= target_w, "power": POWER, "alpha": alpha,
            "limited_by": limited, "budget_seconds": budget_seconds, "budget_tokens": budget_tokens,
            "tokens_per_second": tokens_per_second,
            "estimated_seconds": tokens / tokens_per_second if tokens_per_second else None}


def sample_size(k: int, target_w: float = TARGET_W, alpha: float = ALPHA, bins: int = BINS,
                num_samples: int = NUM_SAMPLES) -> tuple[int, int]:
    """(continuations, tokens each) that detect `target_w` at power POWER with no budget (at least `num_samples`
    continuations): the tokens needed grow as 1 / w^2."""
    if bins != BINS:
        raise SpecRLError(f"the certificate's test uses {BINS} bins, got bins={bins}")
    p = plan(k, 1, target_w, alpha=alpha)
    return max(num_samples, p["continuations"]), p["tokens_each"]


def announce(p: dict[str, Any], where: str) -> str:
    """The line printed before the certificate samples (its fields are `plan`'s)."""
    est = f", about {p['estimated_seconds']:.0f} s at the run's {p['tokens_per_second']:.0f} generated tokens/s" \
        if p["estimated_seconds"] is not None else ""
    if p["reaches_target"]:
        what = f"sized to detect a bias of Cohen's w >= {p['detectable_w']:.3f} (target {p['target_w']:g})"
    else:
        cap = (f"{p['budget_seconds']:.0f} s" if p["budget_seconds"] is not None
               else f"{p['budget_tokens']}-token")
        what = (f"capped by its {cap} budget: detects w >= {p['detectable_w']:.3f}, not the "
                f"target {p['target_w']:g}")
    return (f"[specrl] losslessness certificate: {p['continuations']} continuations x {p['tokens_each']} tokens = "
            f"{p['tokens']} tokens on {where}{est}; {what} with power {p['power']:g}")


def run_usage(records: Sequence[Any]) -> dict[str, Any]:
    """What the run's steps measured: step seconds, generation tokens/s and the draft depths they drafted at."""
    steps = sum(float(r.step_seconds or 0.0) for r in records)
    gen_s = sum(float((r.stage_seconds or {}).get("gen", 0.0)) for r in records)
    gen_tok = sum(int(r.generated_tokens or 0) for r in records)
    depths = {i + 1 for r in records for i, a in enumerate(r.acceptance_rate_per_position or []) if a is not None}
    return {"step_seconds": steps, "generated_tokens": gen_tok,
            "tokens_per_second": gen_tok / gen_s if gen_s > 0 and gen_tok else None,
            "depths": sorted(depths)}


def budget_for(setting: float | str | None, usage: dict[str, Any]) -> tuple[float | None, int | None]:
    """run.certificate.budget_seconds resolved to (seconds, tokens): auto = a budget of AUTO_MULTIPLE x the tokens
    the run generated (no budget where the run generated none); a number = that many seconds; None = none."""
    from specrl.config.certificate import AUTO_MULTIPLE

    if setting == "auto":
        return None, (AUTO_MULTIPLE * usage["generated_tokens"] if usage["generated_tokens"] > 0 else None)
    return setting, None


def mark_usage(positions: list[dict], run_depths: Sequence[int]) -> list[dict]:
    """Each position's status: "tested", "not tested" (too few tokens for the target bias, or none although the
    run's steps drafted that deep) or "not used by the run" (no tokens, and the run never drafted that deep)."""
    out = []
    for p in positions:
        name = p["position"]
        depth = int(name.split()[1]) if name.startswith("draft ") else None
        unused = p["tokens"] == 0 and (name == "no draft" or (depth is not None and depth not in run_depths))
        status = UNUSED if unused else "tested" if p["tested"] else "not tested"
        out.append({**p, "status": status})
    return out


def certify(trainer: Any, records: Sequence[Any] = (), target_w: float | None = None,
            budget_seconds: float | str | None = "config", alpha: float = ALPHA) -> dict[str, Any] | None:
    """The certificate of a sync trainer's final state on its own rollout engine, or None (with no test run) where
    none applies. `records`: the run's step records (its speed, step time and the depths it drafted at);
    `target_w` / `budget_seconds` default to the config's run.certificate."""
    from specrl.backends.probe import probe_backend
    from specrl.rollout.engine import RolloutEngine
    from specrl.rollout.sampling import SamplingParams

    cfg = trainer.cfg
    sc, g, cc = cfg.speculative, cfg.generation, cfg.run.certificate
    backend = getattr(getattr(trainer, "producer", None), "backend", None)
    if not sc.enabled or g.temperature <= 0 or not isinstance(backend, RolloutEngine) or backend.drafter is None:
        return None
    producer = trainer.producer
    split = "val" if len(producer.val_data) else "train"
    n = min(MAX_PROMPTS, len(producer.val_data if split == "val" else producer.train_data))
    prompts = [producer.prompt(split, i) for i in range(n)]
    usage = run_usage(records)
    budget, budget_tokens = budget_for(cc.budget_seconds if budget_seconds == "config" else budget_seconds, usage)
    deepest = sc.num_draft_tokens if isinstance(sc.num_draft_tokens, int) else backend.k_max
    p = plan(deepest, n, cc.target_w if target_w is None else target_w, budget, usage["tokens_per_second"],
             alpha, g.max_new_tokens, budget_tokens)
    if max(len(q) for q in prompts) + p["tokens_each"] > backend.max_seq_len:
        raise SpecRLError(f"the certificate's {p['tokens_each']}-token continuations of the {split} prompts do not "
                          f"fit the engine's max_seq_len {backend.max_seq_len}; raise model.max_seq_len or set "
                          "run.certify=false")
    k_policy = f"k={sc.num_draft_tokens}" + (f" (0..{backend.k_max})" if sc.num_draft_tokens == "auto" else "")
    where = (f"the run's own engine ({sc.drafter}, {k_policy}"
             + (", per-sequence k" if sc.per_sequence_k else "") + f", verify={sc.verify}, batch "
             f"{backend.max_batch_size}, T={g.temperature}, top_p={g.top_p}, top_k={g.top_k})")
    print(announce(p, where), flush=True)
    t0 = time.perf_counter()
    r = probe_backend(backend, backend.model, prompts, SamplingParams(temperature=g.temperature, top_p=g.top_p,
                                                                        top_k=g.top_k, seed=cfg.run.seed),
                      num_samples=p["continuations"], num_tokens=p["tokens_each"], alpha=alpha, power_target=POWER,
                      setting=where, target_w=p["target_w"])
    out = {**r.as_dict(), "plan": p, "k": sc.num_draft_tokens, "k_max": backend.k_max,
           "run_depths": usage["depths"], "seconds": time.perf_counter() - t0, "summary": r.summary()}
    out["positions"] = mark_usage(r.positions, usage["depths"])
    return out


def write_certificate(run_dir: Path, cert: dict[str, Any] | None) -> None:
    if cert is not None:
        (Path(run_dir) / "certificate.json").write_text(json.dumps(cert, indent=1) + "\n")


def _positions(cert: dict[str, Any]) -> str:
    rows = cert.get("positions") or []
    if not rows or "status" not in rows[0]:
        return ""
    parts = [f"{p['position']} {p['tokens']}" + (f" (w >= {p['detectable_w']:.2f})" if p["status"] == "tested" or
                                                  math.isfinite(p["detectable_w"]) else f" ({p['status']})")
             for p in rows]
    return (f"; tokens per position, with the bias each detects alone (target {cert['target_w']:g}): "
            f"{', '.join(parts)}")


def line(cert: dict[str, Any] | None) -> str:
    """One line for the run's summary."""
    if cert is None:
        return "losslessness certificate: none (no speculation, greedy, or an async run)"
    verdict = "PASS" if cert["passed"] else "FAIL"
    hist = cert.get("k_histogram") or {}
    ks = f"; engine steps per k {hist}" if hist else ""
    w = cert["detectable_w"]
    target = cert["target_w"]
    bound = f"w >= {w:.3f}" + ("" if not math.isfinite(w) or w <= target else f" (not the target {target:g})")
    return (f"losslessness certificate: {verdict} — p = {cert['p_value']:.3g} (alpha {cert['alpha']:g}) over "
            f"{cert['num_tokens']} tokens at k={cert['k']}; detects a bias of Cohen's {bound} with power "
            f"{cert['power_target']:g} ({cert['seconds']:.0f} s){ks}{_positions(cert)}{_independence(cert)}")


def _independence(cert: dict[str, Any]) -> str:
    from specrl.backends.probe_dependence import summary

    rows = cert.get("dependence") or []
    return f"; independence (alpha {cert['dependence_alpha']:g}): {summary(rows)}" if rows else ""


def require(cert: dict[str, Any] | None, report: Path) -> None:
    """Raise when a certificate failed (a compare exits non-zero)."""
    if cert is not None and not cert["passed"]:
        raise SpecRLError(f"the speculative run's own losslessness certificate failed: {cert['summary']}; see "
                          f"{report}. The sampler does not draw from the policy's distribution at these settings")

"""The honest drafter evaluator behind `specrl draft eval` and the build's `eval` stage.

Everything is measured on prompts no build trained on (the task's validation split: `task_prompts` returns
(train, held-out) and the build only ever rolls out the train list), at the workload's temperature and length,
with the real engine: for each k the engine generates the held-out replies with the drafter proposing k tokens
per step, and reports the acceptance length (1 + accepted drafts per verify step) and, per draft position i, the
share of verify steps that accepted at least i drafts and the conditional rate given i-1 accepted. Top-1 is the
share of held-out response positions where the drafter's first draft equals the target's argmax, on the replies
the engine generated (speculative sampling is lossless, so they are the target's own samples). The cost c is the
drafter's wall time per draft token (its `propose` plus its bookkeeping after each verify, summed by the engine
as `draft_seconds`) as a fraction of one plain decode step of the same engine at the same batch size B, both
measured on the same held-out prompts after a warm-up run. With `cache` (the build's `WORK/eval/per_k/`), each k's
measurement is written to its own file as soon as it is done and read back on a later run with the same key (the
drafter's files, the prompts, temperature, length and seed), so a killed evaluation resumes at the first k it had not
finished, and separate processes can measure disjoint k's side by side (`measure_only`).
"""

from __future__ import annotations

import json
import time
from pathlib import Path

import torch

from specrl.errors import SpecRLError
from specrl.fileio import write_text_atomic

DEFAULT_KS = (1, 2, 3, 4, 5, 6, 7)
COST_BATCHES = (1, 8)
COST_TOKENS = 48  # generated tokens per timed cost run
ENGINE_BATCH = 32


def _engine(target, drafter, batch: int, longest: int, max_new_tokens: int, k: int):
    from specrl.rollout.engine import RolloutEngine

    return RolloutEngine(target, max_batch_size=batch, max_seq_len=longest + max_new_tokens + 1,
                         drafter=drafter, num_draft_tokens=k if drafter is not None else 0,
                         k_max=max(k, 1))


def _params(temperature: float, max_new_tokens: int, stops: tuple[int, ...], seed: int):
    from specrl.rollout.sampling import SamplingParams

    return SamplingParams(temperature=temperature, max_new_tokens=max_new_tokens, stop_token_ids=tuple(stops),
                          seed=seed)


def draft_cost(target, drafter, prompts: list[list[int]], batch: int, k: int, temperature: float,
               stops: tuple[int, ...], seed: int = 0, new_tokens: int = COST_TOKENS) -> dict:
    """c at batch size `batch`: the drafter's seconds per draft token over one plain decode step's seconds."""
    if len(prompts) < batch:
        raise SpecRLError(f"the cost at B={batch} needs {batch} prompts, got {len(prompts)}")
    ps = [list(p) for p in prompts[:batch]]
    longest = max(len(p) for p in ps)
    sp = _params(temperature, new_tokens, stops, seed)
    out = {}
    for name, d in (("plain", None), ("spec", drafter)):
        eng = _engine(target, d, batch, longest, new_tokens, k)
        eng.generate(ps, sp)  # warm-up
        eng = _engine(target, d, batch, longest, new_tokens, k)
        out[name] = eng.generate(ps, sp).metrics
    plain, spec = out["plain"], out["spec"]
    if not plain["ar_steps"] or not spec["spec_steps"]:
        raise SpecRLError("the cost runs took no plain or no speculative step; give longer prompts' budget")
    step_s = plain["ar_seconds"] / plain["ar_steps"]
    per_draft_s = spec["draft_seconds"] / (spec["spec_steps"] * k)
    return {"batch": batch, "k": k, "plain_step_ms": 1e3 * step_s, "draft_token_ms": 1e3 * per_draft_s,
            "c": per_draft_s / step_s}


def _cached(cache: tuple[Path, dict] | None, k: int) -> dict | None:
    """k's stored measurement when its key matches this evaluation's; None otherwise (a damaged file too)."""
    if cache is None:
        return None
    try:
        rec = json.loads((cache[0] / f"k{k}.json").read_text())
    except (OSError, ValueError):
        return None
    return rec if isinstance(rec, dict) and rec.get("key") == cache[1] else None


def evaluate_drafter(target, drafter, prompts: list[list[int]], temperature: float, max_new_tokens: int,
                     stops: tuple[int, ...], ks=DEFAULT_KS, seed: int = 0, cost_batches=COST_BATCHES,
                     ttt_steps: int = 3, log=print, cache: tuple[Path, dict] | None = None,
                     measure_only: bool = False) -> dict:
    """Held-out AL at every k in `ks`, per-position acceptance, top-1 and the cost c (see the module docstring).
    `cache` = (directory, key): per-k results are kept there and reused under the same key. `measure_only` returns
    after the k's ({"per_k": ...}), with no top-1 and no cost."""
    from specrl.drafters.training.offline import collect, evaluate

    if not prompts:
        raise SpecRLError("the evaluator needs held-out prompts; the task's validation split gave none")
    ks = sorted({int(k) for k in ks})
    if not ks or ks[0] < 1:
        raise SpecRLError(f"k values must be integers >= 1, got {ks}")
    prompts = [list(p) for p in prompts]
    longest = max(len(p) for p in prompts)
    sp = _params(temperature, max_new_tokens, stops, seed)
    per_k, seqs = {}, None
    for k in ks:
        rec = _cached(cache, k)
        if rec is not None:
            log(f"[specrl] eval k={k}: AL {rec['acceptance_length']:.3f}, kept from {cache[0] / f'k{k}.json'}")
        else:
            t0 = time.perf_counter()
            res = _engine(target, drafter, min(ENGINE_BATCH, len(prompts)), longest, max_new_tokens, k).generate(
                prompts, sp)
            m = res.metrics
            cum = [float(x) for x in m["acceptance_rate_per_position"][:k]]
            cond = [cum[0]] + [cum[i] / cum[i - 1] if cum[i - 1] else 0.0 for i in range(1, k)]
            rec = {"acceptance_length": float(m["acceptance_length"]), "accepted_at_least": cum,
                   "conditional_acceptance": cond, "verify_steps": int(m["verify_steps"]),
                   "generated_tokens": int(m["generated_tokens"]), "seconds": time.perf_counter() - t0,
                   "token_ids": [list(o.token_ids) for o in res.outputs]}
            log(f"[specrl] eval k={k}: AL {m['acceptance_length']:.3f} over {m['verify_steps']} verify steps "
                f"({time.perf_counter() - t0:.0f} s)")
            if cache is not None:
                cache[0].mkdir(parents=True, exist_ok=True)
                write_text_atomic(cache[0] / f"k{k}.json", json.dumps({**rec, "key": cache[1]}) + "\n")
        per_k[str(k)] = {f: v for f, v in rec.items() if f not in ("token_ids", "key")}
        if seqs is None:
            seqs = [p + list(t) for p, t in zip(prompts, rec["token_ids"], strict=True)]
    if measure_only:
        return {"per_k": per_k}
    ex = collect(target, drafter, seqs, prompt_lens=[len(p) for p in prompts])
    q = evaluate(drafter, ex, ttt_steps=ttt_steps)
    cost = {}
    for b in cost_batches:
        if b <= len(prompts):
            cost[str(b)] = draft_cost(target, drafter, prompts, b, 3 if 3 in ks else ks[0], temperature, stops, seed)
            log(f"[specrl] eval cost at B={b}: c = {cost[str(b)]['c']:.4f} of a plain step "
                f"({cost[str(b)]['draft_token_ms']:.2f} ms per draft token, plain step "
                f"{cost[str(b)]['plain_step_ms']:.2f} ms)")
    return {"prompts": len(prompts), "temperature": temperature, "max_new_tokens": max_new_tokens, "seed": seed,
            "acceptance_length": {k: v["acceptance_length"] for k, v in per_k.items()}, "per_k": per_k,
            "heldout_top1": q["top1"], "heldout_loss": q["loss"],
            "heldout_response_tokens": sum(len(s) - len(p) for s, p in zip(seqs, prompts, strict=True)),
            "cost": cost, "threads": torch.get_num_threads(),
            "target_dtype": str(target.dtype).removeprefix("torch.")}


def summary(ev: dict) -> str:
    al = ", ".join(f"k={k}: {v:.2f}" for k, v in ev["acceptance_length"].items())
    cost = ", ".join(f"B={b}: {c['c']:.3f}" for b, c in ev["cost"].items())
    return (f"held-out AL {al}; top-1 {ev['heldout_top1']:.3f}; cost c {cost or 'not measured'} "
            f"({ev['prompts']} prompts, T={ev['temperature']})")

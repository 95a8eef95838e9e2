"""Compare mode's artefacts: the autoregressive and speculative arms of one config side by side.

From the two arms' step records this module computes the generation and RL-step speed-ups of speculative over
autoregressive rollouts (over the steps both arms completed; validation is not part of a step), the Amdahl-style
bound 1 / (R / AL + 1 − R) with R the autoregressive arm's generation share and AL the speculative arm's mean
acceptance length, and the seed-exact identity the run loop checked after every step (`identity_checks`: at how
many steps rollouts and weights were identical, and where the arms parted if they did). It writes `compare.json`,
`compare.md` (the detail table, decode speed-up by active batch size) and `compare_reward.png`, and the run's
`report.md`, which leads with `headline`: the speed-ups, AL, R and the bound, the lossless evidence, learning
(validation accuracy first → last), where it ran, and links to the per-arm reports; where prompts repeat, the
cold and warm steps apart (`specrl.run.cold_warm`). The same lines end the
terminal output of `specrl run` and `specrl train --compare`.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

from specrl.observability import learning
from specrl.observability.compare_plots import plot_learning, plot_reward_compare
from specrl.observability.run_report import Records, _f, _records, _series, hardware_text, summarize
from specrl.run import cold_warm

ARMS = ("autoregressive", "speculative")


def amdahl_bound(gen_share: float | None, acceptance_length: float | None) -> float | None:
    """Step speedup if generation got AL times faster and nothing else changed: 1/(R/AL + 1 - R)."""
    if gen_share is None or acceptance_length is None or acceptance_length <= 0:
        return None
    return 1.0 / (gen_share / acceptance_length + 1.0 - gen_share)


def compare_summary(ar: Records, sd: Records, checks: dict[str, Any] | None = None) -> dict[str, Any]:
    """Numbers of compare.json: speedups over the steps both runs completed, the bound and the checks."""
    ar, sd = _records(ar), _records(sd)
    n = min(len(ar), len(sd))
    ar, sd = ar[:n], sd[:n]
    sa, ss = summarize(ar), summarize(sd)
    gen_speedup = sa["gen_seconds"] / ss["gen_seconds"] if n and ss["gen_seconds"] > 0 else None
    step_speedup = sa["step_seconds"] / ss["step_seconds"] if n and ss["step_seconds"] > 0 else None
    # generated tokens per gen second, speculative ÷ autoregressive: equal to gen_speedup when both arms generated
    # the same tokens (seed_exact). When they did not (rejection, or seed_exact runs that parted), gen time alone
    # compares different work, and so does this: an arm with longer replies keeps its batch full, where tokens/s is
    # highest. `on_autoregressive_work` compares the same work.
    tps = [x["generated_tokens"] / x["gen_seconds"] if x["gen_seconds"] > 0 else None for x in (sa, ss)] \
        if n else [None, None]
    out = {
        "steps": n,
        "gen_speedup": gen_speedup,
        "gen_throughput_speedup": tps[1] / tps[0] if None not in tps and tps[0] > 0 else None,
        # step time per generated token, autoregressive ÷ speculative: the arms' lengths differ once they part
        "step_per_token_speedup": _per_token_speedup(sa, ss, "step_seconds"),
        "step_speedup": step_speedup,
        "gen_share": sa.get("gen_share"),
        "gen_share_speculative": ss.get("gen_share"),
        "acceptance_length": ss.get("acceptance_length_mean"),
        "bound": amdahl_bound(sa.get("gen_share"), ss.get("acceptance_length_mean")),
        "autoregressive": sa,
        "speculative": ss,
        "reward_curve": {
            "autoregressive": [r.reward_mean for r in ar],
            "speculative": [r.reward_mean for r in sd],
        },
    }
    out["reward_curve_se"] = {"autoregressive": [p["se"] for p in learning.reward_curve(ar)],
                              "speculative": [p["se"] for p in learning.reward_curve(sd)]}
    out["signal"] = reward_signal(ar, sd)
    out["cold_warm"] = cold_warm.cold_warm_split(ar, sd)
    phases = phase_speedups(ar, sd)
    out["phase_speedups"] = phases
    out["gen_speedup_ar_work"], out["step_speedup_ar_work"] = on_autoregressive_work(ar, sd, phases)
    out["phase_speedup_min"] = min(phases.values()) if phases else None
    out.update(checks or {})
    return out


def reward_signal(ar: Records, sd: Records) -> dict[str, Any]:
    """compare.json's `signal`: each arm's `learning.signal`, and pooled over both arms the step-0 success rate (both
    arms' first rollouts come from the same untrained policy on the same prompts) and the share of groups with a
    non-zero advantage."""
    arms = {"autoregressive": learning.signal(ar), "speculative": learning.signal(sd)}
    firsts = [a for a in arms.values() if a["step0_success_rate"] is not None and a["step0_completions"]]
    n0 = sum(a["step0_completions"] for a in firsts)
    p0 = sum(a["step0_success_rate"] * a["step0_completions"] for a in firsts) / n0 if n0 else None
    groups = sum(a["groups"] for a in arms.values())
    nonzero = sum(a["groups_nonzero_advantage"] for a in arms.values())
    return {"step0_success_rate": p0, "step0_success_rate_se": learning.proportion_se(p0, n0) if n0 else None,
            "step0_completions": n0 or None,  # both arms drew their first prompts from the same seeded order:
            "step0_prompts": max((a["step0_prompts"] or 0 for a in firsts), default=0) or None,  # the same prompts
            "groups": groups, "groups_nonzero_advantage": nonzero,
            "nonzero_advantage_share": nonzero / groups if groups else None, **arms}


def learning_summary(validation: dict[str, Records] | None, default_n: int | None = None) -> dict[str, Any]:
    """compare.json's `learning`: each arm's held-out accuracy at start and end with standard errors, and the
    equivalence test (TOST) of the final accuracies."""
    val = validation or {}
    return {"autoregressive": learning.learning_line(val.get("autoregressive"), default_n),
            "speculative": learning.learning_line(val.get("speculative"), default_n),
            "equivalence": learning.final_equivalence(val, default_n)}


def _per_token_speedup(sa: dict, ss: dict, key: str) -> float | None:
    if not (sa.get("generated_tokens") and ss.get("generated_tokens") and ss.get(key)):
        return None
    return (sa[key] / sa["generated_tokens"]) / (ss[key] / ss["generated_tokens"])


def phase_speedups(ar: Records, sd: Records) -> dict[int, float]:
    """Decode speedup in each phase of the rollouts, by active batch size n: (speculative tokens/s) ÷
    (autoregressive tokens/s) over all decode steps that ran with n sequences (from each step's batch_trace).
    A phase needs >= 0.05 s in both arms to count (a single step is noise)."""
    from specrl.rollout.generation_metrics import phase_rates

    tot: dict[str, dict[int, list]] = {"ar": {}, "sd": {}}
    for arm, recs in (("ar", ar), ("sd", sd)):
        for r in _records(recs):
            for n, (tok, sec) in phase_rates(r.batch_trace or []).items():
                acc = tot[arm].setdefault(n, [0, 0.0])
                acc[0] += tok
                acc[1] += sec
    out = {}
    for n in sorted(set(tot["ar"]) & set(tot["sd"])):
        (ta, sa), (ts, ss) = tot["ar"][n], tot["sd"][n]
        if sa >= 0.05 and ss >= 0.05 and ta and ts:  # noqa: PLR2004
            out[n] = (ts / ss) / (ta / sa)
    return out


def on_autoregressive_work(ar: Records, sd: Records, phases: dict[int, float] | None = None
                           ) -> tuple[float | None, float | None]:
    """(generation, step) speed-up on the autoregressive arm's own work: its steps with each decode phase (active
    batch size n) at the speculative arm's measured decode speed there (`phase_speedups`; a phase the speculative
    arm did not run, prefill and training unchanged). Once the arms' replies differ in length this compares the same
    work, which per step and per token do not (long replies keep the batch full, where tokens/s is highest). An
    estimate from measured rates: it takes the speculative arm's acceptance to hold on the other arm's replies.
    `phases`: `phase_speedups(ar, sd)` where the caller has it."""
    from specrl.rollout.generation_metrics import phase_rates

    g = phase_speedups(ar, sd) if phases is None else phases
    ar = _records(ar)
    if not g or not ar:
        return None, None
    saved = sum(sec * (1.0 - 1.0 / g[n]) for r in ar for n, (_, sec) in phase_rates(r.batch_trace or []).items()
                if n in g)
    gen = sum(float(r.stage_seconds.get("gen", 0.0)) for r in ar)
    step = sum(float(r.step_seconds) for r in ar)
    return (gen / (gen - saved) if gen > saved else None), (step / (step - saved) if step > saved else None)


def full_summary(ar: Records, sd: Records, checks: dict[str, Any] | None = None,
                 certificate: dict[str, Any] | None = None, validation: dict[str, Records] | None = None
                 ) -> dict[str, Any]:
    """`compare_summary` plus the certificate and, with validation records, `learning` (`learning_summary`)."""
    summary = {**compare_summary(ar, sd, checks), "certificate": certificate}
    if validation is not None:
        summary["learning"] = learning_summary(validation)
    return summary


def write_compare(out_dir: str | Path, ar: Records, sd: Records,
                  checks: dict[str, Any] | None = None, certificate: dict[str, Any] | None = None,
                  validation: dict[str, Records] | None = None) -> tuple[Path, Path]:
    """Write compare.json, compare.md and compare_reward.png (both arms' reward per step with ±1 SE bands), and
    with validation records compare_learning.png (reward and held-out accuracy of both arms with bands)."""
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    ar, sd = _records(ar), _records(sd)
    summary = full_summary(ar, sd, checks, certificate, validation)
    runs = {"autoregressive": ar, "speculative": sd}
    plot_reward_compare(runs, out_dir / "compare_reward.png")
    if validation is not None:
        plot_learning(runs, validation, out_dir / "compare_learning.png", summary["learning"]["equivalence"])
    jpath = out_dir / "compare.json"
    jpath.write_text(json.dumps(summary, indent=2) + "\n")
    rows = [
        "# specrl compare: autoregressive vs speculative rollouts",
        "",
        f"Same config and seeds, {summary['steps']} steps each, steps interleaved so machine noise "
        "hits both.",
        "",
        "| metric | value |",
        "|---|---|",
        f"| gen speedup (AR gen time / SD gen time) | {_f(summary['gen_speedup'], '.2f')}× |",
        f"| gen throughput speedup (generated tokens per gen second, SD ÷ AR) | "
        f"{_f(summary['gen_throughput_speedup'], '.2f')}× |",
        f"| step speedup | {_f(summary['step_speedup'], '.2f')}× |",
        f"| on the AR arm's work: gen / step speedup (its decode phases at SD's speed per active batch size) | "
        f"{_f(summary.get('gen_speedup_ar_work'), '.2f')}× / {_f(summary.get('step_speedup_ar_work'), '.2f')}× |",
        f"| gen share R_gen (autoregressive run) | {_f(summary['gen_share'], '.2f')} |",
        f"| mean acceptance length AL | {_f(summary['acceptance_length'], '.2f')} |",
        f"| bound 1/(R_gen/AL + 1 − R_gen) | {_f(summary['bound'], '.2f')}× |",
        f"| slowest phase of the rollouts (decode speedup at one active batch size) | "
        f"{_f(summary['phase_speedup_min'], '.2f')}× |",
    ]
    for k, v in (checks or {}).items():
        if not isinstance(v, list | dict):
            rows.append(f"| {k} | {v} |")
    if summary["phase_speedups"]:
        rows += ["", "Decode speedup by active batch size (the phases of a rollout: full batch → the tail):", "",
                 "| active sequences | " + " | ".join(str(n) for n in summary["phase_speedups"]) + " |",
                 "|---|" + "---|" * len(summary["phase_speedups"]),
                 "| speedup | " + " | ".join(f"{v:.2f}×" for v in summary["phase_speedups"].values()) + " |"]
    rows += ["", "![reward curves](compare_reward.png)", "",
             *(["![learning curves](compare_learning.png)", ""] if validation is not None else [])]
    mpath = out_dir / "compare.md"
    mpath.write_text("\n".join(rows) + "\n")
    return jpath, mpath


def identity_checks(verify: str, same_rollouts: list[bool], same_weights: list[bool]) -> dict[str, Any]:
    """compare.json's identity fields from the per-step checks of a seed_exact compare (rollouts and weights of the
    two arms equal after each step), with `parted_at_step`: the first step where either differed (None: never), and
    `weights_parted_at_step`: the first step after which the weights differed (from there the arms train on
    different batches; None: the training stayed the same even where a rollout differed).
    Under rejection sampling tokens are not compared (the same distribution, not the same tokens)."""
    if verify != "seed_exact":
        return {"verify": verify, "rollouts_identical": None, "weights_identical": None, "parted_at_step": None,
                "identity_note": "not checked: rejection sampling gives the same distribution, not the same "
                                 "tokens; use speculative.verify=seed_exact for token-identical rollouts"}
    if len(same_rollouts) != len(same_weights):
        raise ValueError(f"one identity check per step for rollouts and weights, got {len(same_rollouts)} and "
                         f"{len(same_weights)}")
    parted = next((i + 1 for i, (a, b) in enumerate(zip(same_rollouts, same_weights, strict=True))
                   if not (a and b)), None)
    weights_parted = next((i + 1 for i, b in enumerate(same_weights) if not b), None)
    return {"verify": "seed_exact", "rollouts_identical": all(same_rollouts), "weights_identical": all(same_weights),
            "parted_at_step": parted, "weights_parted_at_step": weights_parted,
            "rollouts_identical_per_step": list(same_rollouts), "weights_identical_per_step": list(same_weights)}


def _per_step(total: float | None, steps: int) -> float | None:
    return total / steps if steps and total is not None else None


def _accuracy(validation: Records | None) -> tuple[str, tuple[int, int] | None]:
    """`0.125 → 0.469` over the validation records (step 0 = before training) and (first step, last step)."""
    xs, acc = _series(_records(validation), "accuracy")
    if not acc:
        return "n/a", None
    return f"{acc[0]:.3f} → {acc[-1]:.3f}", (xs[0], xs[-1])


def signal_line(sig: dict[str, Any]) -> str:
    """`reward signal: step-0 success rate 0.312 ± 0.082 (32 completions ...); groups with a non-zero advantage ...`"""
    p0, se, n0 = sig.get("step0_success_rate"), sig.get("step0_success_rate_se"), sig.get("step0_completions")
    prompts = sig.get("step0_prompts")
    of = f" of {prompts} prompt{'s' if prompts != 1 else ''}" if prompts else ""
    first = f"{_f(p0)} ± {_f(se)} ({n0} completions{of} by the untrained policy, both arms' first step)" \
        if p0 is not None else "n/a"
    per = "; ".join(f"{arm} {sig[arm]['groups_nonzero_advantage']}/{sig[arm]['groups']}"
                    for arm in ARMS if sig.get(arm))
    share = _f(sig.get("nonzero_advantage_share"), ".2f")
    return (f"reward signal: step-0 success rate {first}; groups with a non-zero advantage "
            f"{sig.get('groups_nonzero_advantage')} of {sig.get('groups')} ({share}) over the run ({per}; a group "
            "whose rewards are all equal gives no gradient)")


def _point(p: dict[str, Any]) -> str:
    return f"{p['accuracy']:.3f} ± {_f(p['se'])}"


def _learning_detail(lrn: dict[str, Any] | None, same_weights: bool = False) -> str:
    """`; with standard errors: speculative 0.125 ± 0.083 → 0.250 ± 0.108 (16 questions), ...; final accuracies: TOST
    ...` from `learning_summary`; with `same_weights` (a seed_exact compare whose weights were identical after every
    step) the final policies are one policy, which the line says instead of a test."""
    if not lrn:
        return ""
    parts = [f"{arm} {_point(x['first'])} → {_point(x['last'])} ({x['last']['n']} questions)"
             for arm in ("speculative", "autoregressive") if (x := lrn.get(arm)) and x["last"]["n"]]
    out = f"; value ± SE: {', '.join(parts)}" if parts else ""
    eq = lrn.get("equivalence")
    if same_weights:
        out += "; the final policies are the same weights (identical after every step), so their accuracies are equal"
    elif eq:
        out += (f"; final accuracies {'equivalent' if eq['equivalent'] else 'not shown equivalent'} within "
                f"±{eq['margin']:.2f} (TOST over the held-out questions, p = {eq['p_value']:.3f}; one training run "
                "per arm: tools/overlay_seeds.py tests over seeds)")
    return out


def _draft_counters(ss: dict) -> str:
    """`; drafted D, accepted A (rate), rows that speculated V of S row-steps` where the arm counted them."""
    d, a, v, s = (ss.get(k) for k in ("draft_tokens", "accepted_tokens", "verify_steps", "sequence_steps"))
    if d is None:
        return ""
    rate = f" ({a / d:.2f})" if d else ""
    rows = f", rows that speculated {v} of {s} row-steps" if v is not None and s else ""
    return f"; drafted {d}, accepted {a}{rate}{rows}"


def headline(summary: dict[str, Any], validation: dict[str, Records] | None = None, hardware: str = "",
             link: Callable[[str], str] = str) -> list[str]:
    """The lines a compare run leads with (report.md's bullets, the terminal's last lines), from `compare_summary`'s
    output (identity fields included): speed-ups, AL, generation share and bound, the lossless evidence, learning,
    hardware, and the per-arm reports (`link(relative path)` renders each: a markdown link, or a path)."""
    n = summary["steps"]
    sa, ss = summary["autoregressive"], summary["speculative"]
    parted = summary.get("parted_at_step")
    lines = [f"speculative vs autoregressive rollouts: the same {n} GRPO steps, config and seeds, steps interleaved"]
    if summary.get("stopped_early"):
        lines[0] += f"; {summary['stopped_early']}"
    ar_gen, sd_gen, ar_step, sd_step = (_f(_per_step(arm.get(key), n), ".2f") for key in ("gen_seconds", "step_seconds")
                                        for arm in (sa, ss))
    gen = (f"generation speed-up: {_f(summary['gen_speedup'], '.2f')}× ({ar_gen} s autoregressive / {sd_gen} s "
           "speculative per step)")
    differ = parted is not None or summary.get("verify") not in (None, "seed_exact")  # the arms' tokens differ
    work = {k: summary.get(f"{k}_speedup_ar_work") for k in ("gen", "step")}
    on_work = {k: f"; on the autoregressive arm's work {_f(v, '.2f')}×" if differ and v is not None else ""
               for k, v in work.items()}
    if differ:
        gen += (f"; generated tokens per generation second {_f(summary['gen_throughput_speedup'], '.2f')}× (it "
                f"favours the arm with longer replies, which keep the batch full){on_work['gen']}")
        if work["gen"] is not None:
            gen += (" (its decode phases at the speculative arm's speed per active batch size: the same work once "
                    "the arms' replies differ)")
    lines.append(gen)
    step = summary["step_speedup"]
    verdict = "" if step is None or step >= 1.0 else "; speculation is slower than plain decoding here"
    per_tok = summary.get("step_per_token_speedup")
    lines.append(f"RL step speed-up: {_f(step, '.2f')}× ({ar_step} s / {sd_step} s per step, validation not "
                 f"counted{verdict}); per generated token {_f(per_tok, '.2f')}×{on_work['step']}")
    if summary.get("certificate") is not None:
        from specrl.run.certificate import line as certificate_line

        lines.append(certificate_line(summary["certificate"]))
    lines.append(f"acceptance length AL: {_f(summary['acceptance_length'], '.2f')} tokens per policy forward "
                 "(speculative arm, mean over steps)" + _draft_counters(ss))
    if summary.get("cold_warm"):
        lines.append(cold_warm.line(summary["cold_warm"]))
    lines.append(f"generation share R: {_f(summary['gen_share'], '.2f')} of the autoregressive step; bound "
                 f"1/(R/AL + 1 − R) = {_f(summary['bound'], '.2f')}× (the step speed-up if generation ran AL× "
                 "faster and nothing else changed)")
    verify = summary.get("verify")
    if verify == "seed_exact":
        ro = sum(summary.get("rollouts_identical_per_step") or [])
        we = sum(summary.get("weights_identical_per_step") or [])
        m = len(summary.get("rollouts_identical_per_step") or [])
        counts = f"rollouts identical at {ro}/{m} steps, weights identical at {we}/{m} steps"
        why = ("seed_exact emits plain decoding's tokens wherever the verify forward over k+1 tokens computes the "
               "same logits as the plain forward; on this processor the two rounded differently there")
        w_parted = summary.get("weights_parted_at_step", parted)
        if parted is None:
            lines.append(f"lossless (seed_exact): {counts}")
        elif w_parted is None:
            differ = [i + 1 for i, same in enumerate(summary.get("rollouts_identical_per_step") or []) if not same]
            lines.append(f"lossless (seed_exact): {counts}. Rollouts differed at step(s) "
                         f"{', '.join(map(str, differ))} ({why}), yet the weights were identical after every step: "
                         "the training was the same. The sampled distribution is exact regardless")
        else:
            lines.append(f"lossless (seed_exact): the arms parted at step {w_parted}: {counts}. {why}; a token "
                         "differed, the update after it differed, and the arms trained on different batches from "
                         "there. The sampled distribution is exact regardless")
    elif verify is not None:
        lines.append(f"lossless (verify={verify}): the samples have plain decoding's distribution; tokens are not "
                     "compared step by step (speculative.verify=seed_exact compares them)")
    if (summary.get("signal") or {}).get("groups"):  # records written before the group counts have none
        lines.append(signal_line(summary["signal"]))
    val = validation or {}
    acc, span = _accuracy(val.get("speculative"))
    ar_acc, _ = _accuracy(val.get("autoregressive"))
    where = f" (steps {span[0]} → {span[1]})" if span else ""
    lines.append(f"learning: validation accuracy {acc}{where}, speculative arm; autoregressive arm {ar_acc}"
                 + _learning_detail(summary.get("learning"), summary.get("weights_identical") is True
                                    and bool(summary.get("weights_identical_per_step"))))
    if summary.get("sizing"):
        from specrl.run.sizing import line as sizing_line

        lines.append(sizing_line(summary["sizing"]))
    if hardware:
        lines.append(f"hardware: {hardware}")
    lines.append(f"per-arm reports: {link('speculative/report.md')} (the training run kept: final policy in "
                 f"{link('speculative/final')}), {link('autoregressive/report.md')}; detail: {link('compare.md')}")
    return lines


def write_compare_report(out_dir: str | Path, ar: Records, sd: Records, checks: dict[str, Any] | None = None,
                         validation: dict[str, Records] | None = None, certificate: dict[str, Any] | None = None
                         ) -> tuple[Path, list[str]]:
    """Write compare.json / compare.md / compare_reward.png (`write_compare`) and report.md, which leads with
    `headline`; return report.md's path and the headline's lines with paths for the terminal."""
    out_dir = Path(out_dir)
    write_compare(out_dir, ar, sd, checks, certificate, validation)
    summary = full_summary(ar, sd, checks, certificate, validation)  # the certificate's line only when one was run
    hw = hardware_text(sd)
    lines = headline(summary, validation, hw, link=lambda rel: f"[{rel}]({rel})")
    text = [f"# specrl run `{out_dir.name}`: speculative vs autoregressive", "", lines[0] + ":", "",
            *(f"- {line}" for line in lines[1:]), "", "![reward curves](compare_reward.png)", "",
            *(["![learning curves](compare_learning.png)", ""] if validation is not None else [])]
    path = out_dir / "report.md"
    path.write_text("\n".join(text) + "\n")
    return path, headline(summary, validation, hw, link=lambda rel: str(out_dir / rel))

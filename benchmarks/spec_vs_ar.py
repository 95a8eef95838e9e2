"""Speculative vs autoregressive generation on SmolLM2-135M (--dtype), side by side in one run.

For each batch size and drafter, runs AR once per repeat and each k (1..7 and auto) right after it, on the
same prompts (each prompt repeated --group times, as GRPO samples a group per prompt), and prints:
speedup over AR, acceptance length AL, the drafter/target cost ratio c (drafter seconds per drafted token
÷ AR seconds per step, both measured), the ideal AL/(1 + k·c) and the efficiency measured/ideal. The ideal
assumes a verify forward over k+1 tokens per sequence costs one AR step; on a CPU it does not (a bf16 GEMM over
16 rows costs ~1.5x one row), so the script also measures v = verify seconds per speculative step ÷ AR seconds
per step and prints the hardware ideal AL/(v + k·c) and the engine efficiency measured/hardware-ideal, which
isolates what the engine loses (bookkeeping, sampling, drafter state) from what the hardware charges.
--confidence-cuts off,row,column runs each k once per cut (`RolloutEngine(confidence_cut=...)`: each row verifies
only the drafts its calibrated draft confidence pays for); `rows/tok` is the target's decode rows (verify rows,
padding included, plus one per sequence of a plain step) per generated token, and each cut's row is followed by its
predicted vs realised acceptance per position.
Prefill costs the same in both arms and dilutes the speedup of short answers, so `dec` is the speedup in
decode tokens per second (total minus prefill time), the quantity the ideal formulas describe; `eng_eff` uses it.
Each point submits max(--min-requests, B) requests to an engine of max_batch_size B (continuous batching), so
small batches still generate enough tokens to time.

`dec` and `eng_eff` compare whole runs, so they also charge the speculative arm for emitting other tokens than
the AR arm (rejection: other samples; seed_exact: bf16 forward-shape drift, see tools/forward_shape_drift.py) and
for a different batch occupancy over time (a long sequence left alone at n=1 for many steps). `occ` removes both:
every step of both arms is timed with its occupancy n, and occ = (the AR time the speculative arm's own emitted
tokens need at the occupancy they were emitted at, sum of e·t_ar(n)/n over its steps, t_ar(n) = the AR arm's mean
step time at n, nearest n where missing) ÷ (the speculative arm's decode step time). `eng_occ` = occ ÷ the same
hardware ideal AL_e/(v_n + k·c_n) formed at those occupancies (AL_e = emitted tokens per sequence-step, v_n and c_n
= verify and draft seconds ÷ sum of t_ar(n) over the speculative steps): what the engine loses beyond the
measured verify and draft costs.

--dtype auto is bf16 on CPUs with bf16 units and float32 elsewhere; the first line and --json's `"hardware"` (with
`"rows"`) name the processor class, cores, threads and dtype.

`--plot PATH` draws, per drafter, k and cut, the measured decode speed-up (`dec`) and its decode bound (`hw_ideal`,
AL/(v + k·c) from the same run's measured AL, v and c) against the batch size in one figure, titled with the
processor class; `--from-json FILE --plot PATH` redraws it from an earlier `--json` without measuring.

    .venv/bin/python benchmarks/spec_vs_ar.py --drafters ngram,suffix,eagle:DIR --batch-sizes 1,4,16,32 \
        --ks 1,2,3,4,5,6,7,auto [--temperature 1.0] [--new-tokens 96] [--threads 1] [--json out.json] [--plot out.png]
"""

from __future__ import annotations

import argparse
import json
import sys
from collections import defaultdict
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import DTYPES, dtype_name, median, prompt_ids, run_header  # noqa: E402


def steps_of(metrics: dict) -> list[tuple]:
    """(n, seconds, emitted, verify_s, draft_s) per decode step, from the call's `batch_trace` (engine metrics)."""
    out, prev = [], 0.0
    for t, n, _, emitted, verify_s in metrics["batch_trace"]:
        out.append((n, t - prev, emitted, verify_s, (t - prev) - verify_s if verify_s > 0 else 0.0))
        prev = t
    return out


def occupancy_matched(ar_log: list[tuple], sd_log: list[tuple]) -> tuple[float, float]:
    """(occ, eng_occ) of the module docstring from the two arms' step logs."""
    by_n = defaultdict(list)
    for n, dt, *_ in ar_log:
        by_n[n].append(dt)
    t_ar = {n: sum(v) / len(v) for n, v in by_n.items()}

    def at(n):
        return t_ar[n] if n in t_ar else t_ar[min(t_ar, key=lambda m: abs(m - n))]

    ar_equiv = sum(e * at(n) / n for n, _, e, _, _ in sd_log)
    spec_time = sum(dt for _, dt, *_ in sd_log)
    occ = ar_equiv / spec_time
    spec = [r for r in sd_log if r[3] > 0]  # speculative steps (verify time recorded)
    if not spec:
        return occ, 1.0
    al_e = sum(e for _, _, e, _, _ in spec) / sum(n for n, *_ in spec)
    base = sum(at(n) for n, *_ in spec)
    hw = al_e / ((sum(r[3] for r in spec) + sum(r[4] for r in spec)) / base)
    return occ, occ / hw


def plot_bound(rows: list[dict], hardware: dict, path: str) -> None:
    """The measured decode speed-up and the decode bound AL/(v + k·c) per batch size, one colour per drafter/k/cut."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    lines: dict[tuple, list[dict]] = defaultdict(list)
    for r in rows:
        lines[(r["drafter"], str(r["k"]), r.get("confidence_cut", "off"))].append(r)
    if not lines:
        raise SystemExit("--plot: no rows to draw (the run measured nothing, or the JSON has no \"rows\")")
    fig, ax = plt.subplots(figsize=(7, 4.2))
    for i, ((spec, k, cut), rs) in enumerate(lines.items()):
        rs = sorted(rs, key=lambda r: r["batch_size"])
        b = [r["batch_size"] for r in rs]
        name = f"{spec} k={k}" + (f" cut={cut}" if cut != "off" else "")
        colour = f"C{i % 10}"
        ax.plot(b, [r["decode_speedup"] for r in rs], "o-", color=colour, label=f"{name}: measured")
        ax.plot(b, [r["hw_ideal"] for r in rs], "s--", color=colour, alpha=0.7, label=f"{name}: bound AL/(v+k·c)")
    ax.axhline(1.0, color="grey", lw=0.8)
    ax.set_xscale("log", base=2)
    sizes = sorted({r["batch_size"] for r in rows})
    ax.set_xticks(sizes, [str(b) for b in sizes])
    ax.set_xlabel("active batch size B (sequences)")
    ax.set_ylabel("decode speed-up over autoregressive")
    ax.set_title(f"decode speed-up and its bound; processor {hardware.get('processor_class', '?')}, "
                 f"{hardware.get('threads', '?')} threads", fontsize=10)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    print(f"[bench] plot -> {path}")


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--drafters", default="ngram,suffix")
    ap.add_argument("--batch-sizes", default="1,4,16,32")
    ap.add_argument("--ks", default="1,2,3,4,5,6,7,auto")
    ap.add_argument("--confidence-cuts", default="off", help="comma list of off,row,column: each k runs per cut")
    ap.add_argument("--temperature", type=float, default=1.0)
    ap.add_argument("--new-tokens", type=int, default=96)
    ap.add_argument("--group", type=int, default=4, help="samples per prompt (siblings for the suffix drafter)")
    ap.add_argument("--repeats", type=int, default=1)
    ap.add_argument("--threads", type=int, default=torch.get_num_threads())
    ap.add_argument("--verify", default="rejection")
    ap.add_argument("--task", default=None, help="task name (e.g. chain_sum): held-out in-domain prompts from "
                    "specrl.data.tasks instead of the generic prompt set")
    ap.add_argument("--answer-format", default="auto", help="with --task: the answer instruction (reasoning = the "
                    "long step-by-step replies of examples/think.yaml)")
    ap.add_argument("--difficulty", default="easy")
    ap.add_argument("--max-seq-len", type=int, default=512)
    ap.add_argument("--min-requests", type=int, default=8,
                    help="requests per point at least (B=1 runs them one after another)")
    ap.add_argument("--json", default=None)
    ap.add_argument("--dtype", default="auto", choices=DTYPES,
                    help="model dtype (auto: bf16 where the CPU has bf16 units, else float32)")
    ap.add_argument("--plot", default=None, help="draw the measured decode speed-up beside its bound to this file")
    ap.add_argument("--from-json", default=None, help="with --plot: redraw from this --json output, measuring nothing")
    a = ap.parse_args()
    if a.from_json:
        if not a.plot:
            raise SystemExit("--from-json only redraws a plot: add --plot PATH")
        doc = json.loads(Path(a.from_json).read_text())
        if "rows" not in doc or "hardware" not in doc:
            raise SystemExit(f"{a.from_json}: not a spec_vs_ar.py --json output (it needs \"rows\" and \"hardware\")")
        plot_bound(doc["rows"], doc["hardware"], a.plot)
        return
    torch.set_num_threads(a.threads)
    a.dtype = dtype_name(a.dtype)
    hw = run_header({"model": a.dtype}, a.threads)
    from specrl import RolloutEngine, SamplingParams, load_model
    from specrl.drafters.storage.default import resolve_drafter
    from specrl.model.tokenizer import stop_token_ids

    model, tok = load_model("smollm2-135m", dtype=getattr(torch, a.dtype))
    stops = stop_token_ids(tok, model.args)
    task_prompts = None
    if a.task:
        from specrl.data.tasks import ANSWER_FORMATS, PromptFormatter, make_task, resolve_answer_format

        _, val = make_task(a.task, difficulty=a.difficulty, train_size=64, val_size=64, seed=0)
        fmt = PromptFormatter(tok, instruction=ANSWER_FORMATS[resolve_answer_format(a.task, a.answer_format)])
        task_prompts = [fmt.encode(p.question) for p in val.problems]
    ks = [k if k == "auto" else int(k) for k in a.ks.split(",")]
    rows = []
    print(f"T={a.temperature} new_tokens<={a.new_tokens} group={a.group} threads={a.threads} verify={a.verify}")
    print(f"{'drafter':>16} {'B':>3} {'k':>5} {'cut':>6} {'speedup':>8} {'AL':>5} {'c':>6} {'ideal':>6} {'eff':>5} "
          f"{'k_mean':>6} {'v':>5} {'hw_ideal':>8} {'dec':>6} {'eng_eff':>7} {'occ':>6} {'eng_occ':>7} "
          f"{'rows/tok':>8} {'tok/s':>7}")
    for spec in a.drafters.split(","):
        for b in [int(x) for x in a.batch_sizes.split(",")]:
            n_req = max(a.min_requests, b)
            n_base = max(1, n_req // a.group)
            base = task_prompts[:n_base] if task_prompts else prompt_ids(tok, n_base)
            ids = [p for p in base for _ in range(a.group)][:n_req]
            ids += [base[0]] * (n_req - len(ids))
            ar = RolloutEngine(model, max_batch_size=b, max_seq_len=a.max_seq_len)
            ar.generate(ids, SamplingParams(max_new_tokens=4))  # warm up
            for k, cut in [(k, cut) for k in ks for cut in a.confidence_cuts.split(",")]:
                drafter = resolve_drafter(spec, model)
                eng = RolloutEngine(model, max_batch_size=b, max_seq_len=a.max_seq_len, drafter=drafter,
                                    num_draft_tokens=k, verify=a.verify, confidence_cut=cut)
                ar_tps, sd_tps, al, c_list, kmean, v_list, dec, occ, eng_occ = [], [], [], [], [], [], [], [], []
                rows_tok, cal = [], None
                for r in range(a.repeats):
                    sp_r = SamplingParams(temperature=a.temperature, max_new_tokens=a.new_tokens, stop_token_ids=stops,
                                          seed=r)
                    m_ar = ar.generate(ids, sp_r).metrics
                    ar_tps.append(m_ar["tokens_per_second"])
                    m = eng.generate(ids, sp_r).metrics
                    o, eo = occupancy_matched(steps_of(m_ar), steps_of(m))
                    occ.append(o)
                    eng_occ.append(eo)
                    sd_tps.append(m["tokens_per_second"])
                    al.append(m["acceptance_length"])
                    kmean.append(m["num_draft_tokens_mean"])
                    rows_tok.append((m["verify_rows"] + m["sequence_steps"] - m["verify_steps"]) /
                                    (m["generated_tokens"] - m["num_sequences"]))  # the prefill emits one each
                    cal = m["confidence_calibration"]
                    t_ar_step = m_ar["ar_seconds"] / max(1, m_ar["ar_steps"])
                    dec.append((m["generated_tokens"] / (m["total_seconds"] - m["prefill_seconds"]))
                               / (m_ar["generated_tokens"] / (m_ar["total_seconds"] - m_ar["prefill_seconds"])))
                    if m["draft_tokens"]:
                        per_draft_tok = m["draft_seconds"] / max(1, m["spec_steps"]) / (m["draft_tokens"] /
                                                                                     max(1, m["verify_steps"]))
                        c_list.append(per_draft_tok / t_ar_step)
                    if m["spec_steps"]:
                        v_list.append(m["verify_seconds"] / m["spec_steps"] / t_ar_step)
                speed = median(sd_tps) / median(ar_tps)
                AL = median(al)
                c = median(c_list) if c_list else 0.0
                kk = median(kmean)
                ideal = AL / (1 + kk * c) if kk else 1.0
                v = median(v_list) if v_list else 1.0
                hw_ideal = AL / (v + kk * c) if kk else 1.0
                dspeed = median(dec)
                row = dict(drafter=spec, batch_size=b, k=k, confidence_cut=cut, rows_per_token=median(rows_tok),
                           calibration=cal, speedup=speed, acceptance_length=AL, c=c, ideal=ideal,
                           efficiency=speed / ideal, k_mean=kk, verify_cost=v, hw_ideal=hw_ideal,
                           decode_speedup=dspeed, engine_efficiency=dspeed / hw_ideal,
                           ar_tok_s=median(ar_tps), spec_tok_s=median(sd_tps), occupancy_speedup=median(occ),
                           engine_efficiency_occupancy=median(eng_occ))
                rows.append(row)
                print(f"{spec[:16]:>16} {b:>3} {k!s:>5} {cut:>6} {speed:>7.2f}x {AL:>5.2f} {c:>6.3f} {ideal:>6.2f} "
                      f"{speed / ideal:>5.2f} {kk:>6.2f} {v:>5.2f} {hw_ideal:>8.2f} {dspeed:>5.2f}x "
                      f"{dspeed / hw_ideal:>7.2f} {median(occ):>5.2f}x {median(eng_occ):>7.2f} "
                      f"{median(rows_tok):>8.3f} {median(sd_tps):>7.1f}", flush=True)
                if cut != "off":
                    pairs = [f"{p:.2f}/{r:.2f}" for p, r in zip(cal["predicted"], cal["realised"], strict=True)
                             if p is not None]
                    print(f"{'':>16} predicted/realised acceptance per position: {' '.join(pairs)}", flush=True)
                if getattr(drafter, "rows", 0):  # hybrid: how often the suffix continuation was taken
                    print(f"{'':>16} suffix proposals in {drafter.suffix_rows / drafter.rows:.0%} of drafted rows",
                          flush=True)
    if a.json:
        with open(a.json, "w") as f:
            json.dump({"hardware": hw, "rows": rows}, f, indent=1)
    if a.plot:
        plot_bound(rows, hw, a.plot)


if __name__ == "__main__":
    main()

"""Native engine vs the vLLM backend, through the same rollout protocol: AR and speculative (n-gram, and the same
EAGLE head in both: specrl's eagle:default, exported to vLLM's EAGLE-3 layout at start-up), B = 1 / 8 / 32,
tok/s and acceptance length. With EAGLE, vLLM runs twice: drafting by argmax and verifying with q = one-hot
(its default, `draft_sample_method=greedy`: acceptance p(x)) and with the drafter's full q
(`probabilistic`: acceptance min(1, p/q), as specrl's verifier does), so the AL that argmax drafting loses at
T = 1 shows side by side with the same head.

Run with the vLLM venv's python (it has specrl too):

    .venv-vllm/bin/python benchmarks/backends.py --batch-sizes 1,8,32 --new-tokens 64 --repeats 2

Each backend runs in its own subprocess (vLLM's CPU worker binds OpenMP threads and replaces
torch.set_num_threads in its process), one after the other, with `--threads` torch / OpenMP threads each:
prompts are SmolLM2 chat prompts, T = 1, exactly --new-tokens per sequence (no stop ids), --dtype (auto: bf16 on
CPUs with bf16 units, float32 elsewhere) in both backends. The output names the processor class, cores, threads and
dtype.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from common import DTYPES, dtype_name, hardware_line, run_header  # noqa: E402

QUESTIONS = ["What is 17 + 25?", "Write one sentence about the sea.", "List three prime numbers.",
             "Count from 1 to 10.", "Name the capital of France.", "Compute 9 * 8 - 13.",
             "Explain what a rollout is.", "What is 144 divided by 12?"]


def worker(a) -> None:
    import torch

    from specrl.backends.probe import chat_prompts
    from specrl.model.loader import load_model
    from specrl.model.presets import prepare
    from specrl.rollout.sampling import SamplingParams

    ckpt = prepare("smollm2-135m", verbose=False)
    model, tok = load_model(ckpt, dtype=getattr(torch, a.dtype))
    prompts = chat_prompts(tok, QUESTIONS)
    sizes = [int(x) for x in a.batch_sizes.split(",")]
    if a.backend == "vllm":
        from specrl.backends.vllm import VLLMBackend, VLLMOptions
        from specrl.drafters.storage.default import default_head_spec

        del model
        drafter = default_head_spec(a.drafter)
        engine = VLLMBackend(ckpt, VLLMOptions(dtype=a.dtype, max_model_len=512, max_num_seqs=max(sizes),
                                               drafter=drafter, num_draft_tokens=a.k,
                                               draft_sample_method=a.draft_sample))
    else:
        from specrl.drafters.storage.default import resolve_drafter
        from specrl.rollout.engine import RolloutEngine

        torch.set_num_threads(a.threads)
        engine = RolloutEngine(model, max_batch_size=max(sizes), max_seq_len=512,
                               drafter=None if a.drafter == "none" else resolve_drafter(a.drafter, model),
                               num_draft_tokens=a.k if a.drafter != "none" else 0)
    sp = SamplingParams(temperature=1.0, max_new_tokens=a.new_tokens)
    engine.generate(prompts[:2], SamplingParams(max_new_tokens=4))  # warm-up
    out = {}
    for b in sizes:
        batch = [prompts[i % len(prompts)] for i in range(b)]
        rates, als = [], []
        for _ in range(a.repeats):
            t = time.perf_counter()
            r = engine.generate(batch, sp)
            rates.append(b * a.new_tokens / (time.perf_counter() - t))
            als.append(r.metrics["acceptance_length"])
        out[b] = {"tok_s": statistics.median(rates), "al": statistics.mean(als)}
    print("RESULT " + json.dumps(out), flush=True)
    if hasattr(engine, "close"):
        engine.close()


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--worker", action="store_true")
    ap.add_argument("--backend", default="native")
    ap.add_argument("--drafter", default="none")
    ap.add_argument("--k", type=int, default=3)
    ap.add_argument("--batch-sizes", default="1,8,32")
    ap.add_argument("--new-tokens", type=int, default=64)
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--drafters", default="none,ngram,eagle:default")
    ap.add_argument("--draft-sample", default="greedy", help="(worker) vLLM's draft_sample_method")
    ap.add_argument("--dtype", default="auto", choices=DTYPES,
                    help="model dtype of both backends (auto: bf16 where the CPU has bf16 units, else float32)")
    a = ap.parse_args()
    a.dtype = dtype_name(a.dtype)
    if a.worker:
        return worker(a)
    hw = run_header({"model": a.dtype, "vllm": a.dtype}, a.threads)
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "OMP_NUM_THREADS": str(a.threads),
           "VLLM_CPU_OMP_THREADS_BIND": os.environ.get("VLLM_CPU_OMP_THREADS_BIND",
                                                       "0" if a.threads == 1 else f"0-{a.threads - 1}")}
    table = {}
    arms = {}
    for drafter in a.drafters.split(","):
        arms[drafter] = [("native", "greedy"), ("vllm", "greedy")]
        if drafter.startswith("eagle"):
            arms[drafter].append(("vllm", "probabilistic"))
        for backend, sample in arms[drafter]:
            cmd = [sys.executable, __file__, "--worker", "--backend", backend, "--drafter", drafter, "--k", str(a.k),
                   "--batch-sizes", a.batch_sizes, "--new-tokens", str(a.new_tokens), "--repeats", str(a.repeats),
                   "--threads", str(a.threads), "--draft-sample", sample, "--dtype", a.dtype]
            res = subprocess.run(cmd, capture_output=True, text=True, env=env)
            line = [x for x in res.stdout.splitlines() if x.startswith("RESULT ")]
            if not line:
                sys.exit(f"{backend} {drafter} failed:\n{res.stdout[-3000:]}\n{res.stderr[-6000:]}")
            table[(drafter, backend, sample)] = json.loads(line[0][7:])
            print(f"done {backend} {drafter} {sample}", file=sys.stderr, flush=True)
    print(f"hardware: {hardware_line(hw)}")
    print(f"{'drafter':>14} {'B':>3} {'native tok/s':>13} {'AL':>5} {'vllm tok/s':>11} {'AL':>5} {'vllm/native':>12} "
          f"{'vllm full-q tok/s':>18} {'AL':>5}")
    for drafter in a.drafters.split(","):
        for b in a.batch_sizes.split(","):
            n, v = table[(drafter, "native", "greedy")][b], table[(drafter, "vllm", "greedy")][b]
            row = (f"{drafter:>14} {b:>3} {n['tok_s']:>13.1f} {n['al']:>5.2f} {v['tok_s']:>11.1f} {v['al']:>5.2f} "
                   f"{v['tok_s'] / n['tok_s']:>11.2f}x")
            if (drafter, "vllm", "probabilistic") in table:
                q = table[(drafter, "vllm", "probabilistic")][b]
                row += f" {q['tok_s']:>18.1f} {q['al']:>5.2f}"
            print(row)

if __name__ == "__main__":
    main()

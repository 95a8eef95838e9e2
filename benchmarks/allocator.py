"""glibc's allocator and the engine: large temporaries page-faulted in every step, or kept in the heap.

`specrl.cpu.keep_large_allocations()` (called by async rollout workers, generation-only processes) sets glibc's
mmap threshold so that a decode step's [B, V] temporaries are reused instead of mapped and unmapped each step.
The setting is process-wide, so each arm is a fresh subprocess: "default" keeps glibc's behaviour, "kept" calls
it first. Arms alternate --repeats times; each reports tok/s and minor page faults per
decode step (B sequences x --new-tokens, --dtype: auto = bf16 on CPUs with bf16 units, else fp32, --threads).

    .venv/bin/python benchmarks/allocator.py --batch-size 32 --threads 1 --repeats 2
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
from common import DTYPES, dtype_name, hardware_line, run_header  # noqa: E402


def worker(a) -> None:
    import resource
    import time

    import torch

    torch.set_num_threads(a.threads)
    import specrl.cpu

    if a.arm == "kept":
        assert specrl.cpu.keep_large_allocations()
    from common import prompt_ids

    from specrl import RolloutEngine, SamplingParams, load_model
    from specrl.model.hf_checkpoint import load_tokenizer
    from specrl.model.presets import prepare

    model, _ = load_model("smollm2-135m", dtype=getattr(torch, a.dtype))
    ids = prompt_ids(load_tokenizer(prepare("smollm2-135m")), a.batch_size)
    engine = RolloutEngine(model, max_batch_size=a.batch_size, max_seq_len=512)
    out = {}
    for mode, temp in (("greedy", 0.0), ("T=1", 1.0)):
        engine.generate(ids, SamplingParams(temperature=temp, max_new_tokens=4))
        f0, t = resource.getrusage(resource.RUSAGE_SELF).ru_minflt, time.perf_counter()
        engine.generate(ids, SamplingParams(temperature=temp, max_new_tokens=a.new_tokens))
        dt = time.perf_counter() - t
        out[mode] = {"tok_s": a.batch_size * a.new_tokens / dt,
                     "faults_per_step": (resource.getrusage(resource.RUSAGE_SELF).ru_minflt - f0) / a.new_tokens}
    print("RESULT " + json.dumps(out), flush=True)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--worker", action="store_true")
    ap.add_argument("--arm", choices=("default", "kept"), default="kept")
    ap.add_argument("--batch-size", type=int, default=32)
    ap.add_argument("--new-tokens", type=int, default=64)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--dtype", default="auto", choices=DTYPES, help="model dtype (auto: bf16 where the CPU has bf16 "
                    "units, else float32)")
    a = ap.parse_args()
    a.dtype = dtype_name(a.dtype)
    if a.worker:
        return worker(a)
    hw = run_header({"model": a.dtype}, a.threads)
    got: dict[str, list[dict]] = {"default": [], "kept": []}
    for _ in range(a.repeats):
        for arm in got:
            res = subprocess.run([sys.executable, __file__, "--worker", "--arm", arm, "--batch-size",
                                  str(a.batch_size), "--new-tokens", str(a.new_tokens), "--threads", str(a.threads),
                                  "--dtype", a.dtype],
                                 capture_output=True, text=True)
            line = [x for x in res.stdout.splitlines() if x.startswith("RESULT ")]
            if not line:
                sys.exit(f"worker failed:\n{res.stderr[-6000:]}")
            got[arm].append(json.loads(line[0][7:]))
    print(f"B={a.batch_size}, {a.new_tokens} new tokens, {a.threads} thread(s), {a.dtype}; median of {a.repeats}; "
          f"{hardware_line(hw)}")
    print("| mode | glibc default tok/s | kept in heap tok/s | ratio | page faults per step (default → kept) |")
    print("|---|---|---|---|---|")
    for mode in ("greedy", "T=1"):
        d = statistics.median(r[mode]["tok_s"] for r in got["default"])
        k = statistics.median(r[mode]["tok_s"] for r in got["kept"])
        fd = statistics.median(r[mode]["faults_per_step"] for r in got["default"])
        fk = statistics.median(r[mode]["faults_per_step"] for r in got["kept"])
        print(f"| {mode} | {d:.1f} | {k:.1f} | {k / d:.2f}× | {fd:.0f} → {fk:.0f} |")


if __name__ == "__main__":
    main()

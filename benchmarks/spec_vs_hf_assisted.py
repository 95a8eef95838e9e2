"""Our speculative engine vs transformers assisted generation (`assistant_model=`), B=1, same model pair.

Target: SmolLM2-135M (bf16). Draft: the target's first --draft-layers layers + its final norm and head,
saved once as an HF checkpoint next to the model cache, loaded by both sides (a self-speculative "layer
skip" draft: no training needed, real but modest acceptance). Greedy and T=1, interleaved runs, exactly
--new-tokens tokens each; prints tokens/s of each, our acceptance length, and the ratio.

    .venv/bin/python benchmarks/spec_vs_hf_assisted.py [--draft-layers 8] [--k 4] [--threads 1]
"""

from __future__ import annotations

import argparse

import torch
from common import median, prompt_ids, timed


def layer_skip_draft(n_layers: int):
    import copy

    from specrl.model.checkpoint import load_checkpoint, save_checkpoint
    from specrl.model.presets import cache_root, prepare

    out = cache_root() / "models" / f"smollm2-135m-first{n_layers}"
    if not (out / "model.safetensors").exists():
        full = load_checkpoint(prepare("smollm2-135m"), dtype=torch.float32)
        small = copy.deepcopy(full)
        small.layers = small.layers[:n_layers]
        small.args.num_layers = n_layers
        save_checkpoint(small, out)
    return out


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--draft-layers", type=int, default=8)
    ap.add_argument("--k", type=int, default=4)
    ap.add_argument("--new-tokens", type=int, default=64)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--threads", type=int, default=torch.get_num_threads())
    a = ap.parse_args()
    torch.set_num_threads(a.threads)
    from transformers import AutoModelForCausalLM

    from specrl import RolloutEngine, SamplingParams, load_model
    from specrl.drafters import DraftModelDrafter
    from specrl.model.checkpoint import load_checkpoint
    from specrl.model.presets import prepare

    draft_dir = layer_skip_draft(a.draft_layers)
    target, tok = load_model("smollm2-135m", dtype=torch.bfloat16)
    draft = load_checkpoint(draft_dir, dtype=torch.bfloat16)
    hf_t = AutoModelForCausalLM.from_pretrained(str(prepare("smollm2-135m")), dtype=torch.bfloat16).eval()
    hf_d = AutoModelForCausalLM.from_pretrained(str(draft_dir), dtype=torch.bfloat16).eval()
    engine = RolloutEngine(target, max_batch_size=1, max_seq_len=512, drafter=DraftModelDrafter(draft),
                           num_draft_tokens=a.k)
    print(f"draft = first {a.draft_layers} of 30 layers, k={a.k}, threads={a.threads}, B=1")
    print(f"{'mode':>6} {'prompt':>6} {'ours tok/s':>10} {'HF assisted tok/s':>18} {'AL':>5} {'ratio':>6}")
    for mode in ("greedy", "T=1"):
        temp = 0.0 if mode == "greedy" else 1.0
        ours, theirs, als = [], [], []
        for ids in prompt_ids(tok, 4):
            x = torch.tensor([ids])
            kw = dict(max_new_tokens=a.new_tokens, min_new_tokens=a.new_tokens, assistant_model=hf_d,
                      do_sample=temp > 0, pad_token_id=tok.eos_token_id, num_assistant_tokens=a.k)
            if temp > 0:
                kw.update(temperature=1.0, top_k=0, top_p=1.0)
            with torch.no_grad():
                for r in range(a.repeats):
                    sp = SamplingParams(temperature=temp, max_new_tokens=a.new_tokens, seed=r)
                    dt, _ = timed(lambda: engine.generate([ids], sp))  # noqa: B023
                    ours.append(a.new_tokens / dt)
                    als.append(engine.last_metrics["acceptance_length"])
                    dt, _ = timed(lambda: hf_t.generate(x, **kw))  # noqa: B023
                    theirs.append(a.new_tokens / dt)
        print(f"{mode:>6} {'all':>6} {median(ours):>10.1f} {median(theirs):>18.1f} {median(als):>5.2f} "
              f"{median(ours) / median(theirs):>5.2f}x", flush=True)


if __name__ == "__main__":
    main()

"""Our speculative engine vs transformers assisted generation (`assistant_model=`), B=1, same model pair.

Target: SmolLM2-135M in --dtype (auto: bf16 on CPUs with bf16 units, else float32; the draft too). Draft
(`--draft`): an HF checkpoint directory with the target's tokenizer, loaded by both sides. Default: the target's
first --draft-layers layers + its final norm and head, untrained (a "layer skip" draft, AL ~1.05); a distilled one
comes from `specrl draft init --drafter draft-model --out DIR`. If DIR has a `draft_vocab.json`, our engine drafts
over that subset of the head (transformers cannot; it loads the same weights).

Four configurations per sampling mode, each run interleaved over the same prompts and seeds:
  ours k=K       our engine, K drafts per step
  ours auto      our engine, adaptive draft length (the default a user would pick)
  HF k=K         transformers with the assistant's generation config set to K tokens, constant schedule and no
                 confidence stop (the same work per step as ours k=K)
  HF default     transformers' own defaults for the assistant: up to 20 tokens, stop drafting when the draft's
                 probability falls below 0.4 (what a user gets without tuning)
Both sides stop at the end-of-turn token or --new-tokens; tokens/s = generated tokens / wall seconds, summed over
all runs. Prints tokens/s, our acceptance length, and ours/HF ratios (same k, and best of each side), after a line
naming the processor class, cores, threads and dtype.

    .venv/bin/python benchmarks/spec_vs_hf_assisted.py --draft DIR --task chain_sum [--k 3] [--threads 1]
"""

from __future__ import annotations

import argparse
import copy
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import DTYPES, dtype_name, prompt_ids, run_header, timed  # noqa: E402


def layer_skip_draft(n_layers: int):
    from specrl.drafters.kinds.draft_model import slice_layers
    from specrl.drafters.training.build.from_rollouts import save_draft_model
    from specrl.model.hf_checkpoint import load_hf_checkpoint
    from specrl.model.presets import cache_root, prepare

    out = cache_root() / "models" / f"smollm2-135m-first{n_layers}"
    if not (out / "tokenizer.json").exists():
        full = load_hf_checkpoint(prepare("smollm2-135m"), dtype=torch.float32)
        save_draft_model(slice_layers(full, range(n_layers)), "smollm2-135m", out)
    return out


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--draft", default=None, help="draft model directory (default: untrained first --draft-layers)")
    ap.add_argument("--draft-layers", type=int, default=8)
    ap.add_argument("--k", type=int, default=3)
    ap.add_argument("--new-tokens", type=int, default=64)
    ap.add_argument("--prompts", type=int, default=8)
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--task", default=None, help="in-domain prompts of this task (e.g. chain_sum) instead of the "
                    "generic prompt set")
    ap.add_argument("--modes", default="greedy,T=1")
    ap.add_argument("--threads", type=int, default=torch.get_num_threads())
    ap.add_argument("--dtype", default="auto", choices=DTYPES,
                    help="target and draft dtype, both sides (auto: bf16 where the CPU has bf16 units, else float32)")
    a = ap.parse_args()
    torch.set_num_threads(a.threads)
    a.dtype = dtype_name(a.dtype)
    run_header({"target": a.dtype, "draft": a.dtype}, a.threads)
    tdt = getattr(torch, a.dtype)
    from transformers import AutoModelForCausalLM

    from specrl import RolloutEngine, SamplingParams, load_model
    from specrl.drafters import DraftModelDrafter, read_draft_vocab
    from specrl.model.hf_checkpoint import load_hf_checkpoint
    from specrl.model.presets import prepare
    from specrl.model.tokenizer import stop_token_ids

    draft_dir = a.draft or layer_skip_draft(a.draft_layers)
    target, tok = load_model("smollm2-135m", dtype=tdt)
    stops = stop_token_ids(tok, target.args)
    if a.task:
        from specrl.data.tasks import PromptFormatter, make_task

        _, val = make_task(a.task, difficulty="easy", train_size=4, val_size=a.prompts, seed=1)
        fmt = PromptFormatter(tok)
        prompts = [fmt.encode(p.question) for p in val.problems][: a.prompts]
    else:
        prompts = prompt_ids(tok, a.prompts)
    hf_t = AutoModelForCausalLM.from_pretrained(str(prepare("smollm2-135m")), dtype=tdt, trust_remote_code=False).eval()
    hf_fixed = AutoModelForCausalLM.from_pretrained(str(draft_dir), dtype=tdt, trust_remote_code=False).eval()
    hf_fixed.generation_config.num_assistant_tokens = a.k
    hf_fixed.generation_config.num_assistant_tokens_schedule = "constant"
    hf_fixed.generation_config.assistant_confidence_threshold = 0.0
    hf_default = copy.copy(hf_fixed)  # same weights, transformers' default assistant settings
    hf_default.generation_config = copy.deepcopy(hf_fixed.generation_config)
    for key in ("num_assistant_tokens", "num_assistant_tokens_schedule", "assistant_confidence_threshold"):
        setattr(hf_default.generation_config, key, None)  # -> library defaults (20, constant, 0.4)

    def ours(k):  # with the draft vocabulary stored next to the checkpoint, if any (transformers ignores it)
        draft = load_hf_checkpoint(draft_dir, dtype=tdt)
        vocab = read_draft_vocab(Path(draft_dir), draft.args.vocab_size)
        return RolloutEngine(target, max_batch_size=1, max_seq_len=512,
                             drafter=DraftModelDrafter(draft, draft_vocab=vocab), num_draft_tokens=k)

    engines = {f"ours k={a.k}": ours(a.k), "ours auto": ours("auto")}
    assistants = {f"HF k={a.k}": hf_fixed, "HF default": hf_default}
    with torch.no_grad():  # warm up every configuration once (first-call allocations are not what we compare)
        for eng in engines.values():
            eng.generate([prompts[0]], SamplingParams(temperature=0.0, max_new_tokens=8))
        for asst in assistants.values():
            hf_t.generate(torch.tensor([prompts[0]]), assistant_model=asst, max_new_tokens=8, do_sample=False,
                          pad_token_id=tok.eos_token_id)
    print(f"draft = {draft_dir}, k={a.k}, threads={a.threads}, B=1, {len(prompts)} prompts "
          f"({a.task or 'generic'}) x {a.repeats} seeds, <= {a.new_tokens} new tokens")
    print(f"{'mode':>6} " + " ".join(f"{n:>12}" for n in [*engines, *assistants]) +
          f" {'AL k':>5} {'AL auto':>7} {'same-k':>7} {'best/best':>9}   (tokens/s)")
    for mode in a.modes.split(","):
        temp = 0.0 if mode == "greedy" else float(mode.removeprefix("T="))
        toks = {n: 0 for n in [*engines, *assistants]}
        secs = {n: 0.0 for n in toks}
        als = {n: [] for n in engines}
        for ids in prompts:
            x = torch.tensor([ids])
            kw = dict(max_new_tokens=a.new_tokens, do_sample=temp > 0, pad_token_id=tok.eos_token_id,
                      eos_token_id=list(stops))
            if temp > 0:
                kw.update(temperature=temp, top_k=0, top_p=1.0)
            with torch.no_grad():
                for r in range(a.repeats):
                    sp = SamplingParams(temperature=temp, max_new_tokens=a.new_tokens, stop_token_ids=stops, seed=r)
                    for name, eng in engines.items():
                        dt, out = timed(lambda eng=eng, ids=ids, sp=sp: eng.generate([ids], sp))
                        toks[name] += len(out[0].token_ids)
                        secs[name] += dt
                        als[name].append(out.metrics["acceptance_length"])
                    for name, asst in assistants.items():
                        torch.manual_seed(r)
                        dt, out = timed(lambda asst=asst, x=x, kw=kw: hf_t.generate(x, assistant_model=asst,
                                                                                         **kw))
                        toks[name] += out.shape[1] - x.shape[1]
                        secs[name] += dt
        tps = {n: toks[n] / secs[n] for n in toks}
        same = tps[f"ours k={a.k}"] / tps[f"HF k={a.k}"]
        best = max(tps[n] for n in engines) / max(tps[n] for n in assistants)
        al_k, al_auto = (sum(v) / len(v) for v in als.values())
        print(f"{mode:>6} " + " ".join(f"{tps[n]:>12.1f}" for n in tps) +
              f" {al_k:>5.2f} {al_auto:>7.2f} {same:>6.2f}x {best:>8.2f}x", flush=True)


if __name__ == "__main__":
    main()

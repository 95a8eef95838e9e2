"""TRL's GRPOTrainer three ways, side by side: TRL's own generation, TRL + specrl plain decoding, TRL + specrl
speculative (`specrl.integrations.trl.rollout_func`), on the long-reasoning main job's task and lengths.

The three trainers start from the same weights and seed, see the same prompts and run the same GRPO settings;
their steps are interleaved (step 1 of each arm, then step 2 of each, ...) so a change in the machine's load
falls on every arm alike. Each step is TRL's own `training_step` (generation, scoring, loss, backward) plus the
optimizer step, driven here instead of by `trainer.train()` so the arms can alternate. Reported per arm: step
seconds, generated tokens, generation seconds (specrl arms: the engine's own clock), AL; and the ratios per step
and per generated token against TRL's generation and against specrl plain decoding, over steps 2.. (step 1 warms
up). It also measures token_mult_prob_error (mean over tokens of exp|log p_returned - log p_TRL|) of the specrl
arms' returned log-probs against TRL's recomputation of the same tokens (fp32, temperature only).

    .venv/bin/python benchmarks/trl_rollouts.py --steps 4 --threads 2 --out benchmarks/data/trl_rollouts.json
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRL_EXPERIMENTAL_SILENCE", "1")
HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
from common import run_header  # noqa: E402

ARMS = ("trl", "specrl-plain", "specrl-spec")


def make_trainer(arm: str, a, model_dir, rows, reward):
    import torch
    from datasets import Dataset
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from trl import GRPOConfig, GRPOTrainer

    from specrl.integrations.trl import rollout_func

    torch.manual_seed(a.seed)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32, trust_remote_code=False)
    tok = AutoTokenizer.from_pretrained(model_dir, trust_remote_code=False)
    args = GRPOConfig(output_dir=os.path.join(a.work, arm), max_steps=a.steps, per_device_train_batch_size=a.group,
                      num_generations=a.group, max_completion_length=a.max_completion_length,
                      temperature=a.temperature, learning_rate=2e-5, logging_steps=1, save_strategy="no",
                      report_to=[], use_cpu=True, seed=a.seed, gradient_checkpointing=False)
    rf = None
    if arm == "specrl-plain":
        rf = rollout_func(drafter="none", certificate=False)
    elif arm == "specrl-spec":
        rf = rollout_func(drafter=a.drafter, num_draft_tokens=a.k if a.k == "auto" else int(a.k), certificate=False)
    trainer = GRPOTrainer(model=model, processing_class=tok, reward_funcs=[reward], args=args,
                          train_dataset=Dataset.from_list(rows), rollout_func=rf)
    trainer.create_optimizer_and_scheduler(num_training_steps=a.steps)
    return trainer, rf, iter(trainer.get_train_dataloader())


def one_step(trainer, batch) -> None:
    trainer.model.train()
    trainer.current_gradient_accumulation_steps = 1  # what Trainer.train sets for each optimizer step
    trainer.training_step(trainer.model, batch, None)
    trainer.optimizer.step()
    trainer.lr_scheduler.step()
    trainer.optimizer.zero_grad()
    trainer.state.global_step += 1


def logprob_error(trainer, rf, prompts) -> float:
    import torch

    out = rf(prompts, trainer)
    errs = []
    for p, c, lp in zip(out["prompt_ids"], out["completion_ids"], out["logprobs"], strict=True):
        with torch.no_grad():
            logits = trainer.model(input_ids=torch.tensor([p + c])).logits[0, len(p) - 1:-1].float()
        ref = torch.log_softmax(logits / trainer.temperature, -1).gather(-1, torch.tensor(c)[:, None]).squeeze(-1)
        errs.append(torch.exp((ref - torch.tensor(lp)).abs()))
    return float(torch.cat(errs).mean())


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=4)
    ap.add_argument("--group", type=int, default=8, help="num_generations = per-device batch (one prompt a step)")
    ap.add_argument("--max-completion-length", type=int, default=512)
    ap.add_argument("--temperature", type=float, default=0.7)
    ap.add_argument("--drafter", default="eagle:think")
    ap.add_argument("--k", default="auto")
    ap.add_argument("--arms", default=",".join(ARMS))
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--work", default="/tmp/specrl-trl-rollouts")
    ap.add_argument("--out", default=None, help="write the JSON record here too")
    a = ap.parse_args()
    arms = [x for x in a.arms.split(",") if x]
    unknown = sorted(set(arms) - set(ARMS))
    if unknown or not arms:
        ap.error(f"--arms: unknown {unknown}; choose from {list(ARMS)}")
    if a.steps < 2:
        ap.error("--steps must be >= 2 (step 1 is a warm-up and is reported apart)")

    import torch

    torch.set_num_threads(a.threads)
    from specrl.integrations.trl.task import task_rows
    from specrl.model.presets import prepare
    from specrl.trainer.config_check import load_config

    rec = run_header({"rollout": "float32", "train": "float32"}, a.threads)
    model_dir = prepare("smollm2-135m")
    task = load_config(os.path.join(HERE, "..", "examples", "default.yaml")).task  # the main job's task
    rows, reward = task_rows(task.name, task.difficulty, task.answer_format, size=64, seed=a.seed)
    runs = {arm: make_trainer(arm, a, model_dir, rows, reward) for arm in arms}
    steps = {arm: [] for arm in arms}
    for s in range(a.steps):
        for arm in arms:
            trainer, rf, it = runs[arm]
            batch = next(it)
            t0 = time.perf_counter()
            one_step(trainer, batch)
            sec = time.perf_counter() - t0
            tokens = int(trainer._metrics["train"]["completions/mean_length"][-1] * len(batch))
            row = {"step": s + 1, "seconds": sec, "generated_tokens": tokens,
                   "reward": trainer._metrics["train"]["reward"][-1]}
            if rf is not None:
                h = rf.history[-1]
                row.update(generation_seconds=h["generation_seconds"], acceptance_length=h["acceptance_length"])
            trainer._metrics["train"].clear()
            steps[arm].append(row)
            print(f"[trl_rollouts] {arm:13s} step {s + 1}: {sec:6.1f} s, {tokens} tokens"
                  + (f", generation {row['generation_seconds']:.1f} s, AL {row['acceptance_length']:.2f}"
                     if rf is not None else ""), flush=True)

    def totals(arm):
        xs = steps[arm][1:]
        return sum(r["seconds"] for r in xs), sum(r["generated_tokens"] for r in xs), len(xs)

    summary = {}
    for arm in arms:
        sec, tok, n = totals(arm)
        summary[arm] = {"seconds_per_step": sec / n, "tokens_per_step": tok / n, "seconds_per_token": sec / tok}
        gen = [r["generation_seconds"] for r in steps[arm][1:] if "generation_seconds" in r]
        if gen:
            summary[arm]["generation_share"] = sum(gen) / sec
            summary[arm]["acceptance_length"] = sum(r["acceptance_length"] for r in steps[arm][1:]) / n
    ratios = {}
    for base in ("trl", "specrl-plain"):
        if base in summary and "specrl-spec" in summary:
            b, s_ = summary[base], summary["specrl-spec"]
            ratios[f"specrl-spec_vs_{base}"] = {"per_step": b["seconds_per_step"] / s_["seconds_per_step"],
                                                "per_token": b["seconds_per_token"] / s_["seconds_per_token"]}
    errors = {}
    prompts = [rows[0]["prompt"]] * a.group
    for arm in arms:
        trainer, rf, _ = runs[arm]
        if rf is not None:
            trainer.model.eval()
            errors[arm] = logprob_error(trainer, rf, prompts)
    out = {"hardware": rec, "args": vars(a), "steps": steps, "summary": summary, "ratios": ratios,
           "token_mult_prob_error": errors}
    for name, r in ratios.items():
        print(f"[trl_rollouts] {name}: RL step {r['per_step']:.2f}x per step, {r['per_token']:.2f}x per generated "
              f"token (steps 2..{a.steps})")
    for arm, e in errors.items():
        print(f"[trl_rollouts] {arm}: token_mult_prob_error {e:.5f} (fp32, T={a.temperature}, top_p=1, top_k=0)")
    if a.out:
        os.makedirs(os.path.dirname(a.out) or ".", exist_ok=True)
        with open(a.out, "w") as f:
            json.dump(out, f, indent=1)


if __name__ == "__main__":
    main()

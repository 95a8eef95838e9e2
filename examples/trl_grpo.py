"""A plain TRL GRPO script on specrl's embedded model, with specrl's speculative rollouts: one added argument.

    .venv/bin/python examples/trl_grpo.py                     # speculative (eagle:think, k auto)
    .venv/bin/python examples/trl_grpo.py --drafter none      # specrl's engine, plain decoding
    .venv/bin/python examples/trl_grpo.py --trl-generation    # TRL's own generation (no rollout_func)

Everything but `rollout_func=` is ordinary TRL: the model and tokenizer from a local checkpoint directory, a
`datasets.Dataset` of chat prompts, a reward function, `GRPOConfig`. The speculation figures (`specrl/...`) appear
in TRL's logs, and the losslessness certificate runs when training ends (`OUT/specrl_certificate.json`).
"""

import argparse
import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRL_EXPERIMENTAL_SILENCE", "1")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--drafter", default="eagle:think", help="a specrl drafter spec, or 'none' for plain decoding")
    ap.add_argument("--k", default="auto", help="draft tokens per verify step: 1..7 or auto")
    ap.add_argument("--trl-generation", action="store_true", help="TRL's own generation instead of specrl's")
    ap.add_argument("--steps", type=int, default=4)
    ap.add_argument("--max-completion-length", type=int, default=256)
    ap.add_argument("--threads", type=int, default=None)
    ap.add_argument("--out", default="runs/trl_grpo")
    a = ap.parse_args()

    import torch
    from datasets import Dataset
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from trl import GRPOConfig, GRPOTrainer

    from specrl.config.schema import load_config
    from specrl.integrations.trl import rollout_func
    from specrl.integrations.trl.task import task_rows
    from specrl.model.presets import prepare

    if a.threads:
        torch.set_num_threads(a.threads)
    model_dir = prepare("smollm2-135m")  # the embedded model, as an HF checkpoint directory
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    task = load_config(os.path.join(os.path.dirname(os.path.abspath(__file__)), "default.yaml")).task  # the main job's
    rows, reward = task_rows(task.name, task.difficulty, task.answer_format, size=256)
    args = GRPOConfig(output_dir=a.out, max_steps=a.steps, per_device_train_batch_size=8, num_generations=8,
                      max_completion_length=a.max_completion_length, temperature=0.7, learning_rate=2e-5,
                      logging_steps=1, save_strategy="no", report_to=[], use_cpu=True, seed=0)
    extra = {} if a.trl_generation else {
        "rollout_func": rollout_func(drafter=a.drafter, num_draft_tokens=a.k if a.k == "auto" else int(a.k))}
    trainer = GRPOTrainer(model=model, processing_class=tokenizer, reward_funcs=[reward], args=args,
                          train_dataset=Dataset.from_list(rows), **extra)
    trainer.train()
    for row in trainer.state.log_history:
        print({k: (round(v, 4) if isinstance(v, float) else v) for k, v in row.items()
               if k.startswith(("specrl/", "reward", "step", "train_runtime"))})


if __name__ == "__main__":
    main()

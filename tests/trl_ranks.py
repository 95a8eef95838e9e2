"""One rank of `tests/test_trl_integration.py`'s multi-process test (run by torchrun, 2 processes, gloo on CPU):
a TRL GRPOTrainer with specrl's rollout function on a tiny checkpoint; writes what its engine did to
OUT/rankN.json."""

import json
import os
import sys

os.environ.setdefault("TRL_EXPERIMENTAL_SILENCE", "1")
os.environ.setdefault("HF_HUB_OFFLINE", "1")

import torch  # noqa: E402

torch.set_num_threads(1)


def main(model_dir: str, out: str) -> None:
    from datasets import Dataset
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from trl import GRPOConfig, GRPOTrainer

    from specrl.integrations.trl import rollout_func

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    tok = AutoTokenizer.from_pretrained(model_dir)
    rows = [{"prompt": [{"role": "user", "content": f"{a} + {a + 1} = ?"}]} for a in range(16)]
    rf = rollout_func(drafter="ngram", num_draft_tokens=2, certificate_samples=16, certificate_target_w=0.5)
    seen = []
    inner = rf.__call__

    def spy(prompts, trainer):
        seen.append(prompts[0][0]["content"])
        return inner(prompts, trainer)

    args = GRPOConfig(output_dir=out, max_steps=2, per_device_train_batch_size=4, num_generations=4,
                      max_completion_length=12, temperature=1.0, learning_rate=1e-3, logging_steps=1,
                      save_strategy="no", report_to=[], use_cpu=True, seed=0, gradient_checkpointing=False)
    trainer = GRPOTrainer(model=model, processing_class=tok, args=args, train_dataset=Dataset.from_list(rows),
                          reward_funcs=[lambda completions, **k: [float(len(c[-1]["content"]) % 3)
                                                                  for c in completions]], rollout_func=spy)
    trainer.train()
    rank = trainer.accelerator.process_index
    with open(os.path.join(out, f"rank{rank}.json"), "w") as f:
        json.dump({"rank": rank, "world": trainer.accelerator.num_processes, "versions": [h["step"] for h in
                   rf.history], "seed": rf.seed, "prompts": seen, "digest": rf.synced_digest,
                   "certificate_tokens": rf.certificate and rf.certificate["num_tokens"]}, f)


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])

"""specrl.rl: synchronous GRPO with speculative rollouts.

tasks.py (reasoning-gym prompts, answers, rewards) · grpo.py (advantages, DAPO loss, KL, diagnostics) ·
config.py (the `specrl train` YAML schema and its errors) · trainer.py (the five-stage step, `train_main`) ·
run.py (run loop, resume, compare mode) · weight_sync.py · draft_online.py (online drafter loss, staleness and
collapse bookkeeping) · checkpoint.py (atomic, verified checkpoints) · metrics.py / report.py (metrics.jsonl,
TensorBoard, report.md, frozen vs online AL plot) · testing.py (tiny offline model + tokenizer for tests).
"""

"""specrl.rl: GRPO post-training that consumes rollouts through the rollout backend protocol.

This package owns the tasks and their rewards (`tasks.py`), the GRPO math (`grpo.py`), the `specrl train`
config schema (`config.py`), the producer that turns data and generation into Rollouts (`producer.py`), the
learner that recomputes log-probs, takes the policy step and trains the drafter online (`learner.py`,
`draft_online.py`), the synchronous trainer composing the two (`trainer.py`), versioned weight sync to the
backend (`weight_sync.py`), the in-domain default drafter (`default_drafter.py`), the run loop with resume and
compare mode (`run.py`), checkpoints (`checkpoint.py`), per-step metrics and the end-of-run report
(`metrics.py`, `report.py`), user datasets (`data.py`) and reward functions (`rewards.py`).
"""

"""specrl's speculative rollouts inside TRL's `GRPOTrainer`: one added argument.

    from specrl.integrations.trl import rollout_func
    trainer = GRPOTrainer(model=model, reward_funcs=[...], args=GRPOConfig(...), train_dataset=ds,
                          rollout_func=rollout_func(drafter="eagle:think", num_draft_tokens="auto"))

`rollout.py` is the callable TRL calls (engine, weight sync with acknowledgement, tokenization as TRL does,
behaviour log-probs, figures into TRL's logs); `weights.py` turns the trainer's (PEFT-merged) model into the
engine's; `checks.py` refuses what the engine would not honour; `callback.py` runs the losslessness certificate
at the end of training; `vllm.py` builds the vLLM backend instead of the native engine; `task.py` turns a
specrl task into TRL rows and a TRL reward function (the example and the benchmark use it). docs/trl.md says
what works and what a user must set so the log-probs agree with TRL's scoring.
"""

from specrl.integrations.trl.checks import TRL_MIN
from specrl.integrations.trl.rollout import SpecRLRollouts, rollout_func

__all__ = ["rollout_func", "SpecRLRollouts", "TRL_MIN"]

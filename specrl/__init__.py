"""specrl: RL post-training with lossless speculative rollouts.

The public surface: `train` (GRPO from Python: model, dataset, reward functions, a `TrainConfig`; see
`specrl.api`), `TrainConfig` and `load_config` (the `specrl train` YAML schema), `load_model` (HF checkpoint
directories and the embedded preset), `RolloutEngine` (batched autoregressive and speculative generation, the
native rollout backend), `SamplingParams`, and the protocol's request/result types (`RolloutRequest`,
`RolloutOutput`, `GenerationResult`). Imported lazily so that `import specrl` (and the CLI) start fast.
"""

__all__ = ["train", "TrainConfig", "load_config", "load_model", "RolloutEngine", "RolloutOutput", "RolloutRequest",
           "GenerationResult", "SamplingParams"]
__version__ = "0.1.0"

_LAZY = {
    "train": "specrl.api",
    "TrainConfig": "specrl.config.schema",
    "load_config": "specrl.trainer.config_check",
    "load_model": "specrl.model.loader",
    "RolloutEngine": "specrl.rollout.engine",
    "RolloutOutput": "specrl.rollout.protocol",
    "RolloutRequest": "specrl.rollout.protocol",
    "GenerationResult": "specrl.rollout.protocol",
    "SamplingParams": "specrl.rollout.sampling",
}


def __getattr__(name: str):
    if name in _LAZY:
        import importlib

        return getattr(importlib.import_module(_LAZY[name]), name)
    raise AttributeError(f"module 'specrl' has no attribute {name!r}")

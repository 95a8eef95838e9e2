"""specrl: RL post-training with lossless speculative rollouts.

The public surface: `load_model` (HF checkpoint directories and the embedded preset), `RolloutEngine`
(batched autoregressive and speculative generation, the native rollout backend), `SamplingParams`, and the
protocol's request/result types (`RolloutRequest`, `RolloutOutput`, `GenerationResult`). Imported lazily so that
`import specrl` (and the CLI) start fast.
"""

__all__ = ["load_model", "RolloutEngine", "RolloutOutput", "RolloutRequest", "GenerationResult", "SamplingParams"]
__version__ = "0.1.0"

_LAZY = {
    "load_model": "specrl.model.loader",
    "RolloutEngine": "specrl.rollout.engine",
    "RolloutOutput": "specrl.rollout.api",
    "RolloutRequest": "specrl.rollout.api",
    "GenerationResult": "specrl.rollout.api",
    "SamplingParams": "specrl.rollout.sampling",
}


def __getattr__(name: str):
    if name in _LAZY:
        import importlib

        return getattr(importlib.import_module(_LAZY[name]), name)
    raise AttributeError(f"module 'specrl' has no attribute {name!r}")

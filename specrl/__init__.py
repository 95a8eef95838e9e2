"""specrl: RL post-training with lossless speculative rollouts.

The public surface: `load_model` (HF checkpoint directories and the embedded preset), `RolloutEngine`
(batched autoregressive and speculative generation) and `SamplingParams`.
"""

from specrl.model.checkpoint import load_model
from specrl.rollout.engine import RolloutEngine, RolloutOutput
from specrl.rollout.sampling import SamplingParams

__all__ = ["load_model", "RolloutEngine", "RolloutOutput", "SamplingParams"]
__version__ = "0.1.0"

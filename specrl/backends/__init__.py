"""specrl.backends: other generation engines behind the rollout backend protocol (`specrl.rollout.protocol`).

This package owns adapters that let a trainer generate rollouts with an engine other than the native
`specrl.rollout.engine` (`vllm.py`: vLLM, with `vllm_worker.py` running inside vLLM's worker), each declaring
its `capabilities` so an unsupported request fails as a config error, and the losslessness probe that tests any
backend statistically through its own `generate` (`probe.py`, with its per-draft-position tests in
`probe_positions.py`); `registry.py` builds whichever one the config
names. It may import the layers below it (`specrl.errors`, `specrl.config`, `specrl.model`, `specrl.rollout`,
`specrl.drafters`), never `specrl.trainer` or above.
"""

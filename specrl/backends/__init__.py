"""specrl.backends: other generation engines behind the rollout backend protocol (`specrl.rollout.api`).

This package owns adapters that let a trainer generate rollouts with an engine other than the native
`specrl.rollout.engine` (a vLLM backend is to come), each declaring its `capabilities` so an unsupported
request fails as a config error. It may import `specrl.errors`, `specrl.model`, `specrl.rollout` and
`specrl.drafters`, never `specrl.rl`.
"""

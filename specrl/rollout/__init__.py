"""specrl.rollout: generating rollouts, and the contracts every generator and drafter must meet.

This package owns the rollout backend protocol (`protocol.py`: `generate`, `load_weights`, `capabilities`,
`policy_version`), the drafter protocol (`drafter.py`: how a drafter binds to an engine and proposes tokens), the
drafter specs and the table of drafter kinds (`drafter_spec.py`), sampling parameters and position-keyed
randomness (`sampling.py`), the generation metrics (`generation_metrics.py`), refit acknowledgements
(`digest.py`) and the native engine that implements the protocol (`engine.py`, with its sequence bookkeeping in
`sequences.py`); speculative decoding's decisions
are in `spec_decode/` (THE verifier, the adaptive draft length, per-row budgets). It imports the layers below it
(`specrl.errors`, `specrl.model`, `specrl.config`'s leaf sections); concrete drafters live one layer up in
`specrl.drafters`.
"""

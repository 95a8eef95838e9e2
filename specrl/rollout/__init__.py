"""specrl.rollout: generating rollouts, and the contracts every generator and drafter must meet.

This package owns the rollout backend protocol (`api.py`: `generate`, `load_weights`, `capabilities`,
`policy_version`), the drafter protocol (`drafter.py`: how a drafter binds to an engine and proposes tokens),
sampling parameters and position-keyed randomness (`sampling.py`), THE verifier that decides which drafted
tokens are kept (`verify.py`), the adaptive draft length controller (`adaptive.py`), the generation metrics
(`metrics.py`) and the native engine that implements the protocol (`engine.py`). It imports only
`specrl.errors` and `specrl.model`; concrete drafters live one layer up in `specrl.drafters`.
"""

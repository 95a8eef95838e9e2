"""specrl.rollout.spec_decode: speculative decoding's decisions: the verifier (the one place that decides which
drafted tokens are kept), the adaptive draft length and the per-row draft budgets.
"""

"""specrl.trainer: one RL step in one process: the rollout producer, the policy learner, the synchronous trainer
that composes them, and the versioned weight sync (with its checks) between the learner and the rollout backend.
"""

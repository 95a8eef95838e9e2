"""specrl.drafters.training: the drafter's losses and fitting: offline distillation of the target's distributions,
and the online drafter loss computed from the policy's own forward inside an RL step.
"""

"""specrl.drafters.training: the drafter's losses and fitting: offline distillation of the target's distributions,
the online drafter loss computed from the policy's own forward inside an RL step, and the online drafter's trainer
(`trainer.DrafterTrainer`: its optimizer, clipping, refresh schedule, health checks and checkpoint state).
"""

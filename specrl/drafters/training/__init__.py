"""specrl.drafters.training: making drafters: offline distillation of the target's distributions (`offline.py`),
the online drafter loss computed from the policy's own forward inside an RL step (`online.py`), the online drafter's
trainer (`trainer.DrafterTrainer`: its optimizer, clipping, refresh schedule, health checks and checkpoint state),
and building a drafter offline from in-domain rollouts (`build/`).
"""

"""specrl.run: a training run around the step: the loop (validation, checkpoints, resume, signals), compare mode,
the run directory and the run's own losslessness certificate.
"""

"""specrl.checkpoint: training state on disk: atomic, checksummed step directories and the DCP state of the policy and
optimizer for any world size.
"""

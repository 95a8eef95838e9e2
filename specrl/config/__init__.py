"""specrl.config: the training config: its YAML sections, loading and cross-field checks, and the hardware
(device, precisions) it resolves to at the start of a run.
"""

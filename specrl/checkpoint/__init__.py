"""specrl.checkpoint: training state on disk: atomic, checksummed step directories whose model and optimizer state is
one DCP directory for every world size.
"""

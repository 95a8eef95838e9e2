"""specrl.algorithms: the RL mathematics as tensor functions: advantages, policy losses, log-probabilities through the
LM head, one step's rollouts and their collation into mini- and micro-batches. No model, optimizer, process or file.
"""

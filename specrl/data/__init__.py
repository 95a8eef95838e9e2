"""specrl.data: what a run trains on and how it is scored: the built-in reasoning tasks, users' datasets from local
files, prompt formatting and reward functions.
"""

"""Reward functions for examples/custom_task: each is fn(prompt, completion, row) -> float.

`row` is the dataset row the prompt came from: here {"prompt": ..., "answer": ..., "source": ...}.
"""

import re

_NUMBER = re.compile(r"-?\d+")


def exact_match(prompt: str, completion: str, row: dict) -> float:
    """1.0 when the last number in the completion is the reference answer (the primary reward: accuracy)."""
    numbers = _NUMBER.findall(completion)
    return 1.0 if numbers and numbers[-1] == row["answer"] else 0.0


def brevity(prompt: str, completion: str, row: dict) -> float:
    """1.0 for an answer of at most 8 words, falling to 0 at 40 words (the config weighs it 0.1)."""
    words = len(completion.split())
    return max(0.0, min(1.0, (40 - words) / 32))

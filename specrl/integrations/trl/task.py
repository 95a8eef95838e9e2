"""A specrl task as TRL wants it: conversational prompt rows and a TRL reward function.

`task_rows(name, difficulty, answer_format, size, seed)` renders reasoning-gym problems (`specrl.data.tasks`) as
rows `{"prompt": [{"role": "user", "content": question + instruction}], "problem": i}` for a `datasets.Dataset`;
`task_reward(...)` is a TRL reward function `f(prompts, completions, problem, **kwargs) -> list[float]` that
scores each completion with the task's own scorer, exactly as `specrl train` does. The TRL example and the TRL
benchmark use them so they train on the main job's task.
"""

from __future__ import annotations

from collections.abc import Callable

from specrl.data.tasks import ANSWER_FORMATS, make_task, resolve_answer_format, score_response


def task_rows(name: str, difficulty: str, answer_format: str = "reasoning", size: int = 256,
              seed: int = 0) -> tuple[list[dict], Callable]:
    """(rows, reward function) of `size` train problems of a reasoning-gym task."""
    fmt = resolve_answer_format(name, answer_format)
    train, _ = make_task(name, difficulty, train_size=size, val_size=0, seed=seed)
    rows = [{"prompt": [{"role": "user", "content": f"{p.question.rstrip()}\n{ANSWER_FORMATS[fmt]}"}], "problem": i}
            for i, p in enumerate(train.problems)]

    def task_reward(prompts, completions, problem, **kwargs) -> list[float]:
        out = []
        for c, i in zip(completions, problem, strict=True):
            text = c[-1]["content"] if isinstance(c, list) else c
            out.append(score_response(train, train.problems[int(i)], text, 0.0, fmt).reward)
        return out

    task_reward.__name__ = f"{name}_reward"
    return rows, task_reward


"""Rewards: user functions by import path, weighted like TRL's `reward_funcs` / `reward_weights`.

A reward function has the signature `fn(prompt: str, completion: str, row: dict) -> float`: the rendered prompt
text, the decoded completion, and the dataset row it came from (every column, e.g. `answer`). `load_reward_fn`
resolves `package.module:function` (importable from the current directory or the installed packages) or
`path/to/file.py:function`. `RewardSet` scores a completion with every function, checks each value is a finite
number (a function that raises or returns NaN/inf stops the step naming the function and the row: nothing is
trained on a broken reward) and returns the weighted total and the per-function values. The built-in
reasoning-gym scorer is an instance of the same interface (`TaskReward`, plus `FormatReward` when
`task.format_weight > 0`), so the default task and a user's task go through one code path. Accuracy counts a
sample as correct when the first (primary) function gives it full marks (>= 1).
"""

from __future__ import annotations

import importlib
import importlib.util
import math
import sys
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from specrl.data.tasks import TaskData, extract_answer
from specrl.errors import SpecRLError

RewardFn = Callable[[str, str, dict], float]
FULL_MARKS = 1.0


def load_reward_fn(spec: str) -> RewardFn:
    """`package.module:function` or `path/to/file.py:function` -> the callable, with errors that say which."""
    module_name, sep, attr = str(spec).rpartition(":")
    if not sep or not module_name or not attr:
        raise SpecRLError(f"reward function {spec!r}: expected 'package.module:function' or 'path/file.py:function'")
    if module_name.endswith(".py") or "/" in module_name:
        from specrl.plugins import import_file, runtime_env_copy

        path = Path(module_name).resolve()
        if not path.is_file() and runtime_env_copy(path) is None:  # (a Ray actor on another node: its copy)
            raise SpecRLError(f"reward function {spec!r}: file {path} does not exist")

        try:  # once per process: the same file listed in `plugins` is the same module
            module = import_file(path, f"reward function {spec!r}")
        except SpecRLError as e:  # the user's module failed while importing: say so, with the cause
            cause = e.__cause__
            if cause is None or isinstance(cause, SpecRLError) and "does not exist" in str(e):
                raise
            raise SpecRLError(f"reward function {spec!r}: importing {path} raised {type(cause).__name__}: "
                              f"{cause}") from cause
    else:
        if "" not in sys.path:
            sys.path.insert(0, "")  # the current directory, as `python -m` has it
        try:
            module = importlib.import_module(module_name)
        except ModuleNotFoundError as e:
            raise SpecRLError(f"reward function {spec!r}: module {module_name!r} not found ({e}); run from the "
                              "directory that holds it, install it, or give 'path/to/file.py:function'") from None
        except Exception as e:
            raise SpecRLError(f"reward function {spec!r}: importing {module_name} raised {type(e).__name__}: "
                              f"{e}") from e
    fn = getattr(module, attr, None)
    if fn is None:
        public = sorted(n for n in vars(module) if not n.startswith("_") and callable(getattr(module, n)))
        raise SpecRLError(f"reward function {spec!r}: {module_name} has no {attr!r}; callables there: {public}")
    if not callable(fn):
        raise SpecRLError(f"reward function {spec!r}: {attr} is a {type(fn).__name__}, not a function")
    return fn


class TaskReward:
    """The reasoning-gym scorer of a built-in task: the extracted answer's score (0 when none is found)."""

    def __init__(self, task: TaskData, answer_format: str):
        self.task, self.answer_format = task, answer_format

    def __call__(self, prompt: str, completion: str, row: dict) -> float:
        answer = extract_answer(completion, self.answer_format)
        return self.task.score_entry(answer, row) if answer is not None else 0.0


class FormatReward:
    """1 when an answer can be read back from the completion (`task.format_weight` weighs it)."""

    def __init__(self, answer_format: str):
        self.answer_format = answer_format

    def __call__(self, prompt: str, completion: str, row: dict) -> float:
        return 1.0 if extract_answer(completion, self.answer_format) is not None else 0.0


@dataclass
class Scored:
    reward: float
    components: dict[str, float]
    correct: bool


class RewardSet:
    """Weighted reward functions; `score` validates every value."""

    def __init__(self, functions: list[tuple[str, RewardFn, float]]):
        if not functions:
            raise SpecRLError("no reward functions: give reward.functions (import paths)")
        self.functions = functions

    @property
    def names(self) -> list[str]:
        return [name for name, _, _ in self.functions]

    def score(self, prompt: str, completion: str, row: dict, where: str) -> Scored:
        values: dict[str, float] = {}
        total = 0.0
        for name, fn, weight in self.functions:
            try:
                v = fn(prompt, completion, row)
            except Exception as e:  # a user function failed: name it and the row, stop the step
                raise SpecRLError(f"reward {name!r} raised {type(e).__name__}: {e} on {where}; nothing was trained "
                                  "on this step") from e
            if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(float(v)):
                raise SpecRLError(f"reward {name!r} returned {v!r} on {where}; a reward must be a finite number. "
                                  "Nothing was trained on this step")
            values[name] = float(v)
            total += weight * float(v)
        first = self.functions[0][0]
        return Scored(total, values, values[first] >= FULL_MARKS)


def builtin_rewards(task: TaskData, answer_format: str, format_weight: float) -> RewardSet:
    fns: list[tuple[str, RewardFn, float]] = [("task", TaskReward(task, answer_format), 1.0)]
    if format_weight > 0:
        fns.append(("format", FormatReward(answer_format), format_weight))
    return RewardSet(fns)


def user_rewards(specs: list[str], weights: list[float] | None) -> RewardSet:
    if weights is not None and len(weights) != len(specs):
        raise SpecRLError(f"reward.weights has {len(weights)} entries but reward.functions has {len(specs)}; give "
                          "one weight per function (or omit weights for all 1.0)")
    ws = weights if weights is not None else [1.0] * len(specs)
    return RewardSet([(spec, load_reward_fn(spec), float(w)) for spec, w in zip(specs, ws, strict=True)])

"""Verifiable reasoning tasks: reasoning-gym generators, chat prompts, answer extraction and rewards.

This module owns everything between a task name and a scalar reward. `make_task` builds a train and a
held-out validation split of a reasoning-gym dataset (offline, procedurally generated) from a name, a named
difficulty preset or raw generator options, a size and a seed; validation uses a disjoint seed and any
validation question that the train generator also produced is removed from train, so validation accuracy is
measured on questions the policy never trained on. `PromptFormatter` renders a question with the tokenizer's
chat template plus the answer-format instruction; `extract_answer` reads the answer back (see ANSWER_FORMATS);
`score_response` turns a response into a reward. `PromptSampler` walks the train split in seeded
per-epoch permutations and its whole state is one integer (the cursor), which is what checkpoints store.
"""

from __future__ import annotations

import dataclasses
import difflib
import re
from dataclasses import dataclass
from typing import Any, Protocol

import numpy as np

from specrl.errors import SpecRLError

# Difficulty presets for the tasks we curate; every other reasoning-gym task accepts only "default".
# "easy" is sized so SmolLM2-135M-Instruct answers some but not most questions right: a real RL target.
DIFFICULTIES: dict[str, dict[str, dict[str, Any]]] = {
    "chain_sum": {
        "easy": dict(min_terms=2, max_terms=2, min_digits=1, max_digits=2),
        "medium": dict(min_terms=2, max_terms=3, min_digits=1, max_digits=2),
        "hard": dict(min_terms=3, max_terms=5, min_digits=2, max_digits=3),
        "default": {},
    },
    "basic_arithmetic": {
        "easy": dict(min_terms=2, max_terms=2, min_digits=1, max_digits=2, allow_parentheses=False,
                     allow_negation=False),
        "medium": dict(min_terms=2, max_terms=3, min_digits=1, max_digits=2, allow_parentheses=False,
                       allow_negation=False),
        "hard": dict(min_terms=3, max_terms=5, min_digits=1, max_digits=3),
        # two one-digit addends, "+" only: the step-0 signal candidate measured in docs/results.md
        "sums": dict(min_terms=2, max_terms=2, min_digits=1, max_digits=1, operators=("+",), allow_parentheses=False,
                     allow_negation=False),
        "default": {},
    },
    "countdown": {
        "easy": dict(min_numbers=3, max_numbers=3, min_value=1, max_value=20, min_target=10, max_target=60),
        "medium": dict(min_numbers=4, max_numbers=4, min_value=1, max_value=50, min_target=20,
                       max_target=200),
        "hard": dict(min_numbers=4, max_numbers=6),
        "default": {},
    },
}
CURATED_TASKS = tuple(DIFFICULTIES)

# Seed offset of the validation split: far from any train seed a user would pick.
VAL_SEED_OFFSET = 1_000_003

# How the answer is requested (an instruction appended to the user turn) and read back. Measured on
# SmolLM2-135M-Instruct (chain_sum, 2 terms, T=0.7): with the <answer>-tag instruction it used the tags in 0 of
# 64 samples (whether the instruction sat in the system or the user turn), so a tag-only reward is all zeros
# and GRPO has nothing to learn from; "give only the final answer as a number" read back as the last number
# in the reply scored 12.5% with a reward signal in 7 of 16 groups. Hence `number` is the default for numeric
# tasks. Tags, when present, always win, so a model that learns them is read exactly.
ANSWER_FORMATS = {
    "number": "Give only the final answer as a number.",
    "reasoning": "Let's think step by step. Explain in detail how to solve this problem before giving the final "
                 "answer as a number.",
    "tags": "Put the final answer inside <answer></answer> tags, for example <answer>42</answer>.",
    "line": "Give only the final answer on the last line.",
}
# `reasoning` asks for the working before the answer (the long-rollout regime of examples/think.yaml). Measured on
# SmolLM2-135M-Instruct (chain_sum easy, 8 prompts x 8 samples, max 512 new tokens): at T=0.7 responses average 217
# tokens (median 196, 2 of 64 hit the limit) and 11% are right, with right and wrong answers in 3 of 8 groups; at
# T=1.0 the long replies degrade into unrelated text (mean 276, 8 of 32 at the limit, 9% right). The reward reads
# the final answer only: the number after the last "answer is" / "answer:" when the reply has one, else the last
# number in the reply -- never a number from the middle of the reasoning.
NUMERIC_TASKS = ("chain_sum", "basic_arithmetic")
SYSTEM_PROMPT: str | None = None  # None: the chat template's own default system turn
_ANSWER_RE = re.compile(r"<answer>(.*?)</answer>", re.DOTALL)
_NUMBER_RE = re.compile(r"-?\d+(?:\.\d+)?")
_FINAL_RE = re.compile(r"answer\s*(?:is|:|=)\s*:?\s*\**\s*(-?\d+(?:\.\d+)?)", re.IGNORECASE)


def resolve_answer_format(task: str, answer_format: str) -> str:
    """`auto` is `number` for numeric tasks and `tags` otherwise; anything else must be in ANSWER_FORMATS."""
    if answer_format == "auto":
        return "number" if task in NUMERIC_TASKS else "tags"
    if answer_format not in ANSWER_FORMATS:
        raise SpecRLError(f"task.answer_format {answer_format!r} is unknown; allowed: auto, "
                          f"{', '.join(ANSWER_FORMATS)}")
    return answer_format


def available_tasks() -> list[str]:
    """All task names: the curated ones first, then every other reasoning-gym generator."""
    import reasoning_gym.factory as rgf

    others = sorted(n for n in rgf.DATASETS if n not in CURATED_TASKS)
    return list(CURATED_TASKS) + others


def _generator_fields(name: str) -> list[str]:
    import reasoning_gym.factory as rgf

    _, config_cls = rgf.DATASETS[name]
    return [f.name for f in dataclasses.fields(config_cls) if f.name not in ("seed", "size")]


def generator_options(name: str, difficulty: str, options: dict[str, Any] | None = None) -> dict[str, Any]:
    """Resolve a difficulty preset plus explicit option overrides into reasoning-gym config kwargs."""
    tasks = available_tasks()
    if name not in tasks:
        close = difflib.get_close_matches(name, tasks, n=1)
        hint = f" Did you mean {close[0]!r}?" if close else ""
        raise SpecRLError(
            f"unknown task {name!r}.{hint} Curated tasks: {', '.join(CURATED_TASKS)}; "
            f"all reasoning-gym tasks: {', '.join(tasks)}"
        )
    presets = DIFFICULTIES.get(name, {"default": {}})
    if difficulty not in presets:
        raise SpecRLError(
            f"task.difficulty {difficulty!r} is not defined for task {name!r}; allowed: {', '.join(presets)} "
            "(or use difficulty: default with task.options to set generator fields directly)"
        )
    merged = dict(presets[difficulty])
    fields = _generator_fields(name)
    for key, value in (options or {}).items():
        if key not in fields:
            close = difflib.get_close_matches(key, fields, n=1)
            hint = f" Did you mean {close[0]!r}?" if close else ""
            raise SpecRLError(f"task.options.{key} is not an option of task {name!r}.{hint} "
                              f"Valid options: {', '.join(fields)}")
        merged[key] = value
    return merged


@dataclass
class Problem:
    """One question with its gold answer and the raw reasoning-gym entry (the scorer needs it)."""

    index: int
    question: str
    answer: str
    entry: dict


class TaskData:
    """A list of problems plus the reasoning-gym scorer that grades answers to them."""

    def __init__(self, name: str, problems: list[Problem], dataset: Any):
        self.name = name
        self.problems = problems
        self._dataset = dataset

    def __len__(self) -> int:
        return len(self.problems)

    def __getitem__(self, i: int) -> Problem:
        return self.problems[i]

    def score_answer(self, answer: str | None, problem: Problem) -> float:
        return self.score_entry(answer, problem.entry)

    def score_entry(self, answer: str | None, entry: dict) -> float:
        if self._dataset is None:
            raise SpecRLError(f"task {self.name!r} has no built-in scorer; give reward.functions")
        return float(self._dataset.score_answer(answer, entry))


def _build(name: str, size: int, seed: int, kwargs: dict[str, Any]) -> Any:
    import reasoning_gym

    try:
        return reasoning_gym.create_dataset(name, size=size, seed=seed, **kwargs)
    except (AssertionError, TypeError, ValueError) as e:
        raise SpecRLError(f"task {name!r} rejected its options {kwargs}: {e}") from e


def make_task(
    name: str,
    difficulty: str = "easy",
    options: dict[str, Any] | None = None,
    train_size: int = 10000,
    val_size: int = 64,
    seed: int = 0,
) -> tuple[TaskData, TaskData]:
    """Build (train, validation) splits. Validation uses seed + VAL_SEED_OFFSET; train drops its questions."""
    if train_size < 1 or val_size < 0:
        raise SpecRLError(
            f"task.train_size must be >= 1 and task.val_size >= 0, got {train_size} and {val_size}"
        )
    kwargs = generator_options(name, difficulty, options)
    val_ds = _build(name, max(val_size, 1), seed + VAL_SEED_OFFSET, kwargs)
    val = [Problem(i, e["question"], str(e["answer"]), e) for i, e in enumerate(val_ds)][:val_size]
    held_out = {p.question for p in val}
    train_ds = _build(name, train_size, seed, kwargs)
    train = [Problem(i, e["question"], str(e["answer"]), e) for i, e in enumerate(train_ds)]
    train = [p for p in train if p.question not in held_out]
    if not train:
        raise SpecRLError(
            f"task {name!r} at difficulty {difficulty!r} has no train questions left after removing the "
            f"{len(val)} validation questions; use a harder difficulty or a smaller task.val_size"
        )
    return TaskData(name, train, train_ds), TaskData(name, val, val_ds)


def extract_answer(response: str, answer_format: str = "tags") -> str | None:
    """Read the answer back: the last <answer>...</answer> if any; else, for `number`, the last number in
    the response, for `line`, its last non-empty line, for `reasoning`, the number after the last "answer is" /
    "answer:" or else the last number; None when nothing qualifies."""
    found = _ANSWER_RE.findall(response)
    if found:
        return found[-1].strip()
    if answer_format == "reasoning":
        final = _FINAL_RE.findall(response)
        if final:
            return final[-1]
        answer_format = "number"
    if answer_format == "number":
        nums = _NUMBER_RE.findall(response)
        return nums[-1] if nums else None
    if answer_format == "line":
        lines = [ln.strip() for ln in response.strip().splitlines() if ln.strip()]
        return lines[-1] if lines else None
    return None


@dataclass
class Score:
    reward: float
    correct: bool
    formatted: bool
    answer: str | None


def score_response(task: TaskData, problem: Problem, response: str, format_weight: float = 0.0,
                   answer_format: str = "tags") -> Score:
    """Reward = task scorer(extracted answer) + format_weight * [an answer could be extracted].

    The scorer alone gives 0 when no answer can be read back, so a format component is not needed for the
    signal; it can help when the model rarely follows the format, but it is also easy to reward-hack (a
    well-formed wrong answer), hence the default 0. `correct` means the scorer gave full marks, which is what
    accuracy counts.
    """
    answer = extract_answer(response, answer_format)
    task_score = task.score_answer(answer, problem) if answer is not None else 0.0
    formatted = answer is not None
    return Score(
        reward=task_score + (format_weight if formatted else 0.0),
        correct=task_score >= 1.0,
        formatted=formatted,
        answer=answer,
    )


class Tokenizer(Protocol):
    chat_template: Any

    def apply_chat_template(self, messages: list[dict], **kwargs: Any) -> Any: ...

    def encode(self, text: str, add_special_tokens: bool = ...) -> list[int]: ...

    def decode(self, ids: list[int], skip_special_tokens: bool = ...) -> str: ...


class PromptFormatter:
    """Renders questions as chat prompts (optional system turn; user turn = question + instruction)."""

    def __init__(self, tokenizer: Tokenizer, system_prompt: str | None = SYSTEM_PROMPT,
                 instruction: str = ANSWER_FORMATS["number"]):
        if getattr(tokenizer, "chat_template", None) in (None, ""):
            raise SpecRLError(
                "the tokenizer has no chat template; use an instruct/chat model whose tokenizer_config.json "
                "defines chat_template (prompts are rendered with it)"
            )
        self.tokenizer = tokenizer
        self.system_prompt = system_prompt
        self.instruction = instruction

    def text(self, question: str | list[dict]) -> str:
        """The chat-rendered prompt of a question string, or of a list of messages ({"role", "content"}: used as
        given, after the system turn if one is configured and the messages have none)."""
        messages = []
        if self.system_prompt and not (isinstance(question, list) and question and question[0].get("role") ==
                                       "system"):
            messages.append({"role": "system", "content": self.system_prompt})
        if isinstance(question, list):
            messages += question
        else:
            user = f"{question.rstrip()}\n{self.instruction}" if self.instruction else question
            messages.append({"role": "user", "content": user})
        return self.tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)

    def encode(self, question: str | list[dict]) -> list[int]:
        return list(self.tokenizer.encode(self.text(question), add_special_tokens=False))

    def decode(self, token_ids: list[int]) -> str:
        return self.tokenizer.decode(list(token_ids), skip_special_tokens=True)


class PromptSampler:
    """Deterministic stream of train problems: per-epoch permutations seeded by (seed, epoch)."""

    def __init__(self, size: int, seed: int, cursor: int = 0):
        if size < 1:
            raise SpecRLError(f"PromptSampler needs at least one problem, got size {size}")
        self.size = size
        self.seed = seed
        self.cursor = cursor
        self._epoch = -1
        self._order: np.ndarray = np.arange(size)

    def _order_for(self, epoch: int) -> np.ndarray:
        if epoch != self._epoch:
            self._order = np.random.default_rng([self.seed, epoch]).permutation(self.size)
            self._epoch = epoch
        return self._order

    def next(self, n: int) -> list[int]:
        out = []
        for _ in range(n):
            epoch, pos = divmod(self.cursor, self.size)
            out.append(int(self._order_for(epoch)[pos]))
            self.cursor += 1
        return out

    def state_dict(self) -> dict[str, int]:
        return {"cursor": self.cursor, "seed": self.seed, "size": self.size}

    def load_state_dict(self, state: dict[str, int]) -> None:
        if state.get("size") != self.size or state.get("seed") != self.seed:
            raise SpecRLError(
                f"checkpoint data cursor was saved for a train split of size {state.get('size')} with seed "
                f"{state.get('seed')}, but this run has size {self.size} and seed {self.seed}; resume with "
                "the same task config"
            )
        self.cursor = int(state["cursor"])

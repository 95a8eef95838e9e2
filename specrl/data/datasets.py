"""A user's dataset as an RL task: prompts (+ answers and any other columns) from local files, offline.

`task.name: dataset` reads `task.path`: a JSONL file (one JSON object per line), a Parquet file, or a directory
written by HF `datasets`' `save_to_disk` (a `DatasetDict` needs `task.split`, default "train"). The prompt column
(`task.prompt_column`) holds either a string (rendered with the chat template as the user turn) or a list of
chat messages ({"role", "content"}); every other column reaches the reward functions in the row. Validation
comes from `task.validation_path` (same formats) or a seeded held-out `task.validation_fraction` of the rows.
Errors name the file and row: missing file, unreadable or non-UTF-8 line, missing column (with the columns that
exist), empty dataset, a malformed chat prompt. Prompts longer than the context are reported by the producer
with their row.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import numpy as np

from specrl.data.tasks import Problem, TaskData
from specrl.errors import SpecRLError

DATASET_TASK = "dataset"


def read_rows(path: str | Path, split: str = "train") -> list[dict]:
    """Rows of a JSONL / Parquet file or a `save_to_disk` directory, as dicts."""
    p = Path(path)
    if not p.exists():
        raise SpecRLError(f"task.path {p} does not exist; give a .jsonl or .parquet file or a `save_to_disk` "
                          "directory")
    if p.is_dir():
        return _read_hf_dir(p, split)
    if p.suffix in (".jsonl", ".json"):
        return _read_jsonl(p)
    if p.suffix == ".parquet":
        import pyarrow.parquet as pq

        try:
            return pq.read_table(p).to_pylist()
        except Exception as e:  # pyarrow raises several types for corrupt files
            raise SpecRLError(f"{p}: cannot read as Parquet ({type(e).__name__}: {e})") from None
    raise SpecRLError(f"{p}: unsupported file type {p.suffix!r}; use .jsonl, .parquet or a `save_to_disk` "
                      "directory")


def _read_jsonl(p: Path) -> list[dict]:
    rows = []
    with p.open("rb") as f:
        for i, raw in enumerate(f, 1):
            try:
                line = raw.decode("utf-8-sig" if i == 1 else "utf-8")  # a leading byte-order mark is not content
            except UnicodeDecodeError as e:
                raise SpecRLError(f"{p}:{i}: not UTF-8 ({e.reason} at byte {e.start}); save the file as "
                                  "UTF-8") from None
            if not line.strip():
                continue
            try:
                row = json.loads(line)
            except json.JSONDecodeError as e:
                raise SpecRLError(f"{p}:{i}: not valid JSON ({e.msg}); expected one JSON object per line") from None
            if not isinstance(row, dict):
                raise SpecRLError(f"{p}:{i}: expected a JSON object (column -> value), got {type(row).__name__}")
            rows.append(row)
    return rows


def _read_hf_dir(p: Path, split: str) -> list[dict]:
    import datasets

    try:
        ds = datasets.load_from_disk(str(p))
    except (FileNotFoundError, ValueError) as e:
        raise SpecRLError(f"{p}: not a directory written by `datasets` save_to_disk ({e})") from None
    if isinstance(ds, datasets.DatasetDict):
        if split not in ds:
            raise SpecRLError(f"{p} holds splits {sorted(ds)}; set task.split to one of them (got {split!r})")
        ds = ds[split]
    return [dict(r) for r in ds]


def _check_prompt(value: Any, where: str) -> str | list[dict]:
    if isinstance(value, str):
        if not value.strip():
            raise SpecRLError(f"{where}: the prompt is empty")
        return value
    if isinstance(value, list) and value and all(isinstance(m, dict) and isinstance(m.get("role"), str) and
                                                 isinstance(m.get("content"), str) for m in value):
        return [{"role": m["role"], "content": m["content"]} for m in value]
    raise SpecRLError(f"{where}: the prompt must be a string or a non-empty list of chat messages "
                      f"{{\"role\": ..., \"content\": ...}}, got {type(value).__name__}")


def _problems(rows: list[dict], t: Any, where: str) -> list[Problem]:
    if not rows:
        raise SpecRLError(f"{where} has no rows")
    out = []
    for i, row in enumerate(rows):
        if t.prompt_column not in row:
            raise SpecRLError(f"{where} row {i}: no column {t.prompt_column!r} (task.prompt_column); columns: "
                              f"{sorted(row)}")
        prompt = _check_prompt(row[t.prompt_column], f"{where} row {i}")
        answer = row.get(t.answer_column) if t.answer_column else None
        out.append(Problem(i, prompt, "" if answer is None else str(answer), {**row, "_row": i}))
    return out


def make_dataset_task(t: Any) -> tuple[TaskData, TaskData]:
    """(train, validation) TaskData from `task.path` (and `task.validation_path` or `task.validation_fraction`)."""
    if not t.path:
        raise SpecRLError("task.name=dataset needs task.path (a .jsonl / .parquet file or a save_to_disk directory)")
    rows = read_rows(t.path, t.split)
    train = _problems(rows, t, str(t.path))
    if t.validation_path:
        val = _problems(read_rows(t.validation_path, t.split), t, str(t.validation_path))
    else:
        n_val = int(round(len(train) * t.validation_fraction))
        if t.validation_fraction > 0 and n_val == 0:
            n_val = 1
        if n_val >= len(train):
            raise SpecRLError(f"task.validation_fraction {t.validation_fraction} of {len(train)} rows leaves no "
                              "train rows; lower it or give task.validation_path")
        order = np.random.default_rng(t.seed).permutation(len(train))
        held = set(order[:n_val].tolist())
        val = [p for i, p in enumerate(train) if i in held]
        train = [p for i, p in enumerate(train) if i not in held]
    return TaskData(DATASET_TASK, train, None), TaskData(DATASET_TASK, val, None)

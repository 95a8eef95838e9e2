"""Training from Python: `train(model, dataset, reward_funcs, config)` runs what `specrl train` runs.

    from specrl import TrainConfig, train

    def exact_match(prompt: str, completion: str, row: dict) -> float:
        return 1.0 if row["answer"] in completion else 0.0

    run_dir = train(model="smollm2-135m", dataset=[{"prompt": "2 + 3 = ?", "answer": "5"}, ...],
                    reward_funcs=[exact_match], config=TrainConfig(run={"steps": 10}))

`model` is a preset name or an HF checkpoint directory (Llama / Qwen2 / Qwen3). `dataset` is a list of row dicts
(or any iterable of them, e.g. a `datasets.Dataset`) with a `prompt` column (a string, or a list of chat messages)
plus whatever columns the rewards read, or a path to a .jsonl / .parquet file or a `save_to_disk` directory.
In-memory rows are written to `RUN_DIR/dataset.jsonl`, so the run directory is complete and `--resume` works.
`reward_funcs` are callables `fn(prompt, completion, row) -> float` or import paths `package.module:function`;
`reward_weights` weighs them (default 1.0 each). Without `dataset` / `reward_funcs` the config's task and rewards
are used (e.g. a built-in reasoning-gym task). `config` is a `TrainConfig`, a YAML path, or None (the defaults).

A callable that cannot be imported by name (defined in `__main__`, a notebook, a closure) is registered in this
process under `specrl_rewards:NAME`; such a run trains in-process (the sync pipeline). The async pipeline's Ray
actors import rewards by name, so give it importable functions.
"""

from __future__ import annotations

import json
import sys
import types
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any

from specrl.config.schema import TrainConfig
from specrl.errors import SpecRLError
from specrl.fileio import atomic_write
from specrl.run.loop import RunLock, train_main
from specrl.trainer.config_check import load_config, validate_config

__all__ = ["train", "TrainConfig", "load_config", "reward_spec"]

REGISTRY_MODULE = "specrl_rewards"
DATASET_FILE = "dataset.jsonl"


def _registry() -> types.ModuleType:
    mod = sys.modules.get(REGISTRY_MODULE)
    if mod is None:
        mod = types.ModuleType(REGISTRY_MODULE, "Reward functions passed to specrl.train as callables.")
        sys.modules[REGISTRY_MODULE] = mod
    return mod


def reward_spec(fn: Callable[[str, str, dict], float] | str) -> tuple[str, bool]:
    """The `reward.functions` entry for `fn`, and whether it only resolves in this process (registered)."""
    if isinstance(fn, str):
        return fn, False
    if not callable(fn):
        raise SpecRLError(f"reward_funcs: {fn!r} is neither a callable nor a 'package.module:function' string")
    module, qualname = getattr(fn, "__module__", None), getattr(fn, "__qualname__", "")
    owner = sys.modules.get(module) if module else None
    if (owner is not None and module != "__main__" and "<" not in qualname and "." not in qualname
            and getattr(owner, qualname, None) is fn and getattr(owner, "__spec__", None) is not None):
        return f"{module}:{qualname}", False
    reg = _registry()
    base = getattr(fn, "__name__", "") or "reward"
    base = base if base.isidentifier() else "reward"
    name, i = base, 1
    while getattr(reg, name, fn) is not fn:
        i += 1
        name = f"{base}_{i}"
    setattr(reg, name, fn)
    return f"{REGISTRY_MODULE}:{name}", True


def _write_rows(rows: Iterable[dict], path: Path) -> int:
    path.parent.mkdir(parents=True, exist_ok=True)
    n = 0
    with atomic_write(path) as f:
        for i, row in enumerate(rows):
            row = dict(row)
            try:
                f.write(json.dumps(row) + "\n")
            except (TypeError, ValueError) as e:
                raise SpecRLError(f"dataset row {i} cannot be stored as JSON ({e}); rows must hold strings, "
                                  "numbers, lists and dicts") from None
            n += 1
    return n


def train(model: str | Path | None = None, dataset: str | Path | Iterable[dict] | None = None,
          reward_funcs: list[Callable[[str, str, dict], float] | str] | None = None,
          config: TrainConfig | str | Path | None = None, *, reward_weights: list[float] | None = None,
          out: str | Path | None = None, resume: bool = False, compare: bool = False) -> Path:
    """GRPO with speculative rollouts on `model`, `dataset` and `reward_funcs`; returns the run directory
    (`report.md`, `metrics.jsonl`, `final/`: the trained policy as an HF checkpoint directory).

    `out` is the run directory (default `config.run.out_dir / config.run.name`); `resume=True` continues the run in
    it from its newest checkpoint; `compare=True` runs the config autoregressively and speculatively side by side
    (`compare.md`)."""
    if isinstance(config, TrainConfig):
        data = config.model_dump(mode="json")
    else:
        data = load_config(config).model_dump(mode="json")
    if model is not None:
        data["model"]["name"] = str(model)
    registered = False
    if reward_funcs is not None:
        specs = [reward_spec(fn) for fn in reward_funcs]
        data["reward"]["functions"] = [s for s, _ in specs]
        registered = any(r for _, r in specs)
        data["reward"]["weights"] = list(reward_weights) if reward_weights is not None else None
    elif reward_weights is not None:
        data["reward"]["weights"] = list(reward_weights)
    if registered and data["pipeline"]["mode"] != "sync":
        raise SpecRLError("pipeline.mode=async imports reward functions by name in its Ray actors; pass importable "
                          "functions ('package.module:function' or functions defined in a module), not ones "
                          "defined in __main__ or a notebook")
    run_dir = Path(out) if out is not None else Path(data["run"]["out_dir"]) / data["run"]["name"]
    rows = None
    if dataset is not None:
        data["task"]["name"] = "dataset"
        if isinstance(dataset, str | Path):
            data["task"]["path"] = str(dataset)
        else:
            rows = dataset
            data["task"]["path"] = str(run_dir / DATASET_FILE)
    cfg = validate_config(data, "train() config")
    if resume:
        return train_main(None, [], str(run_dir), None, False, make_trainer=_make_trainer())
    RunLock.acquire(run_dir)  # held across the dataset write and the run (setup_run re-enters it)
    try:
        if rows is not None:
            if isinstance(rows, dict):
                raise SpecRLError("dataset: pass a list of row dicts (or a path), not one dict")
            if _write_rows(rows, run_dir / DATASET_FILE) == 0:
                raise SpecRLError("dataset has no rows")
        return train_main(cfg, [], None, str(run_dir), compare, make_trainer=_make_trainer())
    finally:
        RunLock.release(run_dir)


def _make_trainer() -> Any:
    """Sync in-process, async on Ray: the factory `specrl train` uses."""
    from specrl.cluster import make_trainer

    return make_trainer

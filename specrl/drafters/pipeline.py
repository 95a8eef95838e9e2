"""`specrl draft build`: a drafter reproduced from its recipe, in resumable stages, in one build directory.

Stages, each skipped when its output is already whole (so a killed build continues where it stopped):
1. `rollouts` — the target's on-policy rollouts of the recipe's prompts at the workload's temperature and template,
   written as checked shards (`shards.py`) under `WORK/rollouts/`.
The build directory records the recipe's data hash (`build.json`); a different recipe's data is refused.
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable
from pathlib import Path

from specrl.drafters.recipe import Recipe
from specrl.errors import SpecRLError
from specrl.fileio import write_text_atomic

BUILD_FILE = "build.json"
STAGES = ("rollouts",)


def _claim(work: Path, recipe: Recipe) -> dict:
    """Create or re-open the build directory for `recipe`; refuse one that holds another recipe's data."""
    work.mkdir(parents=True, exist_ok=True)
    f = work / BUILD_FILE
    if f.exists():
        try:
            state = json.loads(f.read_text())
        except json.JSONDecodeError:
            raise SpecRLError(f"{f} is not valid JSON; remove the build directory {work} to start over") from None
        if state.get("data_hash") != recipe.hash():
            other = state.get("recipe", {}).get("name")
            raise SpecRLError(f"build directory {work} holds the data of recipe {other!r} "
                              f"with other data settings; use a new --work directory for recipe {recipe.name!r}")
        return state
    state = {"recipe": recipe.as_dict(), "data_hash": recipe.hash(), "stage_seconds": {}}
    write_text_atomic(f, json.dumps(state, indent=1) + "\n")
    return state


def _save_state(work: Path, state: dict) -> None:
    write_text_atomic(work / BUILD_FILE, json.dumps(state, indent=1) + "\n")


def run_rollouts(recipe: Recipe, work: Path, prompts: Callable, progress: bool = True) -> list:
    """Stage 1: the rollouts, sharded under WORK/rollouts (resumes from whole shards)."""
    from specrl.drafters.shards import collect_rollouts
    from specrl.model.loader import load_model
    from specrl.model.tokenizer import stop_token_ids
    from specrl.rollout.sampling import SamplingParams

    state = _claim(work, recipe)
    target, tokenizer = load_model(recipe.model, dtype=recipe.rollout_dtype)
    train, _ = prompts(tokenizer)
    if len(train) < recipe.prompts:
        raise SpecRLError(f"recipe {recipe.name!r} asks for {recipe.prompts} prompts; the task gave {len(train)}")
    sp = SamplingParams(temperature=recipe.temperature, top_p=recipe.top_p, max_new_tokens=recipe.max_new_tokens,
                        stop_token_ids=stop_token_ids(tokenizer, target.args), seed=recipe.seed)
    t0 = time.perf_counter()
    infos = collect_rollouts(target, train[: recipe.prompts], work / "rollouts", sp, recipe.shard_size,
                             batch_size=recipe.rollout_batch, progress=progress)
    state["stage_seconds"]["rollouts"] = state["stage_seconds"].get("rollouts", 0.0) + time.perf_counter() - t0
    state["rollout_tokens"] = sum(s.tokens for s in infos)
    _save_state(work, state)
    return infos

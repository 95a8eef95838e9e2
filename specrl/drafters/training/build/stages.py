"""`specrl draft build`: a drafter reproduced from its recipe, in resumable stages, in one build directory.

Stages, each skipped when its output is already whole (so a killed build continues where it stopped):
1. `rollouts` — the target's on-policy rollouts of the recipe's prompts at the workload's temperature and template,
   written as checked shards (`shards.py`) under `WORK/rollouts/`.
2. `features` — the target's fused hidden states and top-K distributions per shard (`features.py`,
   `WORK/features/`).
3. `train` — the draft vocabulary chosen by coverage of the response tokens, then the recipe's head (its kind:
   EAGLE or parallel; its loss: soft cross-entropy or that plus the TV distance) trained on the features, resumable
   from its checkpoint (`fit.py`, `WORK/train/`; the head in `WORK/train/drafter/`).
4. `package` — the head in the shipped dtype with its manifest (`shipped.py`, `WORK/package/`).
5. `eval` — held-out acceptance of the packaged head on the validation split (`heldout.py`,
   `WORK/eval/eval.json`), written into the package's manifest.
Stages 4-5 and the scaling curve (the head's snapshots along its training, evaluated at k) live in `release.py`.
The build directory records the recipe's data hash (`build.json`); a different recipe's data is refused. A build
linked to another build's directory (`link_data`, `--data-from`) whose data hash is the same reads that build's
rollouts and features (`data_root`) instead of making its own, and only checks that they are whole. Each
stage after the first writes `WORK/STAGE/stage.json` (its wall seconds, threads, what it made), merged into
`build.json`'s `stage_seconds`.
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable
from pathlib import Path

from specrl.drafters.training.build.recipe import Recipe
from specrl.drafters.training.offline import select_draft_vocab
from specrl.errors import SpecRLError
from specrl.fileio import write_text_atomic

BUILD_FILE = "build.json"
DATA_FROM = "data_from"  # build.json's key: the build directory whose rollouts and features this build reads
STAGES = ("rollouts", "features", "train", "package", "eval")
STAGE_FILE = "stage.json"


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


def link_data(recipe: Recipe, work: Path, data_from: Path) -> Path:
    """Make build `work` read the rollouts and features of build `data_from` (recorded in WORK/build.json), which
    must hold the data of a recipe with the same data fields (`DATA_FIELDS`, hence the same `Recipe.hash()`)."""
    from specrl.drafters.training.build.recipe import DATA_FIELDS

    src = Path(data_from).resolve()
    f = src / BUILD_FILE
    try:
        other = json.loads(f.read_text())
    except FileNotFoundError:
        raise SpecRLError(f"--data-from {src}: no {BUILD_FILE}; give the directory of a `specrl draft build` whose "
                          "rollouts (and features) stages ran") from None
    except json.JSONDecodeError:
        raise SpecRLError(f"--data-from {src}: {f} is not valid JSON") from None
    if not isinstance(other, dict) or other.get("data_hash") != recipe.hash():
        theirs = other.get("recipe", {}) if isinstance(other, dict) else {}
        mine = recipe.as_dict()
        diff = [f"{k} {theirs.get(k)!r} (recipe {recipe.name!r}: {mine[k]!r})" for k in DATA_FIELDS
                if theirs.get(k) != mine[k]]
        raise SpecRLError(f"--data-from {src} holds the data of recipe {theirs.get('name')!r}, made with other data "
                          f"settings than recipe {recipe.name!r} ({'; '.join(diff) or 'another data hash'}); a build "
                          f"reuses only data of the same data fields ({', '.join(DATA_FIELDS)})")
    if src == Path(work).resolve():
        raise SpecRLError(f"--data-from {src} is the build directory itself; give another build's directory")
    state = _claim(work, recipe)
    state[DATA_FROM] = str(src)
    _save_state(work, state)
    return src


def data_root(work: Path) -> Path:
    """The build directory whose rollouts/ and features/ build `work` reads: its `link_data` source, or itself."""
    f = Path(work) / BUILD_FILE
    src = json.loads(f.read_text()).get(DATA_FROM) if f.exists() else None
    return Path(src) if src else Path(work)


def _linked(work: Path) -> Path | None:
    root = data_root(work)
    return None if root == Path(work) else root


def run_rollouts(recipe: Recipe, work: Path, prompts: Callable, progress: bool = True) -> list:
    """Stage 1: the rollouts, sharded under WORK/rollouts (resumes from whole shards); for a linked build, the
    check that its source's shards are all there."""
    if _linked(work) is not None:
        _claim(work, recipe)
        return whole_shards(recipe, work)
    from specrl.drafters.training.build.shards import collect_rollouts
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


def _record(work: Path, stage: str, record: dict) -> dict:
    """Write WORK/STAGE/stage.json and merge every stage's seconds into build.json (read afresh: another
    process, e.g. a rollouts stage still running, may have written it since)."""
    (work / stage).mkdir(parents=True, exist_ok=True)
    write_text_atomic(work / stage / STAGE_FILE, json.dumps(record, indent=1) + "\n")
    state = json.loads((work / BUILD_FILE).read_text())
    for name in STAGES[1:]:
        f = work / name / STAGE_FILE
        if f.exists():
            state["stage_seconds"][name] = json.loads(f.read_text()).get("seconds")
    _save_state(work, state)
    return record


def stage_record(work: Path, stage: str) -> dict | None:
    f = Path(work) / stage / STAGE_FILE
    return json.loads(f.read_text()) if f.exists() else None


def whole_shards(recipe: Recipe, work: Path, upto: int | None = None, partial: bool = False) -> list:
    """The checked rollout shards 0..upto-1 (default all); a missing one is an error unless `partial`, and a
    damaged one always is (the rollouts stage rebuilds it)."""
    from specrl.drafters.training.build.shards import check_shard, shard_path

    n = recipe.n_shards if upto is None else upto
    infos, missing = [], []
    root = data_root(work)
    for i in range(n):
        p = shard_path(root / "rollouts", i)
        if not p.exists():
            missing.append(i)
            continue
        infos.append(check_shard(p, min(recipe.shard_size, recipe.prompts - i * recipe.shard_size)))
    if missing and not partial:
        raise SpecRLError(f"build {root}: rollout shards {missing[:5]}{'…' if len(missing) > 5 else ''} of "
                          f"{n} are missing; run the rollouts stage first (`specrl draft build --stage rollouts"
                          f"{f' --work {root}' if root != Path(work) else ''}`)")
    return infos


def _load_target(recipe: Recipe, target):
    from specrl.model.loader import load_model
    from specrl.model.tokenizer import stop_token_ids

    if target is None:
        target, tokenizer = load_model(recipe.model, dtype=recipe.rollout_dtype)
        return target, tokenizer, stop_token_ids(tokenizer, target.args)
    return target, None, stop_token_ids(None, target.args)


def run_features(recipe: Recipe, work: Path, target=None, progress: bool = True, partial: bool = False) -> list:
    """Stage 2: features of every shard (with `partial`, of the shards present so far); for a linked build, the
    check that its source's features are current for every shard (nothing is extracted into another build)."""
    import torch

    from specrl.drafters.kinds.eagle import default_layers
    from specrl.drafters.training.build.features import current_features, extract_features

    _claim(work, recipe)
    infos = whole_shards(recipe, work, partial=partial)
    target, _, _ = _load_target(recipe, target)
    src = _linked(work)
    if src is not None:
        return current_features(src / "features", infos, default_layers(target.args.num_layers), recipe.target_topk,
                                f"build {src}'s features stage (`specrl draft build --stage features --work {src}`)")
    t0 = time.perf_counter()
    prev = stage_record(work, "features") or {}
    feats = extract_features(target, work / "rollouts", work / "features", infos,
                             default_layers(target.args.num_layers), recipe.target_topk, progress=progress)
    new = time.perf_counter() - t0
    _record(work, "features", {"seconds": prev.get("seconds", 0.0) + new, "threads": torch.get_num_threads(),
                               "shards": len(feats), "tokens": sum(f.tokens for f in feats),
                               "response_tokens": sum(f.response_tokens for f in feats),
                               "target_dtype": str(target.dtype).removeprefix("torch.")})
    return feats


def curve_steps(recipe: Recipe, steps_per_epoch: int) -> dict[int, int]:
    """Scaling-curve snapshot steps of one training run: {step: shard count} for each count N in recipe.curve,
    after N / n_shards of the first epoch (the head has then seen that share of the data, once), plus the end of
    every later epoch (under key -epoch)."""
    out = {max(1, round(steps_per_epoch * n / recipe.n_shards)): n for n in recipe.curve}
    for e in range(2, recipe.epochs + 1):
        out.setdefault(e * steps_per_epoch, -e)
    return out


def train_head(recipe: Recipe, work: Path, target, infos: list, feats: list, out: Path,
               snapshot_marks: dict | None = None, progress: bool = True, stop_after: int | None = None,
               log=print) -> tuple:
    """A fresh head of the recipe's kind trained with its settings on the given shards of build `work` (`infos`,
    their `feats`, read from `data_root(work)`), into `out` (resumable from its checkpoint there): the draft
    vocabulary chosen by coverage of these shards' responses, then `fit`. Returns (drafter, fit's result, the
    vocabulary's coverage)."""
    import torch

    from specrl.drafters.training.build.features import feature_path
    from specrl.drafters.training.build.fit import examples_from_features, fit, vocab_coverage
    from specrl.drafters.training.build.recipe import build_class
    from specrl.drafters.training.build.shards import read_shard, shard_path
    from specrl.model.tokenizer import stop_token_ids

    stops = stop_token_ids(None, target.args)
    root = data_root(work)
    responses = [r["response_ids"] for s in infos for r in read_shard(shard_path(root / "rollouts", s.index))]
    vocab = select_draft_vocab(responses, recipe.draft_vocab_size, always=stops) \
        if recipe.draft_vocab_size < target.args.vocab_size else None
    torch.manual_seed(recipe.seed)  # the fresh head's initial weights
    drafter = build_class(recipe.kind).from_recipe(target, recipe, draft_vocab=vocab)
    coverage = vocab_coverage(responses, [int(t) for t in drafter.d2t], sizes=(1024, 2048, 4096, 8192))
    examples = examples_from_features([feature_path(root / "features", f.index) for f in feats],
                                      drafter.target_to_draft())
    res = fit(drafter, examples, out, recipe.epochs, recipe.lr, recipe.batch_size, recipe.ttt_steps,
              seed=recipe.seed, snapshot_steps=tuple(snapshot_marks or ()), progress=progress, log=log,
              stop_after=stop_after, autocast=recipe.train_dtype, objective=recipe.objective)
    res["sequences"] = len(examples)
    return drafter, res, coverage


def run_train(recipe: Recipe, work: Path, target=None, progress: bool = True, stop_after: int | None = None,
              log=print) -> dict:
    """Stage 3: the draft vocabulary, then the recipe's head trained on every shard's features (resumable)."""
    import math

    import torch

    from specrl.drafters.storage.io import save_drafter
    from specrl.drafters.training.build.shards import data_hash

    _claim(work, recipe)
    infos = whole_shards(recipe, work)
    target, _, _ = _load_target(recipe, target)
    feats = run_features(recipe, work, target, progress=progress)  # a no-op when every shard's file is current
    t0 = time.perf_counter()
    rows = sum(f.rows for f in feats)
    marks = curve_steps(recipe, math.ceil(rows / recipe.batch_size))
    drafter, res, coverage = train_head(recipe, work, target, infos, feats, work / "train", marks, progress=progress,
                                        stop_after=stop_after, log=log)
    for s in res["snapshots"]:
        s["shards"] = marks.get(s["step"])
    # the training loop's seconds over every life (in its checkpoint: a killed life counts up to its last one),
    # plus the set-up (vocabulary, examples) of the lives that ended
    prev = stage_record(work, "train") or {}
    setup = prev.get("setup_seconds", 0.0) + time.perf_counter() - t0 - res["seconds_this_call"]
    record = {**res, "seconds": res["seconds"] + setup, "setup_seconds": setup,
              "threads": torch.get_num_threads(), "data_hash": data_hash(infos), "vocab": coverage,
              "response_tokens": sum(f.response_tokens for f in feats)}
    if res["finished"]:
        save_drafter(drafter, work / "train" / "drafter")
        record["drafter"] = str(work / "train" / "drafter")
    _record(work, "train", record)
    return record

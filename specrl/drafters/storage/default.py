"""The embedded model's drafters, built from the RL task's own prompts, and drafter specs with them.

`eagle:default` (the short-answer workload's head) and `eagle:think` (examples/think.yaml's long step-by-step replies)
are shipped in the package (`specrl.drafters.storage.shipped`, trained by `specrl draft build --recipe default|think`):
`ensure_default_drafter` verifies and returns a shipped drafter's directory, never builds it (a shipped name with a
missing or edited manifest is an error). The others (`mtp:default`,
`mtp:think`) are in-domain drafters of SmolLM2-135M built on first use: the policy's rollouts on chain_sum prompts,
distilled with a small fixed budget (`DEFAULT_BUILDS`) by
`specrl.drafters.training.build.from_rollouts.train_drafter_offline` and cached next to the model
(`specrl.drafters.default_drafter_dir`). The drafters layer only loads them; the build lives here because only
this layer knows tasks: `task_prompts` renders a task's train and held-out prompts exactly as the trainer does
(`PromptFormatter`). `resolve_drafter` is `make_drafter` with that builder, what the CLI, the trainer, the rollout
backends and the benchmarks call.
"""

from __future__ import annotations

import json
import os
import shutil
import sys
import time
from collections.abc import Callable
from pathlib import Path

from specrl.drafters import DEFAULT_DRAFTER_MODEL, DEFAULT_KINDS, Drafter, default_drafter_dir, make_drafter
from specrl.drafters.storage.io import FORMAT_VERSION, min_format_version
from specrl.drafters.training.build import from_rollouts as drafter_build
from specrl.errors import SpecRLError
from specrl.fileio import replace_dir
from specrl.rollout.drafter_spec import parse_drafter_spec

# First-use budgets of the embedded drafters (measured on idle 2-core CPUs: see docs/drafters.md). `default` is
# sized for `make run`'s 15 minutes on an AVX2-only CPU (fp32 target), where 320 rollouts took 294 s to build for
# held-out AL 1.44 and 160 reach AL 1.35 (benchmarks/drafter_budget.py; more epochs on 160 do not raise it).
# `think` matches examples/think.yaml: its prompts (answer_format reasoning), its temperature and max_new_tokens.
DEFAULT_BUILDS: dict[str, dict] = {
    "default": {"task": "chain_sum", "answer_format": "number", "samples": 160, "epochs": 3, "max_new_tokens": 64,
                "temperature": 1.0},
    "think": {"task": "chain_sum", "answer_format": "reasoning", "samples": 320, "epochs": 3,
              "max_new_tokens": 512, "temperature": 0.7},
}
DEFAULT_BUILD = DEFAULT_BUILDS["default"]
RECIPE_FILE = "recipe.json"  # the DEFAULT_BUILDS entry a cached drafter was built with
DEFAULT_DIFFICULTY = "easy"


def task_prompts(task: str, samples: int, heldout: int = drafter_build.HELDOUT_PROMPTS,
                 difficulty: str = DEFAULT_DIFFICULTY, seed: int = 0, answer_format: str = "auto") -> Callable:
    """A prompt source for `train_drafter_offline`: tokenizer -> (train prompt ids, held-out prompt ids) of a task.

    The train split has up to `samples` prompts, the validation split `heldout` (disjoint from train, see
    `make_task`), both rendered with the chat template and answer instruction the trainer uses.
    """

    def encode(tokenizer) -> tuple[list[list[int]], list[list[int]]]:
        from specrl.data.tasks import ANSWER_FORMATS, PromptFormatter, make_task, resolve_answer_format

        train, val = make_task(task, difficulty=difficulty, train_size=samples, val_size=heldout, seed=seed)
        fmt = PromptFormatter(tokenizer, instruction=ANSWER_FORMATS[resolve_answer_format(task, answer_format)])
        return [fmt.encode(p.question) for p in train.problems][:samples], [fmt.encode(p.question)
                                                                            for p in val.problems]

    return encode


def _recipe_of(d: Path) -> dict | None:
    try:
        return json.loads((d / RECIPE_FILE).read_text())
    except (OSError, json.JSONDecodeError):
        return None


def _format_of(d: Path) -> tuple[str | None, int]:
    try:
        cfg = json.loads((d / "config.json").read_text())
        return cfg.get("kind"), int(cfg.get("format_version", 0))
    except (OSError, json.JSONDecodeError, AttributeError, TypeError, ValueError):
        return None, 0


def _readable_format(d: Path) -> bool:
    kind, version = _format_of(d)
    return min_format_version(kind) <= version <= FORMAT_VERSION


def _current(d: Path, recipe: dict) -> bool:
    """Built with this recipe, in a drafter format this specrl reads."""
    return (d / "config.json").exists() and _recipe_of(d) == recipe and _readable_format(d)


def ensure_default_drafter(kind: str, name: str = "default", progress: bool = True) -> Path:
    """The cached drafter `kind:name` of the embedded model; trains it first (minutes, once) if missing.

    The cache records the recipe (`DEFAULT_BUILDS[name]`) it was built with; a cached drafter built with another
    recipe (or by a specrl that recorded none) is rebuilt, with a message saying so, never silently kept. The build
    writes into a temporary directory next to the final one and renames it when complete, so an interrupted build
    never leaves a half-written default behind.
    """
    if kind not in DEFAULT_KINDS:
        raise SpecRLError(f"there is no default {kind!r} drafter; defaults exist for 'eagle' and 'mtp'")
    from specrl.drafters.storage.shipped import check_shipped, is_shipped, shipped_dir

    if is_shipped(kind, name):  # trained ahead of time and shipped in the package: nothing to build, ever
        check_shipped(shipped_dir(name))  # its files; the target is checked where the head is loaded or exported
        return shipped_dir(name)
    final = default_drafter_dir(kind, name)
    b = DEFAULT_BUILDS[name]
    if _current(final, b):
        return final
    if (final / "config.json").exists() and _recipe_of(final) == b:
        print(f"[specrl] {kind}:{name} at {final} is in drafter format {_format_of(final)[1]}; this specrl writes "
              f"format {FORMAT_VERSION}: rebuilding it", flush=True)
    elif (final / "config.json").exists():
        old = _recipe_of(final)
        print(f"[specrl] {kind}:{name} at {final} was built with "
              f"{'recipe ' + json.dumps(old) if old else 'an unrecorded recipe (an older specrl)'}; the current "
              f"recipe is {json.dumps(b)}: rebuilding it", flush=True)
    remove_stale_builds(final)
    tmp = final.with_name(f"{final.name}.building-{os.getpid()}")
    shutil.rmtree(tmp, ignore_errors=True)
    print(f"[specrl] building the {kind}:{name} drafter for {DEFAULT_DRAFTER_MODEL} (first use only): "
          f"{b['samples']} in-domain {b['task']} rollouts ({b['answer_format']} answers, up to "
          f"{b['max_new_tokens']} tokens, T={b['temperature']}), {b['epochs']} epochs; cached at {final}", flush=True)
    t0 = time.perf_counter()
    drafter_build.train_drafter_offline(DEFAULT_DRAFTER_MODEL, kind,
                                prompts=task_prompts(b["task"], b["samples"], answer_format=b["answer_format"]),
                                samples=b["samples"], epochs=b["epochs"], out=tmp,
                                max_new_tokens=b["max_new_tokens"], temperature=b["temperature"], progress=progress,
                                source=f"{b['task']} ({b['answer_format']})")
    (tmp / RECIPE_FILE).write_text(json.dumps(b, indent=1) + "\n")
    if not _current(final, b):  # another process may have finished a current one first
        replace_dir(tmp, final)
    else:
        shutil.rmtree(tmp, ignore_errors=True)
    print(f"[specrl] {kind}:{name} drafter built in {time.perf_counter() - t0:.0f} s", flush=True)
    return final


def remove_stale_builds(final: Path) -> list[Path]:
    """Delete `NAME.building-PID` directories of interrupted builds whose process is gone; return them.

    A build that is still running (its PID is alive) is left alone: whichever build finishes first installs
    the drafter, the other discards its copy.
    """
    import psutil

    removed = []
    for d in sorted(final.parent.glob(f"{final.name}.building-*")) if final.parent.is_dir() else []:
        pid = d.name.rpartition("-")[2]
        if pid.isdigit() and int(pid) != os.getpid() and psutil.pid_exists(int(pid)):
            continue
        shutil.rmtree(d, ignore_errors=True)
        removed.append(d)
        print(f"[specrl] removed {d}, left by an interrupted build of the default drafter", file=sys.stderr,
              flush=True)
    return removed


def default_head_spec(spec: str) -> str:
    """`eagle:default` / `eagle:think` (a kind whose row is `embedded`) -> `eagle:DIR` of the cached head (built on
    first use); any other spec as it is. For consumers that take a directory, not a drafter object (the vLLM
    backend, the export)."""
    parsed = parse_drafter_spec(spec)
    if parsed.info.embedded and parsed.arg in DEFAULT_BUILDS:
        return f"{parsed.kind}:{ensure_default_drafter(parsed.kind, parsed.arg)}"
    return spec


def resolve_drafter(spec: str | None, target, dtype=None) -> Drafter | None:
    """`make_drafter(spec, target, dtype)` that builds `eagle:default` / `mtp:default` on first use."""
    return make_drafter(spec, target, dtype, build_default=ensure_default_drafter)

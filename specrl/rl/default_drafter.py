"""The default drafter of the embedded model, built from the RL task's own prompts, and drafter specs with it.

`eagle:default` / `mtp:default` is an in-domain drafter of SmolLM2-135M: the policy's rollouts on chain_sum
prompts, distilled with a small fixed budget (`DEFAULT_BUILD`) by `specrl.drafters.build.build_drafter`, and
cached next to the model (`specrl.drafters.default_drafter_dir`). The drafters layer only loads it; the build
lives here because only this layer knows tasks: `task_prompts` renders a task's train and held-out prompts
exactly as the trainer does (`PromptFormatter`). `ensure_default_drafter` builds it once; `resolve_drafter` is
`make_drafter` with that builder, what the CLI, the trainer and the benchmarks call.
"""

from __future__ import annotations

import os
import shutil
import sys
import time
from collections.abc import Callable
from pathlib import Path

from specrl.drafters import DEFAULT_DRAFTER_MODEL, DEFAULT_KINDS, Drafter, default_drafter_dir, make_drafter
from specrl.drafters import build as drafter_build
from specrl.errors import SpecRLError

# First-use budget for `eagle:default` / `mtp:default` (measured on an idle 2-core CPU: see README).
DEFAULT_BUILD = {"task": "chain_sum", "samples": 320, "epochs": 3, "max_new_tokens": 64}
DEFAULT_DIFFICULTY = "easy"


def task_prompts(task: str, samples: int, heldout: int = drafter_build.HELDOUT_PROMPTS,
                 difficulty: str = DEFAULT_DIFFICULTY, seed: int = 0) -> Callable:
    """A prompt source for `build_drafter`: tokenizer -> (train prompt ids, held-out prompt ids) of a task.

    The train split has up to `samples` prompts, the validation split `heldout` (disjoint from train, see
    `make_task`), both rendered with the chat template and answer instruction the trainer uses.
    """

    def encode(tokenizer) -> tuple[list[list[int]], list[list[int]]]:
        from specrl.rl.tasks import PromptFormatter, make_task

        train, val = make_task(task, difficulty=difficulty, train_size=samples, val_size=heldout, seed=seed)
        fmt = PromptFormatter(tokenizer)
        return [fmt.encode(p.question) for p in train.problems][:samples], [fmt.encode(p.question)
                                                                            for p in val.problems]

    return encode


def ensure_default_drafter(kind: str, progress: bool = True) -> Path:
    """The cached default drafter of the embedded model; trains it first (a few minutes, once) if missing.

    The build writes into a temporary directory next to the final one and renames it when complete, so an
    interrupted build never leaves a half-written default behind.
    """
    if kind not in DEFAULT_KINDS:
        raise SpecRLError(f"there is no default {kind!r} drafter; defaults exist for 'eagle' and 'mtp'")
    final = default_drafter_dir(kind)
    if (final / "config.json").exists():
        return final
    remove_stale_builds(final)
    tmp = final.with_name(f"{final.name}.building-{os.getpid()}")
    shutil.rmtree(tmp, ignore_errors=True)
    b = DEFAULT_BUILD
    print(f"[specrl] building the default {kind} drafter for {DEFAULT_DRAFTER_MODEL} (first use only): "
          f"{b['samples']} in-domain {b['task']} rollouts, {b['epochs']} epochs; cached at {final}", flush=True)
    t0 = time.perf_counter()
    drafter_build.build_drafter(DEFAULT_DRAFTER_MODEL, kind, prompts=task_prompts(b["task"], b["samples"]),
                                samples=b["samples"], epochs=b["epochs"], out=tmp,
                                max_new_tokens=b["max_new_tokens"], progress=progress, source=b["task"])
    if not (final / "config.json").exists():  # another process may have finished first
        shutil.rmtree(final, ignore_errors=True)
        tmp.rename(final)
    else:
        shutil.rmtree(tmp, ignore_errors=True)
    print(f"[specrl] default {kind} drafter built in {time.perf_counter() - t0:.0f} s", flush=True)
    return final


def remove_stale_builds(final: Path) -> list[Path]:
    """Delete `NAME.building-PID` directories of interrupted builds whose process is gone; return them.

    A build that is still running (its PID is alive) is left alone: whichever build finishes first installs
    the drafter, the other discards its copy.
    """
    from specrl.model.presets import pid_alive

    removed = []
    for d in sorted(final.parent.glob(f"{final.name}.building-*")) if final.parent.is_dir() else []:
        pid = d.name.rpartition("-")[2]
        if pid.isdigit() and int(pid) != os.getpid() and pid_alive(int(pid)):
            continue
        shutil.rmtree(d, ignore_errors=True)
        removed.append(d)
        print(f"[specrl] removed {d}, left by an interrupted build of the default drafter", file=sys.stderr,
              flush=True)
    return removed


def resolve_drafter(spec: str | None, target, dtype=None) -> Drafter | None:
    """`make_drafter(spec, target, dtype)` that builds `eagle:default` / `mtp:default` on first use."""
    return make_drafter(spec, target, dtype, build_default=ensure_default_drafter)

"""Drafters: propose tokens for the engine's single verifier (see base.py for the protocol).

`make_drafter(spec, target)` builds one from a CLI/config string: none | ngram | suffix |
draft-model:PATH_OR_PRESET | eagle:PATH | mtp:PATH. PATH may be `default`: the in-domain drafter of the embedded
model (SmolLM2-135M on the chain_sum task), which `ensure_default_drafter` trains on first use with a small,
fixed budget (`DEFAULT_BUILD`) and caches next to the model.
"""

from __future__ import annotations

import os
import shutil
import time
from pathlib import Path

from specrl.drafters.base import DraftBatch, Drafter, Proposal
from specrl.drafters.draft_model import DraftModelDrafter
from specrl.drafters.ngram import NGramDrafter
from specrl.drafters.suffix import SuffixDrafter
from specrl.errors import SpecRLError

from specrl.rollout.api import DRAFTER_KINDS

_NEEDS_PATH = ("draft-model", "eagle", "mtp")
DRAFTER_SPECS = tuple(f"{k}:PATH" if k in _NEEDS_PATH else k for k in DRAFTER_KINDS)  # how a spec is written

__all__ = ["DraftBatch", "Drafter", "Proposal", "DraftModelDrafter", "NGramDrafter", "SuffixDrafter",
           "EagleDrafter", "MTPDrafter", "make_drafter", "DRAFTER_KINDS"]


def __getattr__(name):
    if name == "EagleDrafter":
        from specrl.drafters.eagle import EagleDrafter

        return EagleDrafter
    if name == "MTPDrafter":
        from specrl.drafters.mtp import MTPDrafter

        return MTPDrafter
    raise AttributeError(name)


def default_drafter_dir(kind: str) -> Path:
    """Where `eagle:default` / `mtp:default` live: next to the embedded model in the specrl cache."""
    from specrl.model.presets import cache_root

    return cache_root() / "drafters" / f"smollm2-135m-{kind}-default"


# First-use budget for `eagle:default` / `mtp:default` (measured on an idle 2-core CPU: see README).
DEFAULT_BUILD = {"task": "chain_sum", "samples": 320, "epochs": 3, "max_new_tokens": 64}
EMBEDDED_SHAPE = {"hidden_size": 576, "num_layers": 30, "vocab_size": 49152}  # SmolLM2-135M (ModelArgs fields)


def _is_embedded(target) -> bool:
    args = getattr(target, "args", None)
    return args is not None and all(getattr(args, k, None) == v for k, v in EMBEDDED_SHAPE.items())


def ensure_default_drafter(kind: str, progress: bool = True) -> Path:
    """The cached default drafter of the embedded model; trains it first (a few minutes, once) if missing.

    The build writes into a temporary directory next to the final one and renames it when complete, so an
    interrupted build never leaves a half-written default behind.
    """
    if kind not in ("eagle", "mtp"):
        raise SpecRLError(f"there is no default {kind!r} drafter; defaults exist for 'eagle' and 'mtp'")
    final = default_drafter_dir(kind)
    if (final / "config.json").exists():
        return final
    from specrl.drafters.init_cli import draft_init_main

    tmp = final.with_name(f"{final.name}.building-{os.getpid()}")
    shutil.rmtree(tmp, ignore_errors=True)
    b = DEFAULT_BUILD
    print(f"[specrl] building the default {kind} drafter for smollm2-135m (first use only): {b['samples']} "
          f"in-domain {b['task']} rollouts, {b['epochs']} epochs; cached at {final}", flush=True)
    t0 = time.perf_counter()
    draft_init_main("smollm2-135m", kind, task=b["task"], samples=b["samples"], epochs=b["epochs"], out=tmp,
                    max_new_tokens=b["max_new_tokens"], progress=progress)
    if not (final / "config.json").exists():  # another process may have finished first
        shutil.rmtree(final, ignore_errors=True)
        tmp.rename(final)
    else:
        shutil.rmtree(tmp, ignore_errors=True)
    print(f"[specrl] default {kind} drafter built in {time.perf_counter() - t0:.0f} s", flush=True)
    return final


def read_draft_vocab(ckpt_dir: Path, vocab_size: int):
    """The draft vocabulary stored next to a draft-model checkpoint (`draft_vocab.json`), or None."""
    import json

    from specrl.drafters.base import check_draft_vocab
    from specrl.drafters.draft_model import DRAFT_VOCAB_FILE

    f = ckpt_dir / DRAFT_VOCAB_FILE
    if not ckpt_dir.is_dir() or not f.exists():
        return None
    try:
        ids = json.loads(f.read_text())
    except json.JSONDecodeError as e:
        raise SpecRLError(f"{f}: not valid JSON ({e}); expected a list of target token ids") from None
    if not isinstance(ids, list) or not all(isinstance(i, int) for i in ids):
        raise SpecRLError(f"{f}: expected a JSON list of integer token ids")
    return check_draft_vocab(ids, vocab_size, where=str(f))


def make_drafter(spec: str | None, target=None, dtype=None) -> Drafter | None:
    """Build a drafter from a spec string; None/'none' means plain autoregressive decoding."""
    if spec is None or spec == "none":
        return None
    kind, _, arg = spec.partition(":")
    if kind == "ngram" and not arg:
        return NGramDrafter()
    if kind == "suffix" and not arg:
        return SuffixDrafter()
    if kind in ("draft-model", "eagle", "mtp") and arg:
        if kind == "draft-model":
            from specrl.model.checkpoint import load_model

            if not Path(arg).exists() and "/" in arg:
                raise SpecRLError(f"draft model path {arg} does not exist")
            model, _ = load_model(arg, dtype=dtype or target.dtype)
            return DraftModelDrafter(model, draft_vocab=read_draft_vocab(Path(arg), model.args.vocab_size))
        from specrl.drafters.io import load_drafter

        if arg == "default":
            if target is not None and not _is_embedded(target) and not default_drafter_dir(kind).exists():
                raise SpecRLError(f"{kind}:default is the drafter of the embedded smollm2-135m model; this target "
                                  f"is a different model. Train one for it with `specrl draft init --model PATH "
                                  f"--drafter {kind} --task TASK --out DIR` and pass {kind}:DIR")
            arg = str(ensure_default_drafter(kind))
        return load_drafter(arg, target, expected_kind=kind)
    raise SpecRLError(f"unknown drafter {spec!r}; use one of {list(DRAFTER_SPECS)}")

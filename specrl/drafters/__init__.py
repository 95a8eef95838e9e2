"""Drafters: propose tokens for the engine's single verifier (see base.py for the protocol).

`make_drafter(spec, target)` builds one from a CLI/config string: none | ngram | suffix |
draft-model:PATH_OR_PRESET | eagle:PATH | mtp:PATH (PATH may be `default`).
"""

from __future__ import annotations

from pathlib import Path

from specrl.drafters.base import DraftBatch, Drafter, Proposal
from specrl.drafters.draft_model import DraftModelDrafter
from specrl.drafters.ngram import NGramDrafter
from specrl.drafters.suffix import SuffixDrafter
from specrl.errors import SpecRLError

DRAFTER_KINDS = ("none", "ngram", "suffix", "draft-model:PATH", "eagle:PATH", "mtp:PATH")

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
            return DraftModelDrafter(model)
        from specrl.drafters.io import load_drafter

        if arg == "default":
            arg = str(default_drafter_dir(kind))
            if not Path(arg).exists():
                raise SpecRLError(f"no default {kind} drafter at {arg}; build one with `specrl draft init --drafter "
                                  f"{kind} --task chain_sum --out {arg}` (or use drafter ngram / suffix)")
        return load_drafter(arg, target, expected_kind=kind)
    raise SpecRLError(f"unknown drafter {spec!r}; use one of {list(DRAFTER_KINDS)}")

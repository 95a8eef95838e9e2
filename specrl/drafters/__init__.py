"""specrl.drafters: every kind of drafter the engine verifies, and how drafters are made, stored and loaded.

Three folders, one per job. `kinds/` holds the drafters: draft model, EAGLE-3 head, the parallel head (all k
drafts from one forward), MTP heads, n-gram, sibling suffix and hybrid (a learned drafter with the suffix drafter).
`storage/` stores them: the drafter directory format, its manifest, the drafters shipped in the package, the
embedded model's default drafters, the vLLM export. `training/` makes them: offline and online training and, in
`training/build/`, building one from in-domain rollouts. Beside them sit the helpers all drafters share (`base.py`,
which re-exports the protocol of `specrl.rollout.drafter`; `trainable.py`, the methods training, `specrl draft
init` and drafter directories call on a drafter with weights) and the one registry of the built-in kinds
(`registry.py`). `make_drafter(spec, target)` builds one from a CLI/config string: none | ngram | suffix |
draft-model:PATH_OR_PRESET | eagle:PATH | mtp:PATH | parallel:PATH | hybrid:LEARNED | a user's kind. PATH may be one
of EMBEDDED_NAMES: a cached in-domain drafter of the embedded model (SmolLM2-135M): `default` on chain_sum's short
answers, `think` on the long step-by-step replies of examples/think.yaml. The RL layer builds them from its task
prompts (`specrl.drafters.storage.default`, `specrl prepare --drafter eagle[:think]`). Specs are parsed by
`specrl.rollout.drafter_spec`, whose table of kinds holds every kind: `registry.py` is the explicit registry of the
built-in kinds' builders and classes (`register_builtin_kinds`, called once here; `register_drafter` registers a
user's kind through the same `register_drafter_kind`), and `make_drafter` builds every kind through its row. It
imports model, rollout and errors only.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

from specrl.drafters.base import DraftBatch, Drafter, Proposal
from specrl.drafters.kinds.draft_model import DraftModelDrafter
from specrl.drafters.kinds.eagle import EagleDrafter
from specrl.drafters.kinds.mtp import MTPDrafter
from specrl.drafters.kinds.ngram import NGramDrafter
from specrl.drafters.kinds.suffix import SuffixDrafter
from specrl.drafters.registry import read_draft_vocab, register_builtin_kinds
from specrl.errors import SpecRLError
from specrl.rollout.drafter_spec import (
    DRAFTER_KINDS,
    EMBEDDED,
    DrafterKind,
    DrafterSpec,
    drafts,
    parse_drafter_spec,
    register_drafter_kind,
)

# kinds with a `default` drafter of the embedded model
DEFAULT_KINDS = tuple(k.name for k in DRAFTER_KINDS.values() if k.embedded)
EMBEDDED_NAMES = EMBEDDED  # the embedded model's built-on-first-use drafters (see rl.default_drafter)
DEFAULT_DRAFTER_MODEL = "smollm2-135m"  # the embedded model the `default` drafters belong to

__all__ = ["DraftBatch", "Drafter", "Proposal", "DraftModelDrafter", "NGramDrafter", "SuffixDrafter",
           "EagleDrafter", "MTPDrafter", "make_drafter", "register_drafter", "DrafterSpec", "DRAFTER_KINDS",
           "read_draft_vocab"]

register_builtin_kinds()  # the built-in rows of the kinds table get their builders and classes (drafters.registry)


def default_drafter_dir(kind: str, name: str = "default") -> Path:
    """Where `eagle:default` / `eagle:think` / `mtp:...` live: next to the embedded model in the specrl cache."""
    from specrl.model.presets import cache_root

    if name not in EMBEDDED_NAMES:
        raise SpecRLError(f"{name!r} is not an embedded drafter name; allowed: {', '.join(EMBEDDED_NAMES)}")
    return cache_root() / "drafters" / f"{DEFAULT_DRAFTER_MODEL}-{kind}-{name}"


EMBEDDED_SHAPE = {"hidden_size": 576, "num_layers": 30, "vocab_size": 49152}  # SmolLM2-135M (ModelArgs fields)


def _is_embedded(target) -> bool:
    args = getattr(target, "args", None)
    return args is not None and all(getattr(args, k, None) == v for k, v in EMBEDDED_SHAPE.items())


def register_drafter(name: str, build: Callable[..., Drafter], *, arg: str | None = None, learned: bool = False,
                     vllm: str | None = None, sim: str | None = None) -> DrafterKind:
    """Add a drafter kind: `build(spec, target, dtype)` returns the drafter for a parsed `DrafterSpec` (`spec.arg`
    is the text after `name:`; `arg` names it in help texts, None: the kind takes no argument). The native engine
    offers it at once; `vllm` names vLLM's speculative method for it (None: not offered on vLLM), `sim` the
    simulator drafter that prices it. Remove it with `specrl.rollout.drafter_spec.unregister_drafter_kind`."""
    if not callable(build):
        raise SpecRLError(f"register_drafter({name!r}): build must be callable (spec, target, dtype) -> Drafter")
    return register_drafter_kind(DrafterKind(name, arg=arg, learned=learned, vllm=vllm, sim=sim, build=build))


def make_drafter(spec: str | None, target=None, dtype=None,
                 build_default: Callable[[str, str], Path] | None = None) -> Drafter | None:
    """Build a drafter from a spec string; None/'none' means plain autoregressive decoding.

    Every kind, built in or registered, is built by its row of the kinds table (`DrafterKind.build`).
    `KIND:NAME` naming a drafter shipped in the package (`storage.shipped.SHIPPED`: eagle:think, eagle:default,
    parallel:think-parallel-markov) loads its verified files. `KIND:NAME` with NAME in EMBEDDED_NAMES (the kinds
    whose row is `embedded`: eagle, mtp) otherwise loads a cached drafter of
    the embedded model; when it is not built yet, `build_default(kind, name)` builds it and returns its directory
    (`specrl.drafters.storage.default.resolve_drafter` passes the builder), and without one the error says how to
    build it. A learned drafter runs in `dtype`, else in its target's dtype (a head stored in bf16 runs in fp32
    beside an fp32 target, where the CPU may lack bf16 units).
    """
    if not drafts(spec):
        return None
    if dtype is None:
        dtype = getattr(target, "dtype", None)
    try:
        parsed = parse_drafter_spec(spec)
    except SpecRLError as e:
        raise SpecRLError(f"unknown drafter {spec!r}: {e}") from None
    return _build(parsed, target, dtype, build_default)


def _build(parsed: DrafterSpec, target, dtype, build_default: Callable[[str, str], Path] | None) -> Drafter | None:
    info = parsed.info
    if info.wraps:  # its argument is a learned drafter spec: built first, then wrapped
        return info.build(parsed, target, dtype, inner=_build(parsed.inner, target, dtype, build_default))
    kind, arg = parsed.kind, parsed.arg
    from specrl.drafters.storage.shipped import SHIPPED, is_shipped, load_shipped

    shipped_as = SHIPPED.get(arg)
    if shipped_as not in (None, kind) and not (info.embedded and arg in EMBEDDED_NAMES) and not Path(arg).exists():
        raise SpecRLError(f"{kind}:{arg}: the package ships drafter {arg!r} of kind {shipped_as}, not {kind}; "
                          f"use {shipped_as}:{arg}")
    if is_shipped(kind, arg):  # trained ahead of time, inside the package: verified, never rebuilt
        if target is None:
            raise SpecRLError(f"{kind}:{arg} needs the target model it drafts for (pass target=)")
        if not _is_embedded(target):
            raise SpecRLError(_other_model(kind, arg))
        return load_shipped(kind, arg, target, dtype=dtype)
    if info.embedded and arg in EMBEDDED_NAMES:
        parsed = DrafterSpec(kind, str(_default_dir(kind, arg, target, build_default)))
    return info.build(parsed, target, dtype)


def _other_model(kind: str, name: str) -> str:
    return (f"{kind}:{name} is a drafter of the embedded {DEFAULT_DRAFTER_MODEL} model; this target is a different "
            f"model. Train one for it with `specrl draft init --model PATH --drafter {kind} --task TASK --out DIR` "
            f"and pass {kind}:DIR")


def _default_dir(kind: str, name: str, target, build_default: Callable[[str, str], Path] | None) -> Path:
    final = default_drafter_dir(kind, name)
    if target is not None and not _is_embedded(target) and not final.exists():
        raise SpecRLError(_other_model(kind, name))
    if build_default is not None:  # it returns the cached directory when that is current
        return Path(build_default(kind, name))
    if (final / "config.json").exists():
        return final
    spec = kind if name == "default" else f"{kind}:{name}"
    raise SpecRLError(f"{kind}:{name}, an in-domain drafter of {DEFAULT_DRAFTER_MODEL}, is not built yet "
                      f"({final} is missing); build it once with `specrl prepare --drafter {spec}` (minutes), "
                      f"or pass {kind}:DIR of a drafter from `specrl draft init`")

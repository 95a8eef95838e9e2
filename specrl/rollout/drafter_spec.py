"""Drafter specs (`kind[:arg]`) and THE table of drafter kinds every layer reads.

A drafter is named in configs and on the command line by a spec string: `none`, `ngram`, `suffix`, `eagle:PATH`,
`eagle:default`, `mtp:PATH`, `parallel:PATH`, `draft-model:PATH`, `hybrid:LEARNED` (a learned drafter spec plus the
sibling-suffix drafter, e.g. `hybrid:eagle:think`). `parse_drafter_spec` is the one parser of that string (a
`DrafterSpec`, or one SpecRLError saying what is wrong and what is allowed). `DRAFTER_KINDS` maps each kind to a
`DrafterKind`, the one place a kind's name is compared: whether it drafts at all (`none` does not), whether it takes
an argument and whether that argument is another drafter spec (hybrid), whether it has weights (learned), whether
the learner can train it online, the oldest drafter-directory format it reads, which vLLM speculative method it maps
onto (None: the vLLM backend does not offer it) and which simulator drafter prices it; the drafters layer
(`specrl.drafters`) completes every row with the function that builds the drafter and its class. Built-in and users'
kinds are rows of the same table: `register_drafter_kind` adds one (through `specrl.drafters.register_drafter`);
`kinds_offered` is the table of what each backend offers, read from the same rows, and `drafts(spec)` says whether a
spec names a drafter.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, replace
from typing import Any

from specrl.config.sections import NO_DRAFTER
from specrl.errors import SpecRLError

EMBEDDED = ("default", "think")  # names of the embedded model's built-on-first-use drafters (eagle / mtp)


@dataclass(frozen=True)
class DrafterKind:
    """One row of the kinds table."""

    name: str
    arg: str | None = None  # how the argument is written in help texts ("PATH", "LEARNED"); None: takes none
    example: str | None = None  # a spec the "needs a path" error suggests besides KIND:ARG (eagle:default)
    drafts: bool = True  # False: the kind means plain autoregressive decoding (`none`)
    wraps: bool = False  # the argument is a learned drafter spec that this kind runs with another drafter (hybrid)
    learned: bool = False  # has weights (a hybrid drafter wraps one of these)
    trainable: bool = False  # the learner can train it online (drafter.online)
    vllm: str | None = None  # vLLM's speculative method for it; None: the vLLM backend does not offer it
    sim: str | None = None  # the simulator drafter that prices it (specrl.sim.costs.speculation.DRAFTERS)
    embedded: bool = False  # `KIND:default` / `KIND:think` name drafters of the embedded model
    min_format_version: int | None = None  # oldest specrl drafter-directory format it reads; None: not saved as one
    build: Callable[..., Any] | None = None  # build(spec, target, dtype) -> Drafter (a `wraps` kind: also inner=)
    drafter_class: type | None = None  # the class `build` returns (its methods train and save it); set there too

    @property
    def forms(self) -> list[str]:
        """How a spec of this kind is written, for error messages and help."""
        if self.arg is None:
            return [self.name]
        return [f"{self.name}:{self.arg}"] + ([f"{self.name}:{n}" for n in EMBEDDED] if self.embedded else [])


@dataclass(frozen=True)
class DrafterSpec:
    """A parsed drafter spec: `kind`, its argument ("" when none) and, for hybrid, the parsed inner spec."""

    kind: str
    arg: str = ""
    inner: DrafterSpec | None = None

    def __str__(self) -> str:
        return f"{self.kind}:{self.arg}" if self.arg else self.kind

    @property
    def info(self) -> DrafterKind:
        return DRAFTER_KINDS[self.kind]

    @property
    def learned_part(self) -> DrafterSpec:
        """The spec whose weights this drafter runs (a hybrid's inner spec; itself otherwise)."""
        return self.inner if self.inner is not None else self


DRAFTER_KINDS: dict[str, DrafterKind] = {k.name: k for k in (
    DrafterKind(NO_DRAFTER, drafts=False, vllm="none", sim="none"),  # the config's value for plain decoding
    DrafterKind("ngram", vllm="ngram", sim="ngram"),
    DrafterKind("suffix", vllm="suffix", sim="ngram"),
    DrafterKind("draft-model", arg="PATH", learned=True, vllm="draft_model", sim="draft-model"),
    # format 1 EAGLE heads had another layer (a 2H -> H projection before a plain block); 2 is EAGLE-3's midlayer
    DrafterKind("eagle", arg="PATH", example="eagle:default", learned=True, trainable=True, vllm="eagle3",
                sim="eagle3", embedded=True, min_format_version=2),
    DrafterKind("mtp", arg="PATH", learned=True, trainable=True, sim="mtp", embedded=True, min_format_version=1),
    # an EAGLE-3 layer drafting all k tokens in one forward from learned placeholders (drafters/kinds/parallel.py)
    DrafterKind("parallel", arg="PATH", learned=True, min_format_version=2),
    DrafterKind("hybrid", arg="LEARNED", wraps=True),
)}
BACKEND_NAMES = ("native", "vllm")  # the backends whose offer the table records


def register_drafter_kind(kind: DrafterKind) -> DrafterKind:
    """Add a drafter kind to the table, or give a built-in row its builder (`specrl.drafters` registers each built-in
    kind this way, with the columns above). A name already registered with a builder is an error, and so is a
    built-in row registered with other columns than the ones declared here: the built-in kinds stay as they are."""
    if not isinstance(kind, DrafterKind):
        raise SpecRLError(f"register_drafter_kind expects a DrafterKind, got {type(kind).__name__}")
    if not kind.name or ":" in kind.name or kind.name != kind.name.strip():
        raise SpecRLError(f"drafter kind name {kind.name!r} must be non-empty, without ':' or surrounding spaces")
    if not kind.drafts and kind.name not in BUILTIN_KINDS:  # the config reads `none` as the one non-drafting kind
        raise SpecRLError(f"drafter kind {kind.name!r}: only the built-in 'none' means plain decoding (drafts=False)")
    have = DRAFTER_KINDS.get(kind.name)
    if have is not None and (have.build is not None or replace(kind, build=None, drafter_class=None) != have):
        raise SpecRLError(f"drafter kind {kind.name!r} is already registered; choose another name")
    DRAFTER_KINDS[kind.name] = kind
    return kind


def unregister_drafter_kind(name: str) -> None:
    """Remove a kind added with `register_drafter_kind` (tests and notebooks that register a toy kind)."""
    if name in BUILTIN_KINDS:
        raise SpecRLError(f"drafter kind {name!r} is built in and cannot be removed")
    DRAFTER_KINDS.pop(name, None)


BUILTIN_KINDS = frozenset(DRAFTER_KINDS)  # the kinds specrl declares (what users may not remove or redeclare)


def allowed_forms() -> str:
    """Every spec form the table allows, e.g. `none, ngram, suffix, eagle:PATH, eagle:default, ...`."""
    order = sorted(DRAFTER_KINDS.values(), key=lambda k: (k.wraps, k.arg is not None))
    return ", ".join(f for k in order for f in k.forms)


def _learned_forms() -> str:
    forms = [f for k in DRAFTER_KINDS.values() if k.learned for f in k.forms]
    return ", ".join(forms[:-1]) + f" or {forms[-1]}" if len(forms) > 1 else "".join(forms)


def parse_drafter_spec(spec: str) -> DrafterSpec:
    """`kind[:arg]` -> DrafterSpec; a SpecRLError for an unknown kind, a missing or unexpected argument, or a hybrid
    whose inner spec is not a learned drafter."""
    if not isinstance(spec, str):
        raise SpecRLError(f"a drafter spec is a string such as 'ngram' or 'eagle:PATH', got {type(spec).__name__}")
    kind, _, arg = spec.partition(":")
    info = DRAFTER_KINDS.get(kind)
    if info is None:
        raise SpecRLError(f"unknown drafter kind {kind!r}; allowed: {allowed_forms()}")
    if info.wraps:
        try:
            inner = parse_drafter_spec(arg) if arg else None
        except SpecRLError:
            inner = None
        if inner is None or not inner.info.learned or not inner.arg:
            raise SpecRLError(f"{kind}:{arg} needs a learned drafter spec after '{kind}:' ({_learned_forms()}), "
                              f"e.g. {kind}:eagle:think")
        return DrafterSpec(kind, arg, inner)
    if info.arg is not None and not arg:
        raise SpecRLError(f"drafter {kind!r} needs a path, e.g. '{kind}:{info.arg}'"
                          + (f" or '{info.example}'" if info.example else ""))
    if info.arg is None and arg:
        raise SpecRLError(f"drafter {kind!r} takes no argument")
    return DrafterSpec(kind, arg)


def kinds_offered(backend: str) -> tuple[str, ...]:
    """The drafter kinds a backend offers: every kind on the native engine, the kinds with a vLLM method on vLLM."""
    if backend == "native":
        return tuple(DRAFTER_KINDS)
    if backend == "vllm":
        return tuple(k.name for k in DRAFTER_KINDS.values() if k.vllm is not None)
    raise SpecRLError(f"no drafter table for backend {backend!r}; known: {list(BACKEND_NAMES)}")


def drafts(spec: str | None) -> bool:
    """Whether a spec string names a drafter: False for None and for a kind that means plain decoding (`none`);
    True otherwise, an unparsable spec included (its parser names the problem where the spec is used)."""
    if spec is None:
        return False
    info = DRAFTER_KINDS.get(str(spec).partition(":")[0])
    return info is None or info.drafts

"""Drafter specs (`kind[:arg]`) and THE table of drafter kinds every layer reads.

A drafter is named in configs and on the command line by a spec string: `none`, `ngram`, `suffix`,
`eagle:PATH`, `eagle:default`, `mtp:PATH`, `draft-model:PATH`, `hybrid:LEARNED` (a learned drafter spec plus
the sibling-suffix drafter, e.g. `hybrid:eagle:think`). `parse_drafter_spec` is the one parser of that string
(a `DrafterSpec`, or one SpecRLError saying what is wrong and what is allowed). `DRAFTER_KINDS` maps each kind
to a `DrafterKind`: whether it takes an argument, whether it has weights (learned), whether the learner can train
it online, which vLLM speculative method it maps onto (None: the vLLM backend does not offer it) and which
simulator drafter prices it. `register_drafter_kind` adds a kind (the drafters layer's
`specrl.drafters.register_drafter` pairs it with the function that builds the drafter); `kinds_offered` is
the table of what each backend offers, read from the same rows.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from specrl.errors import SpecRLError

EMBEDDED = ("default", "think")  # names of the embedded model's built-on-first-use drafters (eagle / mtp)


@dataclass(frozen=True)
class DrafterKind:
    """One row of the kinds table."""

    name: str
    arg: str | None = None  # how the argument is written in help texts ("PATH", "LEARNED"); None: takes none
    learned: bool = False  # has weights (a hybrid drafter wraps one of these)
    trainable: bool = False  # the learner can train it online (drafter.online)
    vllm: str | None = None  # vLLM's speculative method for it; None: the vLLM backend does not offer it
    sim: str | None = None  # the simulator drafter that prices it (specrl.sim.speculation.DRAFTERS)
    embedded: bool = False  # `KIND:default` / `KIND:think` name drafters of the embedded model
    build: Callable[..., Any] | None = None  # build(spec, target, dtype) -> Drafter; set by specrl.drafters

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
    DrafterKind("none", vllm="none", sim="none"),
    DrafterKind("ngram", vllm="ngram", sim="ngram"),
    DrafterKind("suffix", vllm="suffix", sim="ngram"),
    DrafterKind("draft-model", arg="PATH", learned=True, vllm="draft_model", sim="draft-model"),
    DrafterKind("eagle", arg="PATH", learned=True, trainable=True, vllm="eagle3", sim="eagle3", embedded=True),
    DrafterKind("mtp", arg="PATH", learned=True, trainable=True, sim="mtp", embedded=True),
    DrafterKind("hybrid", arg="LEARNED"),
)}
BACKEND_NAMES = ("native", "vllm")  # the backends whose offer the table records


def register_drafter_kind(kind: DrafterKind) -> DrafterKind:
    """Add a drafter kind to the table (a name already taken is an error: the built-in kinds stay as they are)."""
    if not isinstance(kind, DrafterKind):
        raise SpecRLError(f"register_drafter_kind expects a DrafterKind, got {type(kind).__name__}")
    if not kind.name or ":" in kind.name or kind.name != kind.name.strip():
        raise SpecRLError(f"drafter kind name {kind.name!r} must be non-empty, without ':' or surrounding spaces")
    if kind.name in DRAFTER_KINDS:
        raise SpecRLError(f"drafter kind {kind.name!r} is already registered; choose another name")
    DRAFTER_KINDS[kind.name] = kind
    return kind


def unregister_drafter_kind(name: str) -> None:
    """Remove a kind added with `register_drafter_kind` (tests and notebooks that register a toy kind)."""
    if name in _BUILTIN:
        raise SpecRLError(f"drafter kind {name!r} is built in and cannot be removed")
    DRAFTER_KINDS.pop(name, None)


_BUILTIN = frozenset(DRAFTER_KINDS)


def allowed_forms() -> str:
    """Every spec form the table allows, e.g. `none, ngram, suffix, eagle:PATH, eagle:default, ...`."""
    order = sorted(DRAFTER_KINDS.values(), key=lambda k: (k.name == "hybrid", k.arg is not None))
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
    if kind == "hybrid":
        try:
            inner = parse_drafter_spec(arg) if arg else None
        except SpecRLError:
            inner = None
        if inner is None or not inner.info.learned or not inner.arg:
            raise SpecRLError(f"hybrid:{arg} needs a learned drafter spec after 'hybrid:' ({_learned_forms()}), "
                              "e.g. hybrid:eagle:think")
        return DrafterSpec(kind, arg, inner)
    if info.arg is not None and not arg:
        raise SpecRLError(f"drafter {kind!r} needs a path, e.g. '{kind}:{info.arg}'"
                          + (f" or '{kind}:default'" if kind == "eagle" else ""))
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

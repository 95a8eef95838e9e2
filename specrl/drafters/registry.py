"""THE registry of the built-in drafter kinds: each kind's builder (spec, target, dtype) -> drafter and its class,
written into its row of the kinds table (`specrl.rollout.drafter_spec.DRAFTER_KINDS`) by `register_builtin_kinds`,
which `specrl.drafters` calls once, explicitly. A user's kind is registered the same way
(`specrl.drafters.register_drafter`). `read_draft_vocab` reads the draft vocabulary stored beside a draft model.
"""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

from specrl.drafters.base import Drafter
from specrl.drafters.kinds.draft_model import DraftModelDrafter
from specrl.drafters.kinds.eagle import EagleDrafter
from specrl.drafters.kinds.hybrid import HybridDrafter
from specrl.drafters.kinds.mtp import MTPDrafter
from specrl.drafters.kinds.ngram import NGramDrafter
from specrl.drafters.kinds.parallel import ParallelDrafter
from specrl.drafters.kinds.suffix import SuffixDrafter
from specrl.errors import SpecRLError
from specrl.rollout.drafter_spec import DRAFTER_KINDS, DrafterSpec, register_drafter_kind


def read_draft_vocab(ckpt_dir: Path, vocab_size: int):
    """The draft vocabulary stored next to a draft-model checkpoint (`draft_vocab.json`), or None."""
    import json

    from specrl.drafters.base import check_draft_vocab
    from specrl.drafters.kinds.draft_model import DRAFT_VOCAB_FILE

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


# ---------------------------------------------------------------- the built-in kinds' builders
def _build_none(spec: DrafterSpec, target, dtype) -> None:
    return None


def _build_ngram(spec: DrafterSpec, target, dtype) -> NGramDrafter:
    return NGramDrafter()


def _build_suffix(spec: DrafterSpec, target, dtype) -> SuffixDrafter:
    return SuffixDrafter()


def _build_draft_model(spec: DrafterSpec, target, dtype) -> DraftModelDrafter:
    from specrl.model.loader import load_model, same_tokenizer

    arg = spec.arg
    if not Path(arg).exists() and "/" in arg:
        raise SpecRLError(f"draft model path {arg} does not exist")
    model, _ = load_model(arg, dtype=dtype or target.dtype,
                          device="cpu" if target is None else target.embed_tokens.weight.device)
    same_tokenizer(getattr(target, "checkpoint_dir", None), model.checkpoint_dir, "draft model")
    return DraftModelDrafter(model, draft_vocab=read_draft_vocab(Path(arg), model.args.vocab_size))


def _build_from_directory(spec: DrafterSpec, target, dtype) -> Drafter:
    """A drafter directory written by `save_drafter` / `specrl draft init` (`specrl.drafters.storage.io`), in `dtype`
    (`make_drafter` passes the target's dtype unless told otherwise)."""
    from specrl.drafters.storage.io import load_drafter

    return load_drafter(spec.arg, target, expected_kind=spec.kind, dtype=dtype)


def _build_hybrid(spec: DrafterSpec, target, dtype, inner: Drafter) -> HybridDrafter:
    return HybridDrafter(inner)


# the built-in kinds: (name, builder, drafter class); their other columns are the rows of drafter_spec.py
BUILTIN_BUILDERS = (("none", _build_none, None), ("ngram", _build_ngram, NGramDrafter),
                    ("suffix", _build_suffix, SuffixDrafter), ("draft-model", _build_draft_model, DraftModelDrafter),
                    ("eagle", _build_from_directory, EagleDrafter), ("mtp", _build_from_directory, MTPDrafter),
                    ("parallel", _build_from_directory, ParallelDrafter), ("hybrid", _build_hybrid, HybridDrafter))


def register_builtin_kinds() -> None:
    """Complete every built-in row with its builder and class (idempotent: a row already completed is kept)."""
    for name, build, cls in BUILTIN_BUILDERS:
        if DRAFTER_KINDS[name].build is None:
            register_drafter_kind(replace(DRAFTER_KINDS[name], build=build, drafter_class=cls))

"""The one parser of drafter specs and the kinds table every layer reads (specrl.rollout.drafter_spec)."""

from __future__ import annotations

import pytest

from specrl.errors import SpecRLError
from specrl.rollout.drafter_spec import DRAFTER_KINDS, DrafterSpec, allowed_forms, kinds_offered, parse_drafter_spec


@pytest.mark.parametrize("spec, kind, arg, inner", [
    ("none", "none", "", None), ("ngram", "ngram", "", None), ("suffix", "suffix", "", None),
    ("eagle:default", "eagle", "default", None), ("mtp:/a/b", "mtp", "/a/b", None),
    ("draft-model:C:/models/x", "draft-model", "C:/models/x", None),
    ("hybrid:eagle:think", "hybrid", "eagle:think", DrafterSpec("eagle", "think")),
])
def test_parse(spec, kind, arg, inner):
    parsed = parse_drafter_spec(spec)
    assert (parsed.kind, parsed.arg, parsed.inner) == (kind, arg, inner)
    assert str(parsed) == spec
    assert parsed.learned_part == (inner or parsed)


@pytest.mark.parametrize("spec, message", [
    ("medusa", r"unknown drafter kind 'medusa'; allowed: none, ngram, suffix, draft-model:PATH, eagle:PATH, "
               r"eagle:default, eagle:think, mtp:PATH, mtp:default, mtp:think, hybrid:LEARNED"),
    ("", "unknown drafter kind ''"),
    ("eagle", r"drafter 'eagle' needs a path, e.g. 'eagle:PATH' or 'eagle:default'"),
    ("mtp:", r"drafter 'mtp' needs a path, e.g. 'mtp:PATH'$"),
    ("none:x", "drafter 'none' takes no argument"),
    ("ngram:4", "drafter 'ngram' takes no argument"),
    ("hybrid:suffix", r"hybrid:suffix needs a learned drafter spec after 'hybrid:' \(draft-model:PATH, "),
    ("hybrid:eagle", "hybrid:eagle needs a learned drafter spec"),
    ("hybrid:hybrid:eagle:x", "needs a learned drafter spec"),
    (3, "a drafter spec is a string"),
])
def test_bad_specs(spec, message):
    with pytest.raises(SpecRLError, match=message):
        parse_drafter_spec(spec)


def test_table_columns_and_backend_offers():
    assert [k for k, v in DRAFTER_KINDS.items() if v.trainable] == ["eagle", "mtp"]
    assert [k for k, v in DRAFTER_KINDS.items() if v.learned] == ["draft-model", "eagle", "mtp"]
    assert kinds_offered("native") == ("none", "ngram", "suffix", "draft-model", "eagle", "mtp", "hybrid")
    assert kinds_offered("vllm") == ("none", "ngram", "suffix", "draft-model", "eagle")
    assert "hybrid:LEARNED" in allowed_forms()
    with pytest.raises(SpecRLError, match="no drafter table for backend 'sglang'"):
        kinds_offered("sglang")

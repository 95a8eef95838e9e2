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


def _batch(tokens, positions, seeds, request_ids, group_ids):
    import torch

    from specrl.drafters.base import DraftBatch

    n = len(tokens)
    return DraftBatch(tokens=tokens, positions=positions, seeds=seeds, request_ids=request_ids, group_ids=group_ids,
                      temperature=torch.ones(n), top_p=torch.ones(n), top_k=torch.zeros(n, dtype=torch.long))


def test_the_suffix_index_is_a_bounded_sliding_window_that_still_drafts_from_history():
    """Epoch after epoch of the same prompts: the index holds at most max_history sequences per group (their tokens
    and n-gram entries stay flat, not growing with the run), and the latest epoch's rollouts still feed drafts."""
    import torch

    from specrl.drafters.suffix import SuffixDrafter

    d = SuffixDrafter(max_history=8, max_groups=3)
    g = torch.Generator().manual_seed(0)
    sizes = []
    for epoch in range(12):
        for group in range(3):  # 3 prompts, 4 samples each per epoch
            rows = [torch.randint(3, 40, (30,), generator=g).tolist() for _ in range(4)]
            seeds = torch.tensor([epoch] * 4)
            batch = _batch(tokens=rows, positions=torch.tensor([30] * 4), seeds=seeds,
                               request_ids=torch.arange(4), group_ids=[group] * 4)
            d.continuations(batch, 3)
        sizes.append(d.memory())
    assert sizes[-1] == sizes[3] and sizes[-1]["sequences"] == 3 * 8  # flat once the window is full
    assert sizes[-1]["groups"] == 3
    # a context from the newest epoch's rows is found; one from an evicted epoch is not
    newest = d.groups[2].seqs[max(d.groups[2].seqs)]
    probe = _batch(tokens=[newest[:10]], positions=torch.tensor([10]), seeds=torch.tensor([99]),
                       request_ids=torch.tensor([0]), group_ids=[2])
    cont, n = d.continuations(probe, 3)[0]
    assert cont == newest[10:13] and n >= 8
    d2 = SuffixDrafter(max_groups=1)
    d2.continuations(probe, 3)
    other = _batch(tokens=[[5, 6, 7]], positions=torch.tensor([3]), seeds=torch.tensor([1]),
                       request_ids=torch.tensor([0]), group_ids=[7])
    d2.continuations(other, 3)
    assert list(d2.groups) == [7]  # the least recently used group was forgotten
    with pytest.raises(SpecRLError, match="max_history must be an integer >= 1"):
        SuffixDrafter(max_history=0)

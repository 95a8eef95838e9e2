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
               r"eagle:default, eagle:think, mtp:PATH, mtp:default, mtp:think, parallel:PATH, hybrid:LEARNED"),
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
    assert [k for k, v in DRAFTER_KINDS.items() if v.learned] == ["draft-model", "eagle", "mtp", "parallel"]
    assert kinds_offered("native") == ("none", "ngram", "suffix", "draft-model", "eagle", "mtp", "parallel", "hybrid")
    assert kinds_offered("vllm") == ("none", "ngram", "suffix", "draft-model", "eagle")
    assert "hybrid:LEARNED" in allowed_forms()
    with pytest.raises(SpecRLError, match=r"drafter table.*'sglang'"):
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

    from specrl.drafters.kinds.suffix import SuffixDrafter

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
    cont, n, _ = d.continuations(probe, 3)[0]
    assert cont == newest[10:13] and n >= 8
    d2 = SuffixDrafter(max_groups=1)
    d2.continuations(probe, 3)
    other = _batch(tokens=[[5, 6, 7]], positions=torch.tensor([3]), seeds=torch.tensor([1]),
                       request_ids=torch.tensor([0]), group_ids=[7])
    d2.continuations(other, 3)
    assert list(d2.groups) == [7]  # the least recently used group was forgotten
    with pytest.raises(SpecRLError, match=r"max_history.*>= 1, got 0"):
        SuffixDrafter(max_history=0)


def _suffix_batch(rows, group=0):
    import torch

    return _batch(tokens=rows, positions=torch.tensor([len(r) for r in rows]), seeds=torch.arange(len(rows)),
                  request_ids=torch.arange(len(rows)), group_ids=[group] * len(rows))


def test_the_suffix_draft_is_gated_by_the_empirical_probability_of_its_tokens():
    """Two histories continue the same context differently: the next token has frequency 1/2 (the most recent
    history wins the tie) and the draft goes on while the product of the frequencies stays >= min_prob."""
    from specrl.drafters.kinds.suffix import SuffixDrafter

    ctx = [1, 2, 3, 4, 5, 6, 7, 8]
    histories = [ctx + [9, 10, 11, 12], ctx + [20, 21, 22, 23]]
    for min_prob, want in ((0.3, [20, 21, 22]), (0.6, [])):
        d = SuffixDrafter(min_prob=min_prob)
        d.continuations(_suffix_batch(histories), 3)
        m = d.continuations(_suffix_batch([*histories, list(ctx)]), 3)[2]
        assert m.tokens == want
        assert m.matched == (8 if want else 0)
        assert m.probs == ([0.5, 0.5, 0.5] if want else [])
    # agreement: both histories continue alike -> probability 1, a full draft
    d = SuffixDrafter()
    same = [ctx + [9, 10, 11], [0] + ctx + [9, 10, 11]]
    m = d.continuations(_suffix_batch([*same, list(ctx)]), 3)[2]
    assert m.tokens == [9, 10, 11] and m.probs == [1.0, 1.0, 1.0]
    with pytest.raises(SpecRLError, match=r"min_prob.*got 1\.5") as e:
        SuffixDrafter(min_prob=1.5)
    assert "[0, 1]" in str(e.value)


def test_the_hybrid_takes_a_history_draft_only_where_it_is_expected_to_beat_the_learned_one():
    import torch

    from specrl.drafters.base import Drafter, Proposal
    from specrl.drafters.kinds.hybrid import HybridDrafter

    class Learned(Drafter):
        kind = "fake-learned"

        def propose(self, batch, k):
            probs = torch.zeros(batch.size, k, 50)
            probs[..., 3] = 1.0
            return Proposal(torch.full((batch.size, k), 3), probs)

    ctx = list(range(10, 20))
    hist = ctx + [30, 31, 32]
    h = HybridDrafter(Learned(), min_match=5)
    h.propose(_suffix_batch([hist]), 3)  # index the history (its own row has no continuation: learned)
    h._last = None
    prop = h.propose(_suffix_batch([hist, list(ctx), [40, 41]]), 3)
    # row 1 matched 8 tokens with probability 1: the history draft, ragged to its 3 tokens; rows 0 and 2: learned
    assert prop.from_history.tolist() == [False, True, False]
    assert prop.tokens[1].tolist() == [30, 31, 32] and prop.num_drafts.tolist() == [3, 3, 3]
    assert prop.probs[1, torch.arange(3), [30, 31, 32]].tolist() == [1.0, 1.0, 1.0]
    # the learned drafter measured to accept everything, history drafts measured to accept nothing: learned wins
    h._att, h._acc = [1e6] * 3, [1e6] * 3
    h._predicted, h._got = 1e6, 0.0
    h._last = None
    prop = h.propose(_suffix_batch([hist, list(ctx)], group=0), 3)
    assert prop.from_history is None or not bool(prop.from_history.any())
    # outcomes feed the evidence: history rows that get what they predicted keep the calibration at 1, a rejected
    # one lowers it; a learned row that rejects its first draft counts one attempt and no acceptance there
    h2 = HybridDrafter(Learned(), min_match=5)
    h2.propose(_suffix_batch([hist]), 3)
    h2._last = None
    h2.propose(_suffix_batch([hist, list(ctx)]), 3)
    h2._observe([1, 4])  # row 0 (learned) rejected its first draft; row 1 (history) accepted 3 of 3
    assert h2.calibration() == pytest.approx(1.0) and (h2._att[0], h2._acc[0]) == (1, 0)
    h2.propose(_suffix_batch([hist, list(ctx)]), 3)
    h2._observe([1, 1])  # the history row's first draft rejected
    assert h2.calibration() < 0.75
    assert h2.memory()["tokens"] > 0  # the hybrid reports its suffix index's size
    with pytest.raises(SpecRLError, match=r"min_ratio.*>= 0, got -1"):
        HybridDrafter(Learned(), min_ratio=-1)


def test_the_suffix_index_holds_at_most_max_tokens_over_all_prompts():
    """Prompts beyond the token budget push out the oldest sequences first: here the older prompts' history."""
    from specrl.drafters.kinds.suffix import SuffixDrafter

    d = SuffixDrafter(max_tokens=100)
    for group in range(5):  # 5 prompts x 2 rows x 20 tokens = 200 tokens offered, 2 prompts' worth fit
        d.continuations(_suffix_batch([list(range(group, group + 20)), list(range(group + 1, group + 21))], group), 3)
        assert d.memory()["tokens"] <= 100 and group in d.groups
    # the five newest sequences: prompt 2's second row, prompts 3 and 4 whole
    assert {g: list(d.groups[g].seqs.values()) for g in d.groups} == {
        2: [list(range(3, 23))], 3: [list(range(3, 23)), list(range(4, 24))],
        4: [list(range(4, 24)), list(range(5, 25))]}
    big = SuffixDrafter(max_tokens=10)  # one batch larger than the budget: the bound holds for it too
    big.continuations(_suffix_batch([list(range(40))], 9), 3)
    assert list(big.groups) == [9] and big.memory()["tokens"] == 0
    with pytest.raises(SpecRLError, match=r"max_tokens.*>= 1, got 0"):
        SuffixDrafter(max_tokens=0)


def test_the_suffix_index_bound_is_in_tokens_and_drops_the_oldest_sequences_the_batch_s_included():
    """A long-response run: 4 prompts x 4 samples growing to 60 tokens, three epochs, a budget of 300 tokens (less
    than one batch, 960). After every engine step the index holds at most 300 tokens (and at most one n-gram entry
    per match length per token); what it drops is always the oldest sequences, the running batch's included; a
    dropped running sequence is not indexed again as it grows, and its siblings still draft for it."""
    import torch

    from specrl.drafters.kinds.suffix import SuffixDrafter

    d = SuffixDrafter(max_tokens=300)
    g = torch.Generator().manual_seed(0)
    created = []  # (epoch, group, row) in the order the index first saw them
    for epoch in range(3):
        rows = {(grp, r): torch.randint(3, 12, (60,), generator=g).tolist() for grp in range(4) for r in range(4)}
        for length in range(5, 61, 5):  # the engine's steps: every row grows by 5 tokens
            keys = sorted(rows)
            batch = _batch(tokens=[rows[key][:length] for key in keys], positions=torch.tensor([length] * 16),
                           seeds=torch.tensor([epoch] * 16), request_ids=torch.tensor([r for _, r in keys]),
                           group_ids=[grp for grp, _ in keys])
            if length == 5:
                created += [(epoch, *key) for key in keys]
            matches = d.continuations(batch, 3)
            mem = d.memory()
            assert mem["tokens"] <= 300 and mem["index_entries"] <= 300 * len(d.lengths), (epoch, length, mem)
            assert len(matches) == 16
        held = {(epoch, grp, r) for grp, gi in d.groups.items() for sid, toks in gi.seqs.items()
                for r in range(4) if toks == rows[(grp, r)]}
        # the held sequences are the newest ones: every dropped one was created before every held one
        order = [created.index(h) for h in held]
        dropped = [i for i, c in enumerate(created) if c[0] == epoch and c not in held]
        assert held and dropped and max(dropped) < min(order), (sorted(order), dropped)
        assert sum(len(t) for gi in d.groups.values() for t in gi.seqs.values()) == d.memory()["tokens"] <= 300
    # a dropped running sequence stays out of the index as it grows
    gone = next(gi for gi in d.groups.values() if gi.gone)
    assert all(n == 60 for n, _ in gone.gone.values())

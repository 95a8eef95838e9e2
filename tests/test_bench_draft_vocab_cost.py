"""benchmarks/draft_vocab_cost.py: cutting an EAGLE head to the first N entries of its draft vocabulary."""

import pytest
import torch

from specrl.drafters.kinds.eagle import EagleDrafter
from specrl.errors import SpecRLError
from specrl.model.transformer import tiny_model
from tests.bench import load_benchmark


def test_a_cut_keeps_the_first_n_entries_and_their_head_rows_and_refuses_a_size_outside_the_vocabulary():
    mod = load_benchmark("draft_vocab_cost")
    target = tiny_model("llama", vocab_size=64, seed=1)
    full = EagleDrafter(target, draft_vocab=[7, 3, 60, 12, 5, 40]).eval()
    d = mod.cut(target, full, 3)
    assert d.d2t.tolist() == [7, 3, 60]
    assert torch.equal(d.lm_head.weight, full.lm_head.weight[:3])
    assert torch.equal(d.fc.weight, full.fc.weight) and d.dtype == full.dtype
    for bad in (0, 7):
        with pytest.raises(SpecRLError, match=r"outside 1\.\.6"):
            mod.cut(target, full, bad)


def test_sizes_that_are_not_integers_are_refused_before_any_model_loads():
    mod = load_benchmark("draft_vocab_cost")
    with pytest.raises(SpecRLError, match="comma-separated integers"):
        mod.main(["--sizes", "512,big"])

"""Bad speculative-decoding input gets a clear error."""

import pytest

from specrl import RolloutEngine
from specrl.drafters import DraftModelDrafter, NGramDrafter, make_drafter
from specrl.errors import SpecRLError
from specrl.model.transformer import tiny_model


@pytest.fixture(scope="module")
def target():
    return tiny_model("llama", vocab_size=64)


@pytest.mark.parametrize("k", [-1, 8, 2.5, "three"])
def test_bad_num_draft_tokens(target, k):
    with pytest.raises(SpecRLError, match=r"num_draft_tokens must be an integer in 0\.\.7 \(k_max\) or 'auto'"):
        RolloutEngine(target, max_seq_len=64, drafter=NGramDrafter(), num_draft_tokens=k)


def test_unknown_verify_mode(target):
    with pytest.raises(SpecRLError, match=r"verify='exact' is unknown; use one of \['rejection', 'seed_exact'\]"):
        RolloutEngine(target, max_seq_len=64, drafter=NGramDrafter(), verify="exact")


def test_draft_model_vocab_mismatch(target):
    with pytest.raises(SpecRLError, match="draft model vocab size 32 differs from the target's 64"):
        RolloutEngine(target, max_seq_len=64, drafter=DraftModelDrafter(tiny_model("llama", vocab_size=32)))


def test_unknown_drafter_spec_and_missing_paths(target, tmp_path):
    with pytest.raises(SpecRLError, match="unknown drafter 'medusa'"):
        make_drafter("medusa", target)
    with pytest.raises(SpecRLError, match="does not exist"):
        make_drafter(f"draft-model:{tmp_path}/nope", target)
    with pytest.raises(SpecRLError, match="does not exist"):
        make_drafter(f"eagle:{tmp_path}/nope", target)


def test_missing_default_drafter_says_how_to_build_it(target, tmp_path, monkeypatch):
    monkeypatch.setenv("SPECRL_HOME", str(tmp_path))
    with pytest.raises(SpecRLError, match="specrl draft init --drafter eagle"):
        make_drafter("eagle:default", target)

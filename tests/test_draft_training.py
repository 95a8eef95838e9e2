"""Offline drafter initialisation: training lowers the held-out loss and raises acceptance; bad input errors."""

import pytest
import torch

from specrl import RolloutEngine, SamplingParams
from specrl.drafters.kinds.eagle import EagleDrafter
from specrl.drafters.kinds.mtp import MTPDrafter
from specrl.drafters.training.offline import heldout_acceptance, select_draft_vocab, train_drafter
from specrl.errors import SpecRLError
from specrl.model.transformer import tiny_model


@pytest.fixture(scope="module")
def target():
    # a lower-entropy tiny target (larger weights) so there is something to learn in a few steps
    return tiny_model("llama", vocab_size=32, seed=3)


@pytest.fixture(scope="module")
def data(target):
    prompts = [[i % 32, (3 * i + 1) % 32, (7 * i + 2) % 32] for i in range(48)]
    eng = RolloutEngine(target, max_batch_size=48, max_seq_len=40)
    outs = eng.generate(prompts, SamplingParams(temperature=1.0, max_new_tokens=24, seed=0))
    return prompts, [p + o.token_ids for p, o in zip(prompts, outs, strict=True)]


@pytest.mark.parametrize("kind", ["eagle", "mtp"])
def test_training_lowers_heldout_loss_and_keeps_target_frozen(target, data, kind):
    prompts, seqs = data
    before = {n: p.clone() for n, p in target.named_parameters()}
    torch.manual_seed(0)
    d = EagleDrafter(target, draft_vocab=select_draft_vocab(seqs, 24)) if kind == "eagle" else \
        MTPDrafter(target, num_modules=2)
    res = train_drafter(d, target, seqs, epochs=4, lr=3e-3, batch_size=8, progress=False,
                        prompt_lens=[len(p) for p in prompts], ttt_steps=2)
    assert res["heldout_loss"] < res["initial_heldout_loss"] - 0.05, res
    assert res["heldout_top1"] > res["initial_heldout_top1"], res
    assert res["train_sequences"] + res["heldout_sequences"] == len(seqs)
    for n, p in target.named_parameters():
        assert torch.equal(p, before[n]) and p.grad is None


def test_trained_eagle_accepts_more(target, data):
    prompts, seqs = data
    torch.manual_seed(0)
    d = EagleDrafter(target)
    held = [[5, 9, 30], [11, 2, 7], [1, 1, 4], [20, 21, 22]]
    untrained = heldout_acceptance(target, d, held, k=3, max_new_tokens=16)
    train_drafter(d, target, seqs, epochs=6, lr=3e-3, batch_size=8, progress=False, ttt_steps=3)
    trained = heldout_acceptance(target, d, held, k=3, max_new_tokens=16)
    assert 1.0 <= untrained < trained <= 4.0


def test_select_draft_vocab_most_frequent_first():
    seqs = [[5, 5, 5, 2, 2, 9], [5, 2, 7]]
    assert select_draft_vocab(seqs, 2) == [5, 2]
    assert select_draft_vocab(seqs, 3, always=(31,)) == [31, 5, 2]
    with pytest.raises(SpecRLError, match=r"vocabulary size.*>= 1.*\b0$"):
        select_draft_vocab(seqs, 0)


def test_empty_training_data(target):
    with pytest.raises(SpecRLError, match="training data is empty"):
        train_drafter(EagleDrafter(target), target, [], progress=False)


def test_single_sequence_is_too_little(target):
    with pytest.raises(SpecRLError, match=r"\b1 sequence;.*least 2"):
        train_drafter(EagleDrafter(target), target, [[1, 2, 3, 4]], progress=False)


def test_too_short_sequence(target):
    with pytest.raises(SpecRLError, match=r"sequence 1\b.*\b2 tokens") as e:
        train_drafter(EagleDrafter(target), target, [[1, 2, 3, 4], [1, 2]], progress=False)
    assert "at least 3" in str(e.value)


def test_unknown_drafter_kind(target):
    from specrl.drafters.kinds.ngram import NGramDrafter

    with pytest.raises(SpecRLError, match="unknown drafter kind"):
        train_drafter(NGramDrafter(), target, [[1, 2, 3, 4], [1, 2, 3]], progress=False)


def test_out_of_vocab_tokens(target):
    with pytest.raises(SpecRLError, match=r"outside \[0, 32\)"):
        train_drafter(MTPDrafter(target), target, [[1, 2, 3, 4], [1, 2, 99]], progress=False)


def test_draft_model_distillation_lowers_loss_and_accepts_more(target, data, tmp_path):
    """A slice of the target's layers, distilled on its rollouts, matches it better; target and the
    (frozen, tied) embeddings are untouched; the saved checkpoint reloads as the same draft model."""
    from specrl.drafters import make_drafter
    from specrl.drafters.kinds.draft_model import DraftModelDrafter, slice_layers
    from specrl.drafters.training.build.from_rollouts import save_draft_model
    from specrl.model.hf_checkpoint import save_hf_checkpoint

    prompts, seqs = data
    before = {n: p.clone() for n, p in target.named_parameters()}
    draft = slice_layers(target, [0])
    assert draft.args.num_layers == 1 and target.args.num_layers == 4
    draft.embed_tokens.weight.requires_grad_(False)
    emb = draft.embed_tokens.weight.clone()
    d = DraftModelDrafter(draft)
    held = [[5, 9, 30], [11, 2, 7], [1, 1, 4], [20, 21, 22]]
    untrained = heldout_acceptance(target, d, held, k=3, max_new_tokens=16)
    torch.manual_seed(0)
    res = train_drafter(d, target, seqs, epochs=6, lr=3e-3, batch_size=8, progress=False,
                        prompt_lens=[len(p) for p in prompts])
    assert res["heldout_loss"] < res["initial_heldout_loss"] - 0.05, res
    trained = heldout_acceptance(target, d, held, k=3, max_new_tokens=16)
    assert 1.0 <= untrained < trained <= 4.0
    assert torch.equal(draft.embed_tokens.weight, emb) and draft.lm_head.weight is draft.embed_tokens.weight
    for n, p in target.named_parameters():
        assert torch.equal(p, before[n]) and p.grad is None
    tdir = save_hf_checkpoint(target, tmp_path / "target")
    save_draft_model(draft, tdir, tmp_path / "draft")
    again = make_drafter(f"draft-model:{tmp_path / 'draft'}", target, dtype=torch.float32)
    assert isinstance(again, DraftModelDrafter)
    for (n, p), (_, q) in zip(draft.state_dict().items(), again.model.state_dict().items(), strict=True):
        assert torch.equal(p, q), n


def test_slice_layers_bad_input(target):
    from specrl.drafters.kinds.draft_model import slice_layers

    with pytest.raises(SpecRLError, match="at least one layer"):
        slice_layers(target, [])
    with pytest.raises(SpecRLError, match=r"layer indices.*\[0, 4\)"):
        slice_layers(target, [0, 4])
    with pytest.raises(SpecRLError, match="increasing"):
        slice_layers(target, [1, 0])


def test_draft_model_with_other_vocab_is_refused(target, data):
    from specrl.drafters.kinds.draft_model import DraftModelDrafter

    other = tiny_model("llama", vocab_size=48, seed=1)
    with pytest.raises(SpecRLError, match=r"vocabulary has 48\b.*\b32\b"):
        train_drafter(DraftModelDrafter(other), target, data[1], progress=False)


def test_draft_init_rejects_bad_layer_count(target, tmp_path):
    from specrl.drafters.training.build.from_rollouts import train_drafter_offline
    from specrl.model.hf_checkpoint import save_hf_checkpoint

    tdir = save_hf_checkpoint(target, tmp_path / "target")
    for bad in (0, 4, "3"):
        with pytest.raises(SpecRLError, match=r"draft_layers.*\[1, 3\]"):
            train_drafter_offline(str(tdir), "draft-model", out=tmp_path / "d", draft_layers=bad, progress=False)


def test_draft_model_vocab_file_round_trip_and_bad_file(target, tmp_path):
    import json

    from specrl.drafters import make_drafter
    from specrl.drafters.kinds.draft_model import DRAFT_VOCAB_FILE
    from specrl.model.hf_checkpoint import save_hf_checkpoint

    d = save_hf_checkpoint(tiny_model("llama", vocab_size=32, seed=7, num_layers=1), tmp_path / "draft")
    assert make_drafter(f"draft-model:{d}", target, dtype=torch.float32).d2t is None
    (d / DRAFT_VOCAB_FILE).write_text(json.dumps([3, 1, 4]))
    assert make_drafter(f"draft-model:{d}", target, dtype=torch.float32).d2t.tolist() == [3, 1, 4]
    for bad, msg in (("[3, 1, 3]", "repeated token ids"), ("[1, 40]", r"outside the target vocabulary \[0, 32\)"),
                     ("[]", "is empty"), ('{"a": 1}', "expected a JSON list of integer token ids"),
                     ("[1,", "not valid JSON")):
        (d / DRAFT_VOCAB_FILE).write_text(bad)
        with pytest.raises(SpecRLError, match=msg):
            make_drafter(f"draft-model:{d}", target, dtype=torch.float32)


def test_build_takes_prompts_as_token_ids_strings_or_a_callable():
    """`train_drafter_offline`'s prompt forms: token-id lists and strings are split into train / held-out the same way;
    a callable tokenizer -> (train, held-out) decides the split itself (how task prompts arrive from rl)."""
    from specrl.drafters.training.build.from_rollouts import split_prompts

    ids = [[i, i + 1] for i in range(30)]
    train, held = split_prompts(ids, None, samples=5, heldout=32)
    assert held == ids[:3] and train == ids[3:8]  # at most a tenth held out, then up to `samples` train
    tok = lambda text, add_special_tokens=False: {"input_ids": [len(text)]}  # noqa: E731 - no chat template
    assert split_prompts(["ab", "abc", "abcd"], tok, samples=9) == ([[3], [4]], [[2]])
    assert split_prompts(lambda t: ([[1], [2], [3]], [[4]]), None, samples=2) == ([[1], [2]], [[4]])
    for bad, msg in (("chain_sum", "task_prompts"), ([[1, 2]], "at least 2"),
                     (lambda t: [[1]], r"must return \(train_prompt_ids, heldout_prompt_ids\)"),
                     (lambda t: ([[1]], []), "no train or no held-out prompts")):
        with pytest.raises(SpecRLError, match=msg):
            split_prompts(bad, None, samples=4)

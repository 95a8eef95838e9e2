"""The parallel drafter's own contract: one layer forward per verify step drafts all k tokens with their q, k above
its max_k and malformed directories are refused by name, and the TV-distance objective's value on a hand example.
(Losslessness and drafts equal to a from-scratch recomputation: tests/test_drafter_eagle_mtp.py, over every kind.)"""

import json

import pytest
import torch

from specrl import RolloutEngine, SamplingParams
from specrl.drafters.kinds.parallel import ParallelDrafter
from specrl.drafters.storage.io import load_drafter, save_drafter
from specrl.drafters.trainable import Objective, soft_cross_entropy, tv_distance
from specrl.errors import SpecRLError
from specrl.model.transformer import tiny_model
from tests.test_drafter_eagle_mtp import PROMPTS, randomise


@pytest.fixture(scope="module")
def target():
    return tiny_model("llama", vocab_size=64, seed=1)


def test_one_layer_forward_per_verify_step_drafts_all_k_tokens_with_their_probabilities(target):
    d = randomise(ParallelDrafter(target, max_k=5)).eval()
    assert d.placeholders.shape == (4, 2 * target.args.hidden_size) and d.config()["max_k"] == 5
    forwards, proposals = [], []
    block_forward, propose = d.block.forward, d.propose
    d.block.forward = lambda *a, **kw: forwards.append(a[0].shape) or block_forward(*a, **kw)

    def spy(batch, k):
        before = len(forwards)
        prop = propose(batch, k)
        proposals.append((batch.size, k, len(forwards) - before, prop))
        return prop

    d.propose = spy
    eng = RolloutEngine(target, max_batch_size=3, max_seq_len=64, drafter=d, num_draft_tokens=4)
    eng.generate(PROMPTS, SamplingParams(temperature=0.8, max_new_tokens=12, seed=4))
    assert len(proposals) > 5
    for n, k, layer_forwards, prop in proposals:
        assert layer_forwards == 1  # the catch-up of pending entries writes keys/values only
        assert prop.tokens.shape == (n, k) and prop.probs.shape == (n, k, target.args.vocab_size)
        assert torch.allclose(prop.probs.sum(-1), torch.ones(n, k), atol=1e-5)
        picked = prop.probs.gather(-1, prop.tokens[..., None])
        assert bool((picked > 0).all())  # every draft was drawn from its own q
    assert {shape[1] for shape in forwards} == {4}  # [entry n-2, placeholders 1..3] in one forward


def test_training_forward_shapes_and_anchors(target):
    d = randomise(ParallelDrafter(target, max_k=3))
    tok = torch.randint(0, 64, (2, 9))
    fused = torch.randn(2, 9, target.args.hidden_size)
    full = d.forward_parallel(fused, tok)
    assert [tuple(o.shape) for o in full] == [(2, 9, target.args.hidden_size)] * 3
    late = d.forward_parallel(fused, tok, start=4)  # anchors 4..8 only: the same outputs there
    for a, b in zip(full, late, strict=True):
        assert torch.allclose(a[:, 4:], b, atol=1e-5)
    with pytest.raises(SpecRLError, match=r"depths=4\b.*1\.\.3 tokens"):
        d.forward_parallel(fused, tok, depths=4)


def test_k_above_max_k_and_a_bad_max_k_are_refused_naming_the_maximum(target):
    d = randomise(ParallelDrafter(target, max_k=3)).eval()
    eng = RolloutEngine(target, max_batch_size=2, max_seq_len=64, drafter=d, num_draft_tokens=4)
    with pytest.raises(SpecRLError, match=r"k=4\b.*most 3 tokens"):
        eng.generate(PROMPTS[:2], SamplingParams(temperature=1.0, max_new_tokens=6, seed=1))
    for bad in (0, 2.5, True):
        with pytest.raises(SpecRLError, match=r"max_k.*integer >= 1"):
            ParallelDrafter(target, max_k=bad)


def test_a_directory_whose_placeholders_disagree_with_its_max_k_is_refused(target, tmp_path):
    d = randomise(ParallelDrafter(target, max_k=4))
    save_drafter(d, tmp_path / "p")
    cfg = json.loads((tmp_path / "p" / "config.json").read_text())
    assert cfg["kind"] == "parallel" and cfg["max_k"] == 4
    back = load_drafter(tmp_path / "p", target, expected_kind="parallel")
    assert back.max_k == 4 and torch.equal(back.placeholders, d.placeholders)
    (tmp_path / "p" / "config.json").write_text(json.dumps({**cfg, "max_k": 6}))
    with pytest.raises(SpecRLError, match=r"max_k 6\b.*\[3, 64\]"):
        load_drafter(tmp_path / "p", target)
    (tmp_path / "p" / "config.json").write_text(json.dumps({**cfg, "max_k": 0}))
    with pytest.raises(SpecRLError, match=r"config\.json: max_k.*>= 1"):
        load_drafter(tmp_path / "p", target)
    (tmp_path / "p" / "config.json").write_text(json.dumps({k: v for k, v in cfg.items() if k != "max_k"}))
    with pytest.raises(SpecRLError, match="lacks the field 'max_k'"):
        load_drafter(tmp_path / "p", target)


def test_tv_distance_on_a_hand_example_is_one_minus_the_acceptance_probability():
    # draft vocabulary of 4 tokens, q = (.5, .25, .125, .125); the target's top-3 puts .4, .4 on draft tokens 0 and 1
    # and .2 on a token outside the draft vocabulary (index -1)
    logits = torch.tensor([[0.5, 0.25, 0.125, 0.125]]).log()
    idx = torch.tensor([[0, 1, -1]])
    p = torch.tensor([[0.4, 0.4, 0.2]])
    # sum |p - q| = .1 + .15 + .125 + .125 (q off the top-K) + .2 (p outside the vocabulary) = .7
    assert torch.allclose(tv_distance(logits, idx, p), torch.tensor([0.35]))
    accept = torch.minimum(torch.tensor([0.4, 0.4, 0, 0, 0]), torch.tensor([0.5, 0.25, 0.125, 0.125, 0])).sum()
    assert torch.allclose(1 - tv_distance(logits, idx, p), accept)  # P(accept) under rejection sampling
    assert torch.allclose(tv_distance(logits, idx, p / 2), torch.tensor([0.35]))  # the top-K is renormalised
    same = torch.tensor([[0.5, 0.25, 0.125, 0.125]])
    assert float(tv_distance(logits, torch.tensor([[0, 1, 2, 3]]), same)) == pytest.approx(0.0, abs=1e-6)
    both = Objective("ce+tv", 0.5)(logits, idx, p)
    assert torch.allclose(both, soft_cross_entropy(logits, idx, p) + 0.5 * 0.35)
    assert torch.equal(Objective()(logits, idx, p), soft_cross_entropy(logits, idx, p))
    assert Objective("ce+tv", 0.5).record() == {"loss": "ce+tv", "tv_weight": 0.5}


@pytest.mark.parametrize("loss, weight, message", [("kl", 1.0, "must be one of ce, ce\\+tv, got 'kl'"),
                                                   ("ce+tv", 0, "tv_weight must be a finite number > 0"),
                                                   ("ce+tv", float("nan"), "tv_weight must be a finite number > 0")])
def test_a_bad_objective_is_refused(loss, weight, message):
    with pytest.raises(SpecRLError, match=message):
        Objective(loss, weight)


def test_a_markov_head_trains_each_draft_on_the_sequence_token_before_it(target):
    # training must feed draft i+1 the token the engine feeds it (draft i, i.e. x_{t+1+i} at anchor t), and a
    # fresh mix (W_down = 0) must leave the plain head's states unchanged
    torch.manual_seed(0)
    h = target.args.hidden_size
    d = randomise(ParallelDrafter(target, max_k=3, markov=True))
    assert d.config()["markov"] is True
    assert ParallelDrafter(target, max_k=3, markov=True).markov.down.weight.abs().max() == 0
    tok = torch.randint(0, 64, (2, 10))
    batch = {"tokens": tok, "feats": torch.randn(2, 10, 3 * h), "len": torch.tensor([10, 8]),
             "loss_from": torch.tensor([3, 4]), "top_idx": torch.randint(0, 64, (2, 10, 4)),
             "top_p": torch.softmax(torch.randn(2, 10, 4), -1), "top1": torch.randint(0, 64, (2, 10))}
    seen, head = [], d.head
    d.head = lambda x: seen.append(x.detach()) or head(x)
    d.training_loss(batch, ttt_steps=1)
    outs = d.forward_parallel(d.fuse_concat(batch["feats"]), tok, start=1)  # start = min(loss_from) - 2
    pos = torch.arange(1, 10)[None, :]
    for i, got in enumerate(seen):
        valid = (pos <= batch["len"][:, None] - 2 - i) & (pos + 2 >= batch["loss_from"][:, None])
        want = outs[i][valid]
        if i > 0:
            prev = torch.stack([tok[b, 1 + t + 1 + i] for b, t in valid.nonzero().tolist()])
            want = d.mix(want, prev)
        assert torch.allclose(got, want, atol=1e-5), i
    assert len(seen) == 3


def test_a_bad_markov_setting_is_refused(target, tmp_path):
    with pytest.raises(SpecRLError, match=r"markov.*true or false"):
        ParallelDrafter(target, max_k=3, markov="yes")
    d = randomise(ParallelDrafter(target, max_k=3, markov=True))
    save_drafter(d, tmp_path / "m")
    back = load_drafter(tmp_path / "m", target, expected_kind="parallel")
    assert back.markov is not None and torch.equal(back.markov.down.weight, d.markov.down.weight)
    cfg = json.loads((tmp_path / "m" / "config.json").read_text())
    (tmp_path / "m" / "config.json").write_text(json.dumps({**cfg, "markov": 1}))
    with pytest.raises(SpecRLError, match=r"json: markov.*1$"):
        load_drafter(tmp_path / "m", target)
    (tmp_path / "m" / "config.json").write_text(json.dumps({**cfg, "markov": False}))  # weights it does not expect
    with pytest.raises(SpecRLError, match=r"markov\.down\.weight"):
        load_drafter(tmp_path / "m", target)

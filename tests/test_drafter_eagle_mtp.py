"""EAGLE-3, parallel and MTP drafters: lossless output, drafts equal a from-scratch recomputation, save/load, errors."""

import itertools
import json

import pytest
import torch
from safetensors.torch import load_file, save_file

from specrl import RolloutEngine, SamplingParams
from specrl.drafters.kinds.eagle import EagleDrafter
from specrl.drafters.kinds.mtp import MTPDrafter
from specrl.drafters.kinds.parallel import ParallelDrafter
from specrl.drafters.storage.io import load_drafter, save_drafter
from specrl.errors import SpecRLError
from specrl.model.hf_checkpoint import save_hf_checkpoint
from specrl.model.transformer import tiny_model
from tests.stats import SETTINGS, V, speculative_pvalue

PROMPTS = [[1, 2, 3], [4, 5, 6, 7, 8], [9], [10, 11, 12, 13], [3, 3, 3, 3, 3, 3, 3], [60, 61]]
KINDS = ["eagle", "eagle-reduced", "mtp", "parallel", "parallel-reduced", "parallel-markov"]


@pytest.fixture(scope="module")
def target():
    return tiny_model("llama", vocab_size=64, seed=1)


def randomise(drafter, seed=5, scale=0.3):
    torch.manual_seed(seed)
    with torch.no_grad():
        for name, p in drafter.named_parameters():
            p.normal_(1.0 if "norm" in name else 0.0, 0.2 if "norm" in name else scale)
    return drafter


def make(kind, target, seed=5):
    if kind == "eagle":
        d = EagleDrafter(target)
    elif kind == "eagle-reduced":
        d = EagleDrafter(target, draft_vocab=list(range(0, target.args.vocab_size, 2))[::-1])
    elif kind == "parallel":
        d = ParallelDrafter(target, max_k=4)
    elif kind == "parallel-reduced":
        d = ParallelDrafter(target, draft_vocab=list(range(0, target.args.vocab_size, 3))[::-1], max_k=3)
    elif kind == "parallel-markov":
        d = ParallelDrafter(target, draft_vocab=list(range(0, target.args.vocab_size, 2)), max_k=4, markov=True)
    else:
        d = MTPDrafter(target, num_modules=3)
    return randomise(d, seed).eval()


def scripted_k(engine, ks):
    """Make the engine's controller return this cycle of draft lengths (0 = an autoregressive step)."""
    it = itertools.cycle(ks)
    engine.controller.choose = lambda *a, **kw: next(it)


@pytest.mark.parametrize("kind", KINDS)
def test_greedy_equals_autoregressive(target, kind):
    sp = SamplingParams(temperature=0, max_new_tokens=20, stop_token_ids=(17,))
    ar = RolloutEngine(target, max_batch_size=8, max_seq_len=64).generate(PROMPTS, sp)
    eng = RolloutEngine(target, max_batch_size=2, max_seq_len=64, drafter=make(kind, target), num_draft_tokens=3)
    spec = eng.generate(PROMPTS, sp)
    assert [o.token_ids for o in spec] == [o.token_ids for o in ar]
    assert spec.metrics["verify_steps"] > 0


@pytest.mark.parametrize("kind", KINDS)
def test_seed_exact_equals_autoregressive(target, kind):
    sp = SamplingParams(temperature=1.0, top_p=0.95, max_new_tokens=20, seed=11)
    ar = RolloutEngine(target, max_batch_size=8, max_seq_len=64).generate(PROMPTS, sp)
    eng = RolloutEngine(target, max_batch_size=3, max_seq_len=64, drafter=make(kind, target),
                        num_draft_tokens=3, verify="seed_exact")
    scripted_k(eng, [3, 0, 2, 3, 0, 0, 1])  # mixes AR steps (the drafter catches up) with speculative ones
    spec = eng.generate(PROMPTS, sp)
    assert [o.token_ids for o in spec] == [o.token_ids for o in ar]


def reference_draft_logits(drafter, target, seq: list[int], drafts: list[int], k: int) -> list[torch.Tensor]:
    """Full-vocabulary logits of drafts 1..k recomputed from scratch over prompt + tokens + drafts."""
    n = len(seq)
    ext = torch.tensor([seq + drafts])
    with torch.no_grad():
        logits_t, captured = target(ext, capture=getattr(drafter, "fuse_layers", ()))
        if isinstance(drafter, ParallelDrafter):  # one forward: every draft from the context ending at entry n-2
            outs = drafter.forward_parallel(drafter.fuse(captured)[:, :n], ext[:, :n], depths=k)
            hidden = [outs[0][0, n - 2]] + [drafter.mix(outs[i][0, n - 2], ext[0, n - 1 + i]) for i in range(1, k)]
            return [drafter.full_logits(h) for h in hidden]
        if isinstance(drafter, EagleDrafter):
            steps = drafter.forward_train(drafter.fuse(captured), ext, steps=k)
            return [drafter.to_full_vocab(steps[s][0, n - 2 + s]) for s in range(k)]
        outs = drafter.forward_train(captured["final"], ext, num_modules=k)
        return [drafter.head(j, outs[j][0, n - 2]) for j in range(k)]


SCHEDULES = {"mixed": [3, 2, 0, 3, 0, 0, 1, 3],
             "long plain streaks": [0] * 11 + [3] + [0] * 4 + [2]}  # 11 > the EAGLE queue (k_max + 2 = 9)


@pytest.mark.parametrize("schedule", SCHEDULES)
@pytest.mark.parametrize("kind", KINDS)
def test_drafts_equal_from_scratch_recomputation(target, kind, schedule):
    """The incremental drafter state (KV cache, pending features, entries queued by AR steps and caught up
    later, a full queue, compaction) gives exactly the drafts a from-scratch forward over the sequence gives."""
    drafter = make(kind, target)
    eng = RolloutEngine(target, max_batch_size=3, max_seq_len=64, drafter=drafter, num_draft_tokens=3)
    scripted_k(eng, SCHEDULES[schedule])
    seen = []
    propose = drafter.propose

    def spy(batch, k):
        prop = propose(batch, k)
        seen.append(([list(t) for t in batch.tokens], prop.tokens.clone(), prop.probs.clone(), k))
        return prop

    drafter.propose = spy
    sp = SamplingParams(temperature=1.0, max_new_tokens=14 if schedule == "mixed" else 30, seed=3,
                        stop_token_ids=(5,))
    eng.generate(PROMPTS, sp)
    checked = 0
    for tokens, drafts, probs, k in seen:
        for b, seq in enumerate(tokens):
            ref = reference_draft_logits(drafter, target, seq, drafts[b].tolist(), k)
            for i in range(k):
                q = torch.softmax(ref[i], -1)
                assert torch.allclose(q, probs[b, i], atol=2e-5), (kind, b, i)
                checked += 1
    assert checked > (50 if schedule == "mixed" else 25)  # long streaks draft rarely


def test_reduced_vocab_probs_are_full_vocab_with_zeros(target):
    sub = list(range(0, 64, 2))
    d = make("eagle-reduced", target)
    eng = RolloutEngine(target, max_batch_size=4, max_seq_len=32, drafter=d, num_draft_tokens=2)
    got = []
    propose = d.propose
    d.propose = lambda b, k: got.append(propose(b, k)) or got[-1]
    eng.generate(PROMPTS[:4], SamplingParams(temperature=1.0, max_new_tokens=6, seed=1))
    p = got[0].probs
    assert p.shape[-1] == 64 and torch.allclose(p.sum(-1), torch.ones(p.shape[:2]))
    assert p[..., 1::2].abs().max() == 0 and all(int(t) % 2 == 0 for t in got[0].tokens.flatten())
    assert sorted(d.d2t.tolist()) == sub


@pytest.mark.parametrize("top_p, top_k", [(1.0, 0), (0.8, 0), (1.0, 5)])
def test_sampling_over_the_draft_vocabulary_draws_what_full_vocabulary_sampling_draws(target, top_p, top_k):
    # the draft vocabulary in descending id order (not the order the CDF runs in): the same uniforms give the same
    # tokens, and q scattered into the full vocabulary is the full-vocabulary distribution
    from specrl.rollout.drafter import DraftBatch

    d, n = make("eagle-reduced", target), 400
    hidden = torch.randn(n, target.args.hidden_size, generator=torch.Generator().manual_seed(0))
    batch = DraftBatch(tokens=[[1]] * n, positions=torch.arange(n) + 3, seeds=torch.arange(n),
                       request_ids=torch.arange(n), group_ids=[0] * n, temperature=torch.full((n,), 0.8),
                       top_p=torch.full((n,), top_p), top_k=torch.full((n,), top_k, dtype=torch.long))
    with torch.no_grad():
        tok, q = d._sample(batch, hidden, 1)
        ref_tok, ref_q = batch.sample(d.full_logits(hidden), 1)
    assert torch.equal(tok, ref_tok)
    assert torch.allclose(q, ref_q, atol=1e-6) and q[:, 1::2].abs().max() == 0
    assert len(set(tok.tolist())) > 5  # the rows drew many different tokens


@pytest.mark.parametrize("temperature, top_p, top_k", [(0.8, 1.0, 0), (1.0, 0.8, 0), (0.7, 1.0, 5), (0.0, 1.0, 0)])
def test_drawing_k_positions_at_once_draws_what_k_single_draws_draw(temperature, top_p, top_k):
    # the parallel head draws its k drafts in one call (a tensor of offsets), EAGLE writes q into one [n, k, V]
    # buffer: tokens and q must be bit-identical to k calls with one offset each
    from specrl.rollout.drafter import DraftBatch

    n, k, vocab = 6, 4, 97
    g = torch.Generator().manual_seed(3)
    ids = torch.randperm(vocab, generator=g)[:40].sort().values
    logits = torch.randn(n, k, 40, generator=g) * 3
    batch = DraftBatch(tokens=[[1]] * n, positions=torch.arange(n) * 7 + 3, seeds=torch.arange(n) + 11,
                       request_ids=torch.arange(n), group_ids=[0] * n, temperature=torch.full((n,), temperature),
                       top_p=torch.full((n,), top_p), top_k=torch.full((n,), top_k, dtype=torch.long))
    one = [batch.sample_subset(logits[:, i], ids, vocab, i) for i in range(k)]
    tok, q = batch.sample_subset(logits, ids, vocab, torch.arange(k))
    assert torch.equal(tok, torch.stack([t for t, _ in one], 1)) and torch.equal(q, torch.stack([p for _, p in one], 1))
    full = torch.randn(n, k, vocab, generator=g)
    one = [batch.sample(full[:, i], i) for i in range(k)]
    tok, q = batch.sample(full, torch.arange(k))
    assert torch.equal(tok, torch.stack([t for t, _ in one], 1)) and torch.equal(q, torch.stack([p for _, p in one], 1))
    buf = torch.zeros(n, k, vocab)
    for i in range(k):
        t, p = batch.sample_subset(logits[:, i], ids, vocab, i, out=buf[:, i])
        ref_t, ref_q = batch.sample_subset(logits[:, i], ids, vocab, i)
        assert p.data_ptr() == buf[:, i].data_ptr() and torch.equal(t, ref_t) and torch.equal(buf[:, i], ref_q)
    assert len(set(tok.flatten().tolist())) > 1 or temperature == 0.0


def test_drawing_with_logits_and_offsets_that_disagree_is_refused():
    from specrl.rollout.drafter import DraftBatch

    n = 3
    batch = DraftBatch(tokens=[[1]] * n, positions=torch.arange(n) + 3, seeds=torch.arange(n),
                       request_ids=torch.arange(n), group_ids=[0] * n, temperature=torch.full((n,), 0.7),
                       top_p=torch.ones(n), top_k=torch.zeros(n, dtype=torch.long))
    ids = torch.arange(0, 20, 2)
    with pytest.raises(ValueError, match=r"4, 10\].*offset 0") as e:
        batch.sample_subset(torch.randn(n, 4, 10), ids, 20, 0)  # j positions need j offsets
    assert "[n, j, V]" in str(e.value)
    with pytest.raises(ValueError, match=r"\[3, 10\].*tensor"):
        batch.sample_subset(torch.randn(n, 10), ids, 20, torch.arange(2))
    with pytest.raises(ValueError, match=r"\[3, 4, 20\].*tensor"):
        batch.sample(torch.randn(n, 4, 20), torch.arange(3))  # 3 offsets for 4 positions


# ---------------------------------------------------------------- exact distribution
@pytest.fixture(scope="module")
def small_target():
    return tiny_model("llama", vocab_size=V, seed=5, num_layers=2)


@pytest.mark.parametrize("setting", list(SETTINGS))
@pytest.mark.parametrize("mode", ["rejection", "seed_exact"])
@pytest.mark.parametrize("kind", ["eagle", "mtp", "parallel", "parallel-markov"])
def test_exact_distribution(small_target, kind, mode, setting):
    if kind == "eagle":  # a 2-layer target: the default (1, L//2-1, L-4) does not exist, pick valid layers
        d = randomise(EagleDrafter(small_target, layers=(0, 1, 1), draft_vocab=[0, 2, 3, 5, 6, 7]), seed=7)
    elif kind.startswith("parallel"):
        d = randomise(ParallelDrafter(small_target, layers=(0, 1, 1), draft_vocab=[0, 2, 3, 5, 6], max_k=2,
                                      markov=kind == "parallel-markov"), seed=7)
    else:
        d = randomise(MTPDrafter(small_target, num_modules=2), seed=7)
    sp = SamplingParams(max_new_tokens=3, seed=99, **SETTINGS[setting])
    engine = RolloutEngine(small_target, max_batch_size=2000, max_seq_len=16, drafter=d.eval(), num_draft_tokens=2,
                           verify=mode)
    assert speculative_pvalue(engine, small_target, sp) > 1e-3


# ---------------------------------------------------------------- construction errors
def test_layer_index_out_of_range_is_an_error(target):
    with pytest.raises(SpecRLError, match=r"index 4 .*\b4 layers"):
        EagleDrafter(target, layers=(0, 1, 4))
    two = tiny_model("llama", vocab_size=64, num_layers=2)
    with pytest.raises(SpecRLError, match=r"range.*\b2 layers.*default"):
        EagleDrafter(two)


def test_mtp_k_above_module_count_is_an_error(target):
    eng = RolloutEngine(target, max_batch_size=2, max_seq_len=32, drafter=MTPDrafter(target, num_modules=2),
                        num_draft_tokens=3)
    with pytest.raises(SpecRLError, match=r"\b2 modules.*k=3"):
        eng.generate([[1, 2]], SamplingParams(max_new_tokens=5))


def test_binding_to_another_target_is_an_error(target):
    other = tiny_model("llama", vocab_size=64, hidden_size=48, num_heads=6, num_kv_heads=2)
    with pytest.raises(SpecRLError, match=r"hidden size 32\b.*\b48\b"):
        RolloutEngine(other, max_batch_size=2, max_seq_len=32, drafter=EagleDrafter(target))


# ---------------------------------------------------------------- save / load
@pytest.mark.parametrize("kind", KINDS)
def test_save_load_round_trip(target, kind, tmp_path):
    d = make(kind, target)
    save_drafter(d, tmp_path / "d")
    cfg = json.loads((tmp_path / "d" / "config.json").read_text())
    assert cfg["kind"] == kind.split("-")[0] and cfg["hidden_size"] == 32 and cfg["vocab_size"] == 64
    loaded = load_drafter(tmp_path / "d", target, expected_kind=cfg["kind"])
    assert type(loaded) is type(d)
    for (n1, a), (n2, b) in zip(d.state_dict().items(), loaded.state_dict().items(), strict=True):
        assert n1 == n2 and torch.equal(a, b)
    sp = SamplingParams(temperature=1.0, max_new_tokens=12, seed=2)
    out = [RolloutEngine(target, max_batch_size=4, max_seq_len=64, drafter=x, num_draft_tokens=3).generate(PROMPTS, sp)
           for x in (d, loaded)]
    assert [o.token_ids for o in out[0]] == [o.token_ids for o in out[1]]


@pytest.fixture
def eagle_dir(target, tmp_path):
    return save_drafter(make("eagle", target), tmp_path / "eagle")


def test_load_for_other_hidden_size_names_both(eagle_dir):
    other = tiny_model("llama", vocab_size=64, hidden_size=48, num_heads=6, num_kv_heads=2)
    with pytest.raises(SpecRLError, match=r"hidden size 32\b.*\b48\b"):
        load_drafter(eagle_dir, other)


def test_load_for_other_vocab_names_both(eagle_dir):
    with pytest.raises(SpecRLError, match=r"vocabulary size 64\b.*\b96\b"):
        load_drafter(eagle_dir, tiny_model("llama", vocab_size=96))


def test_load_with_layers_out_of_range(tmp_path):
    deep = tiny_model("llama", vocab_size=64, num_layers=8)
    path = save_drafter(EagleDrafter(deep), tmp_path / "deep")  # layers (1, 3, 4)
    with pytest.raises(SpecRLError, match=r"3, 4\] .*\b4 layers"):
        load_drafter(path, tiny_model("llama", vocab_size=64, num_layers=4))


def test_load_wrong_kind(target, tmp_path):
    path = save_drafter(make("mtp", target), tmp_path / "mtp")
    with pytest.raises(SpecRLError, match=r"'mtp' drafter.*'eagle'"):
        load_drafter(path, target, expected_kind="eagle")


def test_load_hf_checkpoint_is_not_a_drafter(target, tmp_path):
    save_hf_checkpoint(target, tmp_path / "hf")
    with pytest.raises(SpecRLError, match=r"HF model checkpoint.*drafter"):
        load_drafter(tmp_path / "hf", target, expected_kind="eagle")


def test_load_missing_path(target, tmp_path):
    with pytest.raises(SpecRLError, match=r"drafter directory .*nope.*exist"):
        load_drafter(tmp_path / "nope", target)


def test_load_shape_disagreeing_with_config(target, eagle_dir):
    cfg = json.loads((eagle_dir / "config.json").read_text())
    cfg["intermediate_size"] = 48
    (eagle_dir / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(SpecRLError, match=r"gate_proj.*\(64, 32\).*\(48, "):
        load_drafter(eagle_dir, target)


def test_load_tensor_names_disagreeing_with_config(target, eagle_dir):
    state = load_file(str(eagle_dir / "model.safetensors"))
    state["extra.weight"] = state.pop("fc.weight")
    save_file(state, str(eagle_dir / "model.safetensors"))
    with pytest.raises(SpecRLError, match=r"missing.*'fc\.weight'.*'extra"):
        load_drafter(eagle_dir, target)

"""The proof suite: speculative decoding is lossless for every drafter, mode and sampling setting.

Exact distribution: a tiny target (vocab 8) and deliberately different drafters; every continuation of
length 3 gets its exact probability from plain forwards, and >= 20,000 speculative samples must pass a
chi-square test at p = 0.001, with acceptance < 1 so the rejection path is exercised. Plus identities:
greedy == AR greedy, seed_exact == AR token for token, logprobs == a full forward, batch invariance.
"""

import itertools

import pytest
import torch

from specrl import RolloutEngine, SamplingParams
from specrl.drafters import DraftModelDrafter, NGramDrafter, SuffixDrafter
from specrl.model.transformer import tiny_model
from specrl.rollout.sampling import probs_from_logits
from tests.stats import gof_pvalue

V = 8
PROMPT = [1, 2, 1]
N_SAMPLES = 20000
SETTINGS = {
    "T0.7": dict(temperature=0.7),
    "T1.0": dict(temperature=1.0),
    "T1.5": dict(temperature=1.5),
    "top_p": dict(temperature=1.0, top_p=0.8),
    "top_k": dict(temperature=1.2, top_k=3),
}


@pytest.fixture(scope="module")
def target():
    return tiny_model("llama", vocab_size=V, seed=5, num_layers=2)


def make_drafter(kind):
    if kind == "ngram":
        return NGramDrafter()
    if kind == "suffix":
        return SuffixDrafter()
    return DraftModelDrafter(tiny_model("llama", vocab_size=V, seed=99, num_layers=1))


def exact_distribution(target, sp: SamplingParams, length: int) -> dict:
    """P(continuation) for every continuation of `length` tokens, from plain full forwards (batched)."""
    conts = list(itertools.product(range(V), repeat=length))
    seqs = torch.tensor([PROMPT + list(c) for c in conts])
    with torch.no_grad():
        logits, _ = target(seqs)
    rows = logits[:, len(PROMPT) - 1: -1]  # [N, length, V]
    shape = rows.shape[:2]
    p = probs_from_logits(rows, torch.full(shape, float(sp.temperature)), torch.full(shape, float(sp.top_p)),
                          torch.full(shape, sp.top_k, dtype=torch.long))
    chosen = p.gather(-1, seqs[:, len(PROMPT):, None]).squeeze(-1).double()
    return dict(zip(conts, chosen.prod(-1).tolist(), strict=True))


@pytest.mark.parametrize("setting", list(SETTINGS))
@pytest.mark.parametrize("mode", ["rejection", "seed_exact"])
@pytest.mark.parametrize("kind", ["ngram", "suffix", "draft-model"])
def test_exact_distribution(target, kind, mode, setting):
    sp = SamplingParams(max_new_tokens=3, seed=1234, **SETTINGS[setting])
    exact = exact_distribution(target, sp, 3)
    k = 2 if kind != "suffix" else 1  # k=1 makes the bonus token part of the tested continuation
    engine = RolloutEngine(target, max_batch_size=2000, max_seq_len=16, drafter=make_drafter(kind),
                           num_draft_tokens=k, verify=mode)
    outs = engine.generate([PROMPT] * N_SAMPLES, sp)
    m = engine.last_metrics
    assert 0 < m["acceptance_rate"] < 1, m  # both the accept and the reject paths ran
    keys = list(exact)
    index = {c: i for i, c in enumerate(keys)}
    counts = [0] * len(keys)
    for o in outs:
        counts[index[tuple(o.token_ids)]] += 1
    assert gof_pvalue(counts, [exact[c] for c in keys]) > 1e-3

"""The autoregressive rollout engine: continuous batching, seeding, logprobs, stopping, bad input."""

import pytest
import torch

from specrl import RolloutEngine, SamplingParams
from specrl.errors import SpecRLError
from specrl.model.transformer import tiny_model
from specrl.rollout.generation_metrics import phase_rates
from specrl.rollout.protocol import RolloutRequest


@pytest.fixture(scope="module")
def model():
    return tiny_model("llama", vocab_size=64, seed=1)


PROMPTS = [[1, 2, 3], [4, 5, 6, 7, 8], [9], [10, 11, 12, 13], [3, 3, 3, 3, 3, 3, 3], [60, 61]]


def test_batch_invariance_and_continuous_batching(model):
    sp = SamplingParams(temperature=1.0, max_new_tokens=20, seed=7)
    big = RolloutEngine(model, max_batch_size=8, max_seq_len=64).generate(PROMPTS, sp)
    # 2 slots: sequences wait, refill freed slots, get compacted
    small = RolloutEngine(model, max_batch_size=2, max_seq_len=64).generate(PROMPTS, sp)
    assert [o.token_ids for o in big] == [o.token_ids for o in small]
    # a sequence alone gives the same tokens as inside the batch (request id fixed)
    alone = RolloutEngine(model, max_batch_size=1, max_seq_len=64).generate([RolloutRequest(PROMPTS[3], 3)], sp)
    assert alone[0].token_ids == big[3].token_ids


def test_batch_trace_shows_the_batch_draining(model):
    sp = SamplingParams(temperature=1.0, max_new_tokens=20, seed=7)
    res = RolloutEngine(model, max_batch_size=8, max_seq_len=64).generate(PROMPTS, sp)
    trace = res.metrics["batch_trace"]
    assert len(trace) == res.metrics["ar_steps"] and all(k == 0 and e == n and v == 0 for _, n, k, e, v in trace)
    active = [n for _, n, *_ in trace]
    assert active[0] == len(PROMPTS) and active == sorted(active, reverse=True)  # never grows: one wave
    assert sum(active) + len(PROMPTS) == res.metrics["generated_tokens"]  # + the token each prefill samples
    times = [t for t, *_ in trace]
    assert times == sorted(times) and times[-1] <= res.metrics["total_seconds"]
    rates = phase_rates(trace)
    assert sum(tok for tok, _ in rates.values()) == sum(active) and max(rates) == len(PROMPTS)
    assert abs(sum(sec for _, sec in rates.values()) - times[-1]) < 1e-6


def test_different_seeds_and_requests_differ(model):
    e = RolloutEngine(model, max_batch_size=4, max_seq_len=64)
    a = e.generate([[1, 2, 3]] * 2, SamplingParams(max_new_tokens=30, seed=0))
    b = e.generate([[1, 2, 3]], SamplingParams(max_new_tokens=30, seed=1))
    assert a[0].token_ids != a[1].token_ids  # same prompt, different request id
    assert a[0].token_ids != b[0].token_ids  # different seed


def test_logprobs_equal_full_forward(model):
    e = RolloutEngine(model, max_batch_size=4, max_seq_len=64)
    for temp in (0.7, 1.0, 0):
        outs = e.generate(PROMPTS[:3], SamplingParams(temperature=temp, max_new_tokens=15, seed=3))
        for p, o in zip(PROMPTS[:3], outs, strict=True):
            seq = torch.tensor([p + o.token_ids])
            with torch.no_grad():
                logits, _ = model(seq)
            t = temp if temp > 0 else 1.0
            lp = torch.log_softmax(logits[0, len(p) - 1:-1] / t, -1)
            ref = lp.gather(-1, torch.tensor(o.token_ids)[:, None]).squeeze(-1)
            assert torch.allclose(ref, torch.tensor(o.logprobs), atol=1e-5)


def test_stop_tokens_and_finish_reason(model):
    e = RolloutEngine(model, max_batch_size=4, max_seq_len=64)
    free = e.generate([[1, 2, 3]], SamplingParams(temperature=0, max_new_tokens=12))[0]
    assert free.finish_reason == "length" and len(free.token_ids) == 12
    stop = free.token_ids[4]
    out = e.generate([[1, 2, 3]], SamplingParams(temperature=0, max_new_tokens=12, stop_token_ids=(stop,)))[0]
    first = free.token_ids.index(stop)
    assert out.finish_reason == "stop" and out.token_ids == free.token_ids[: first + 1]


def test_per_prompt_params_and_topk_greedy_equivalence(model):
    e = RolloutEngine(model, max_batch_size=4, max_seq_len=64)
    outs = e.generate(PROMPTS[:2], [SamplingParams(temperature=0, max_new_tokens=5),
                                    SamplingParams(temperature=1.0, top_k=1, max_new_tokens=9)])
    greedy = e.generate([PROMPTS[1]], SamplingParams(temperature=0, max_new_tokens=9))[0]
    assert len(outs[0].token_ids) == 5
    assert outs[1].token_ids == greedy.token_ids  # top_k=1 is greedy


def test_top_p_restricts_support():
    from specrl.rollout.sampling import probs_from_logits

    logits = torch.log(torch.tensor([[0.5, 0.3, 0.15, 0.05]]))
    p = probs_from_logits(logits, torch.tensor([1.0]), torch.tensor([0.7]), torch.tensor([0]))
    assert torch.allclose(p, torch.tensor([[0.625, 0.375, 0.0, 0.0]]), atol=1e-6)
    p = probs_from_logits(logits, torch.tensor([1.0]), torch.tensor([1.0]), torch.tensor([3]))
    assert p[0, 3] == 0 and abs(p[0, :3].sum() - 1) < 1e-6


def test_sampling_matches_distribution(model):
    """AR samples of the first token follow softmax(logits/T)."""
    from tests.stats import gof_pvalue

    e = RolloutEngine(model, max_batch_size=64, max_seq_len=16)
    n = 3000
    outs = e.generate([[7, 8]] * n, SamplingParams(temperature=1.3, max_new_tokens=1, seed=11))
    counts = torch.bincount(torch.tensor([o.token_ids[0] for o in outs]), minlength=64).double()
    with torch.no_grad():
        p = torch.softmax(model(torch.tensor([[7, 8]]))[0][0, -1] / 1.3, -1).double()
    assert gof_pvalue(counts.numpy(), p.numpy()) > 1e-3


# ---------------------------------------------------------------- bad input
@pytest.mark.parametrize("kwargs,match", [
    (dict(temperature=-0.1), "temperature must be >= 0"),
    (dict(top_p=0.0), r"top_p must be in \(0, 1\]"),
    (dict(top_p=1.5), r"top_p must be in \(0, 1\]"),
    (dict(top_k=-1), "top_k must be an integer >= 0"),
    (dict(max_new_tokens=0), "max_new_tokens must be an integer >= 1"),
])
def test_bad_sampling_params(kwargs, match):
    with pytest.raises(SpecRLError, match=match):
        SamplingParams(**kwargs)


def test_bad_engine_and_prompt_input(model):
    with pytest.raises(SpecRLError, match=r"max_batch_size.*>= 1, got 0"):
        RolloutEngine(model, max_batch_size=0)
    e = RolloutEngine(model, max_batch_size=2, max_seq_len=32)
    with pytest.raises(SpecRLError, match="prompt 1 is empty"):
        e.generate([[1], []], SamplingParams(max_new_tokens=4))
    with pytest.raises(SpecRLError, match=r"\b30 tokens.*max_seq_len.*<= 22"):
        e.generate([[1] * 30], SamplingParams(max_new_tokens=10))
    with pytest.raises(SpecRLError, match="outside"):
        e.generate([[1, 99]], SamplingParams(max_new_tokens=4))
    with pytest.raises(SpecRLError, match=r"SamplingParams.*list of 2"):
        e.generate([[1], [2]], [SamplingParams()])
    with pytest.raises(SpecRLError, match="non-empty list"):
        e.generate([], SamplingParams())

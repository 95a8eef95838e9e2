"""The verifier's input checks are one function for both modes: draft ids outside the vocabulary are refused in
rejection (with and without q), seed_exact and the greedy fast path; id tensors of any integer dtype are taken as
int64 with identical results; float and bool ids are refused; padding may hold any id. The engine runs the same
checks before its verify forward, so a drafter's bad id is a clear error there too, not an embedding IndexError."""

from __future__ import annotations

import re

import pytest
import torch

from specrl import RolloutEngine, SamplingParams
from specrl.drafters.base import Drafter, Proposal
from specrl.errors import SpecRLError
from specrl.model.transformer import tiny_model
from specrl.rollout.spec_decode.verify import verify
from tests.test_verify_power import V, make_rows

K = 3
CASES = ["rejection-q", "rejection-onehot", "seed_exact", "greedy"]


def _call(case: str, x: torch.Tensor, nd: torch.Tensor | None = None, rows=None):
    r = rows or make_rows(8, K, onehot=case != "rejection-q", seed=11)
    mode = "seed_exact" if case == "seed_exact" else "rejection"
    if case == "greedy":
        return verify(mode, None, x, None, r.u_sample, r.u_accept, r.u_residual, nd, r.p.argmax(-1), vocab_size=V)
    return verify(mode, r.p, x, r.q, r.u_sample, r.u_accept, r.u_residual, nd)


@pytest.mark.parametrize("case", CASES)
@pytest.mark.parametrize("bad", [-1, V, V + 1000])
def test_draft_ids_outside_the_vocabulary_are_refused_in_every_mode(case, bad):
    r = make_rows(8, K, onehot=case != "rejection-q", seed=11)
    x = r.x.clone()
    x[5, 1] = bad
    with pytest.raises(SpecRLError, match=rf"row 5 .*id {bad}\b.*0\.\.{V - 1}") as e:
        _call(case, x, rows=r)
    assert "position 1" in str(e.value)


@pytest.mark.parametrize("case", CASES)
@pytest.mark.parametrize("dtype", [torch.int32, torch.int16, torch.uint8, torch.int8])
def test_any_integer_dtype_gives_the_int64_result(case, dtype):
    assert V <= 127  # every id fits each dtype
    r = make_rows(8, K, onehot=case != "rejection-q", seed=11)
    want = _call(case, r.x, rows=r)
    got = _call(case, r.x.to(dtype), torch.full((8,), K, dtype=dtype), rows=r)
    assert torch.equal(got.tokens, want.tokens) and torch.equal(got.num_accepted, want.num_accepted)
    assert got.tokens.dtype == torch.long


@pytest.mark.parametrize("case", CASES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.bool])
def test_float_or_bool_ids_are_refused(case, dtype):
    r = make_rows(8, K, onehot=case != "rejection-q", seed=11)
    with pytest.raises(SpecRLError, match=rf"draft_tokens.*integer.*got dtype {dtype}"):
        _call(case, r.x.to(dtype), rows=r)
    with pytest.raises(SpecRLError, match=rf"num_drafts.*integer.*got dtype {dtype}"):
        _call(case, r.x, torch.full((8,), 1).to(dtype), rows=r)


@pytest.mark.parametrize("case", CASES)
def test_padding_may_hold_any_id(case):
    r = make_rows(8, K, onehot=case != "rejection-q", seed=11)
    nd = torch.tensor([0, 1, 2, 3, 0, 1, 2, 3])
    x = r.x.clone()
    pad = torch.arange(K)[None, :] >= nd[:, None]
    clean = _call(case, x.masked_fill(pad, 0), nd, rows=r)
    for fill in (-1, V, 10**9):
        got = _call(case, x.masked_fill(pad, fill), nd, rows=r)
        assert torch.equal(got.num_accepted, clean.num_accepted)
        for b in range(8):
            e = int(clean.num_emitted[b])
            assert got.tokens[b, :e].tolist() == clean.tokens[b, :e].tolist()


def test_greedy_path_without_v_still_refuses_negative_ids_and_a_wrong_vocab_size():
    r = make_rows(8, K, onehot=True, seed=11)
    x = r.x.clone()
    x[2, 0] = -3
    args = (r.u_sample, r.u_accept, r.u_residual, None, r.p.argmax(-1))
    with pytest.raises(SpecRLError, match=r"row 2 .*id -3\b") as e:
        verify("rejection", None, x, None, *args)
    assert "position 0" in str(e.value) and "0 or more" in str(e.value)
    with pytest.raises(SpecRLError, match=rf"vocab_size=7 but .* has V={V}"):
        verify("rejection", r.p, r.x, None, *args[:4], vocab_size=7)


class _Fixed(Drafter):
    """Proposes the policy's greedy token followed by `then` (as dtype) at every step."""

    kind = "test-fixed"

    def __init__(self, target, then: int, dtype):
        self.target, self.then, self.dtype = target, then, dtype

    def propose(self, batch, k):
        rows = []
        for toks in batch.tokens:
            logits, _ = self.target(torch.tensor([toks]))
            rows.append([int(logits[0, -1].argmax())] + [self.then] * (k - 1))
        return Proposal(torch.tensor(rows).to(self.dtype))


@pytest.mark.parametrize("mode", ["rejection", "seed_exact"])
@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_engine_takes_int32_drafts_and_refuses_out_of_range_ones_clearly(mode, temperature):
    target = tiny_model("llama", vocab_size=64, seed=3)
    prompts = [[1, 2, 3], [4, 5]]
    sp = SamplingParams(temperature=temperature, max_new_tokens=6, seed=1)
    ar = RolloutEngine(target, max_batch_size=2, max_seq_len=32).generate(prompts, sp)
    eng = RolloutEngine(target, max_batch_size=2, max_seq_len=32, drafter=_Fixed(target, 7, torch.int32),
                        num_draft_tokens=2, verify=mode)
    if mode == "seed_exact":
        assert [o.token_ids for o in eng.generate(prompts, sp)] == [o.token_ids for o in ar]
    else:
        eng.generate(prompts, sp)
    bad = RolloutEngine(target, max_batch_size=2, max_seq_len=32, drafter=_Fixed(target, 64, torch.long),
                        num_draft_tokens=2, verify=mode)
    with pytest.raises(SpecRLError, match=r"id 64\b.*0\.\.63") as e:
        bad.generate(prompts, sp)
    assert re.search(r"\brow 0\b.*\(V=64\)", str(e.value))

"""The verifier's cheap paths give what the general rule gives: ragged drafts (`num_drafts`), the greedy fast path
(`target_argmax`), and the engine's accounting of padding (never counted as drafted or accepted).

Ragged rows are compared token for token with the same row verified alone at its own k (same uniforms), so the
exactness proven for a fixed k in tests/test_verify_power.py carries over to every row of a ragged batch.
"""

from __future__ import annotations

import pytest
import torch

from specrl import RolloutEngine, SamplingParams
from specrl.drafters.base import Drafter, Proposal, ragged_proposal
from specrl.errors import SpecRLError
from specrl.model.transformer import tiny_model
from specrl.rollout.sampling import probs_from_logits
from specrl.rollout.spec_decode.verify import verify
from tests.test_verify_power import make_rows

K = 3


def _row(t, b, cols):
    return None if t is None else t[b:b + 1, :cols]


@pytest.mark.parametrize("mode,onehot", [("rejection", False), ("rejection", True), ("seed_exact", False)])
def test_ragged_rows_equal_each_row_verified_alone_at_its_own_k(mode, onehot):
    r = make_rows(400, K, onehot=onehot, seed=77)
    nd = torch.arange(400) % (K + 1)
    res = verify(mode, r.p, r.x, r.q, r.u_sample, r.u_accept, r.u_residual, nd)
    assert bool((res.num_accepted <= nd).all())
    for b in range(400):
        k = int(nd[b])
        alone = verify(mode, r.p[b:b + 1, :k + 1], r.x[b:b + 1, :k], _row(r.q, b, k), r.u_sample[b:b + 1, :k + 1],
                       r.u_accept[b:b + 1, :k], r.u_residual[b:b + 1, :k])
        e = int(alone.num_emitted[0])
        assert int(res.num_emitted[b]) == e
        assert res.tokens[b, :e].tolist() == alone.tokens[0, :e].tolist()


@pytest.mark.parametrize("mode", ["rejection", "seed_exact"])
@pytest.mark.parametrize("with_q", [False, True])
def test_greedy_fast_path_equals_the_general_path(mode, with_q):
    g = torch.Generator().manual_seed(5)
    n, v = 300, 16
    logits = torch.randn(n, K + 1, v, generator=g) * 3
    argmax = logits.argmax(-1)
    zeros = torch.zeros(n, K + 1)
    p = probs_from_logits(logits, zeros, torch.ones(n, K + 1), torch.zeros(n, K + 1, dtype=torch.long))  # one-hot
    x = torch.where(torch.rand(n, K, generator=g) < 0.6, argmax[:, :K], torch.randint(0, v, (n, K), generator=g))
    q = torch.zeros(n, K, v).scatter(-1, x[..., None], 1.0) if with_q else None  # a greedy drafter's one-hot q
    u = [torch.rand(n, K + 1, generator=g, dtype=torch.float64)] + \
        [torch.rand(n, K, generator=g, dtype=torch.float64) for _ in range(2)]
    for nd in (None, torch.arange(n) % (K + 1)):
        general = verify(mode, p, x, q, *u, nd)
        fast = verify(mode, None, x, q, *u, nd, argmax)
        assert fast.num_accepted.tolist() == general.num_accepted.tolist()
        for b in range(n):
            e = int(general.num_emitted[b])
            assert fast.tokens[b, :e].tolist() == general.tokens[b, :e].tolist()


def test_draft_mass_check_covers_the_greedy_path_and_exempts_padding():
    r = make_rows(6, K, onehot=False, seed=3)
    q = r.q.clone()
    q[2, 2, r.x[2, 2]] = 0.0  # q(x) = 0 at row 2, column 2
    args = (r.x, q, r.u_sample, r.u_accept, r.u_residual)
    argmax = r.p.argmax(-1)
    with pytest.raises(SpecRLError, match=r"drafter bug: row 2\b"):
        verify("rejection", None, *args, None, argmax)
    with pytest.raises(SpecRLError, match=r"drafter bug: row 2\b"):
        verify("rejection", r.p, *args, torch.full((6,), K))
    padded = torch.tensor([3, 3, 2, 3, 3, 3])  # column 2 of row 2 is padding: not drawn from q, never accepted
    verify("rejection", r.p, *args, padded)
    verify("rejection", None, *args, padded, argmax)


def test_bad_num_drafts_and_both_targets_are_errors():
    r = make_rows(4, K, onehot=True, seed=1)
    args = (r.x, None, r.u_sample, r.u_accept, r.u_residual)
    with pytest.raises(SpecRLError, match=r"num_drafts.*0\.\.3"):
        verify("rejection", r.p, *args, torch.tensor([0, 1, 4, 2]))
    with pytest.raises(SpecRLError, match="num_drafts has shape"):
        verify("rejection", r.p, *args, torch.tensor([0, 1]))
    with pytest.raises(SpecRLError, match=r"exactly one.*target_probs.*target_argmax"):
        verify("rejection", r.p, *args, None, r.p.argmax(-1))


class _OracleButPadded(Drafter):
    """Proposes the policy's own greedy continuation but declares only its first `real` tokens real: the padding
    would be accepted if it were verified."""

    kind = "test-padded"

    def __init__(self, target, real: int):
        self.target, self.real = target, real

    def propose(self, batch, k):
        rows = []
        for toks in batch.tokens:
            seq = list(toks)
            for _ in range(k):
                logits, _ = self.target(torch.tensor([seq]))
                seq.append(int(logits[0, -1].argmax()))
            rows.append(seq[len(toks):])
        prop = ragged_proposal([r[: self.real] for r in rows], k)
        return Proposal(torch.tensor(rows), num_drafts=prop.num_drafts)


@pytest.mark.parametrize("real", [0, 1])
@pytest.mark.parametrize("mode", ["rejection", "seed_exact"])
def test_padding_is_never_accepted_nor_counted(mode, real):
    target = tiny_model("llama", vocab_size=64, seed=3)
    prompts = [[1, 2, 3], [4, 5], [9, 9, 9, 9]]
    sp = SamplingParams(temperature=0, max_new_tokens=12)
    ar = RolloutEngine(target, max_batch_size=3, max_seq_len=32).generate(prompts, sp)
    eng = RolloutEngine(target, max_batch_size=3, max_seq_len=32, drafter=_OracleButPadded(target, real),
                        num_draft_tokens=K, verify=mode)
    res = eng.generate(prompts, sp)
    assert [o.token_ids for o in res] == [o.token_ids for o in ar]
    m = res.metrics
    assert m["draft_tokens"] == real * m["verify_steps"]
    assert m["accepted_tokens"] == m["draft_tokens"]  # the real drafts are the policy's tokens: all accepted
    assert m["drafted_per_position"] == [m["verify_steps"]] * real + [0] * (eng.k_max - real)
    assert m["acceptance_length"] == pytest.approx(1 + real)


def test_ngram_proposals_mark_their_padding():
    from specrl.drafters import NGramDrafter
    from specrl.rollout.drafter import DraftBatch

    z = torch.zeros(2, dtype=torch.long)
    batch = DraftBatch(tokens=[[1, 2, 3, 1, 2], [7, 8]], positions=torch.tensor([5, 2]), seeds=z, request_ids=z,
                       group_ids=[0, 1], temperature=torch.ones(2), top_p=torch.ones(2), top_k=z)
    prop = NGramDrafter().propose(batch, 4)
    assert prop.num_drafts.tolist() == [3, 0]  # "3, 1, 2" follows the earlier "1, 2"; nothing matches "7, 8"
    assert prop.tokens[0, :3].tolist() == [3, 1, 2]

"""The shared-prompt scoring forward: a GRPO group's samples run their common prompt once.

`shared_prefix_hidden` must give the whole-sequence forward's hidden states, captured layers, response log-probs
and parameter gradients (up to summation order; RMSNorm computes in float32, hence the tolerances), for every
architecture, with prompts of different lengths and a row that shares nothing; it must step aside where it cannot
help; and a learner step with it must land on the weights of a learner step without it.
"""

import pytest
import torch

from specrl.algorithms.batch import response_span
from specrl.model.transformer import tiny_model
from specrl.trainer.scoring import response_logprobs, shared_prefix_hidden


def grpo_rows(groups: list[tuple[list[int], int]], seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """Right-padded tokens [B, T] and response mask [B, T-1] for (prompt, samples) groups, responses of varied
    lengths (1..6 tokens)."""
    g = torch.Generator().manual_seed(seed)
    rows = [(p, torch.randint(1, 60, (int(torch.randint(1, 7, (1,), generator=g)),), generator=g).tolist())
            for p, n in groups for _ in range(n)]
    t = max(len(p) + len(r) for p, r in rows)
    toks = torch.zeros(len(rows), t, dtype=torch.long)
    mask = torch.zeros(len(rows), t - 1, dtype=torch.bool)
    for b, (p, r) in enumerate(rows):
        toks[b, : len(p) + len(r)] = torch.tensor(p + r)
        mask[b, len(p) - 1: len(p) - 1 + len(r)] = True
    return toks, mask


def valid_positions(toks: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """[B, T]: the positions that hold a real token (prompt or response)."""
    t = toks.shape[1]
    last = (t - 2) - mask.flip(1).float().argmax(1)  # last scored position; the row's last token is one further
    return torch.arange(t)[None, :] <= (last + 1)[:, None]


GROUPS = [([3, 4, 5, 6, 7], 3), ([9, 8, 7], 3), ([11, 12, 13, 14], 1), ([3, 4, 5, 6], 2)]


@pytest.mark.parametrize("arch", ["llama", "qwen2", "qwen3"])
def test_shared_forward_matches_the_whole_sequence_forward(arch):
    model = tiny_model(arch, vocab_size=64, seed=1).double()
    toks, mask = grpo_rows(GROUPS)
    valid = valid_positions(toks, mask)
    grads, outs = [], []
    for share in (False, True):
        model.zero_grad()
        lp, cap = response_logprobs(model, toks, mask, 0.8, capture=(0, 1), share_prefixes=share)
        w = torch.linspace(-1, 1, cap["final"].shape[-1], dtype=torch.float64)
        # a loss through the log-probs and through every captured tensor at real positions (the drafter reads them)
        loss = lp.sum() + sum(((cap[i] * w).sum(-1) * valid).sum() for i in (0, 1, "final"))
        loss.backward()
        grads.append({n: p.grad.clone() for n, p in model.named_parameters()})
        outs.append((lp.detach(), {i: cap[i].detach() for i in (0, 1, "final")}))
    (lp0, cap0), (lp1, cap1) = outs
    assert torch.allclose(lp0, lp1, atol=1e-5)
    assert bool((lp1[~mask] == 0).all())
    for i in (0, 1, "final"):
        assert torch.allclose(cap0[i][valid], cap1[i][valid], atol=1e-5), i
        assert bool((cap1[i][~valid] == 0).all()), i  # padding is zero, never another row's state
    for n, g0 in grads[0].items():
        assert torch.allclose(g0, grads[1][n], rtol=1e-5, atol=1e-5 * float(g0.abs().max())), n


def test_response_span_gives_each_rows_first_and_last_scored_position():
    mask = torch.zeros(3, 7, dtype=torch.bool)
    mask[0, 2:6] = True  # a response from position 2 to 5
    mask[1, 4:] = True  # one that runs to the end
    first, last = response_span(mask)  # row 2 has no response token
    assert first.tolist() == [2, 4, 0] and last.tolist() == [5, 6, 0]


def test_the_shared_forward_runs_each_distinct_prompt_once(monkeypatch):
    model = tiny_model("llama", vocab_size=64).double()
    toks, mask = grpo_rows(GROUPS)
    seen = []
    real = model.forward_hidden_shared

    def spy(prefix, prefix_lens, tokens, group, capture=()):
        seen.append((prefix.shape, prefix_lens.tolist(), tokens.shape, group.tolist()))
        return real(prefix, prefix_lens, tokens, group, capture)

    monkeypatch.setattr(model, "forward_hidden_shared", spy)
    assert shared_prefix_hidden(model, toks, mask) is not None
    # four distinct prompts; [3, 4, 5, 6] is a prefix of [3, 4, 5, 6, 7] but a different prompt: its own group.
    # The shared part is the prompt less its last token, which runs with the row (it scores the first response token)
    (pshape, lens, tshape, group), = seen
    assert pshape == (4, 4) and lens == [4, 2, 3, 3]
    assert group == [0, 0, 0, 1, 1, 1, 2, 3, 3] and tshape[0] == 9


def test_the_shared_forward_steps_aside_where_it_cannot_help():
    model = tiny_model("llama", vocab_size=64).double()
    distinct, m1 = grpo_rows([([3, 4, 5], 1), ([6, 7, 8], 1)])
    assert shared_prefix_hidden(model, distinct, m1) is None  # no two rows share a prompt
    one_token, m2 = grpo_rows([([3], 3)])
    assert shared_prefix_hidden(model, one_token, m2) is None  # nothing before the last prompt token to share
    toks, mask = grpo_rows([([3, 4, 5], 2)])
    mask[1] = False  # a row with no response token: no prompt boundary to read
    assert shared_prefix_hidden(model, toks, mask) is None

    class NoSharedForward(torch.nn.Module):  # any module with forward_hidden but not the shared method
        forward_hidden = model.forward_hidden

    assert shared_prefix_hidden(NoSharedForward(), toks, mask) is None


def _learner_step(tiny, roll, share: bool):
    """One learner step (two AdamW updates) from the tiny checkpoint: (final weights, the gradients each optimizer
    step saw)."""
    from torch.optim.optimizer import register_optimizer_step_pre_hook

    from specrl.model.loader import load_model
    from specrl.trainer.learner import Learner
    from specrl.trainer.sync_trainer import seed_everything
    from tests.test_learner_group import SECONDS, dp_cfg

    seed_everything(0)
    policy, _ = load_model(str(tiny), dtype=torch.float32)
    learner = Learner(dp_cfg(tiny, world_size=1, grpo__num_iterations=2), policy)
    learner.share_prefixes = share
    grads = []
    hook = register_optimizer_step_pre_hook(
        lambda *_: grads.append({n: p.grad.clone() for n, p in policy.named_parameters() if p.grad is not None}))
    try:
        rec = learner.learn(roll, dict(SECONDS))
    finally:
        hook.remove()
    assert rec.loss is not None and rec.loss == rec.loss
    return {k: v.detach().clone() for k, v in policy.state_dict().items()}, grads


def _grad_gap(a: list[dict], b: list[dict]) -> float:
    """The largest gradient difference over every optimizer step and tensor, relative to that tensor's largest
    gradient entry."""
    assert len(a) == len(b) == 2 and a[0].keys() == b[0].keys()
    return max(float((x[n] - y[n]).abs().max() / x[n].abs().max().clamp_min(1e-30))
               for x, y in zip(a, b, strict=True) for n in x)


def test_a_learner_step_lands_on_the_same_weights_with_and_without_shared_prompts(tmp_path):
    """The shared-prompt forward changes only the summation order, so every optimizer step must see the same
    gradients (float32 rounding: ~1e-6 of a tensor's largest entry; scoring a wrong position or losing a token
    moves them by a large fraction of it) and land on the same weights. AdamW's update g / (sqrt(v) + eps) turns
    an entry whose gradient is pure rounding noise (~1e-7 of the tensor's largest, where the batch's terms cancel)
    into a sizeable fraction of a step whose value depends on that noise: such entries are compared through their
    gradients only (on a 2-core AMD EPYC with AVX512-BF16 one of them sat 4.6e-5 apart after a 2e-3 step)."""
    from specrl.algorithms.rollouts import Rollouts
    from specrl.model.loader import load_model
    from tests.tiny import make_tiny_checkpoint

    tiny = make_tiny_checkpoint(tmp_path / "ckpt", seed=0)
    g = torch.Generator().manual_seed(3)
    prompts = [torch.randint(3, 128, (int(torch.randint(3, 9, (1,), generator=g)),), generator=g).tolist()
               for _ in range(2)]
    n = 8
    responses = [torch.randint(3, 128, (int(torch.randint(1, 7, (1,), generator=g)),), generator=g).tolist()
                 for _ in range(n)]

    def rollouts(resp):
        return Rollouts(problem_indices=[i // 4 for i in range(n)], prompts=[prompts[i // 4] for i in range(n)],
                        responses=resp, gen_logprobs=[[-2.0] * len(x) for x in resp],
                        finish_reasons=["stop"] * n, rewards=torch.rand(n, generator=torch.Generator().manual_seed(4)),
                        correct=[False] * n, formatted=[None] * n, policy_versions=[0] * n, request_ids=list(range(n)))

    start = {k: v.clone() for k, v in load_model(str(tiny), dtype=torch.float32)[0].state_dict().items()}
    (w_shared, g_shared), (w_whole, g_whole) = (_learner_step(tiny, rollouts(responses), s) for s in (True, False))
    assert _grad_gap(g_shared, g_whole) < 1e-4, _grad_gap(g_shared, g_whole)
    # the tolerance tells a real difference apart: one response token changed moves the gradients far past it
    other = [list(r) for r in responses]
    other[5][0] = 3 + (other[5][0] - 2) % 125
    assert _grad_gap(_learner_step(tiny, rollouts(other), True)[1], g_whole) > 1e-2
    step = max(float((start[k] - v).abs().max()) for k, v in w_whole.items())  # two AdamW steps at lr 1e-3
    assert step > 1e-3
    for k, v in w_whole.items():
        if k not in g_whole[0]:
            continue
        # entries whose first gradient is above rounding noise; AdamW's eps-normalised noise elsewhere (see above)
        live = g_whole[0][k].abs() > 1e-4 * g_whole[0][k].abs().max()
        apart = float((w_shared[k] - v).abs()[live].max())
        assert apart < 0.02 * step, (k, step, apart)

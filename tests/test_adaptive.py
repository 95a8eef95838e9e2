"""The adaptive draft-length controller follows measured throughput."""

import pytest
import torch

from specrl.rollout.spec_decode.adaptive import DraftLengthController


def accepted(n: int, k: int, rate: float, gen: torch.Generator) -> torch.Tensor:
    """Accepted drafts per sequence when each position is accepted with `rate` (until the first rejection)."""
    ok = torch.rand(n, k, generator=gen) < rate
    return ok.long().cumprod(1).sum(1)


def step(c: DraftLengthController, n: int, k: int, seconds: float, rate: float, gen: torch.Generator) -> None:
    """Feed the controller one engine step the way the engine does."""
    if k:
        acc = accepted(n, k, rate, gen)
        c.observe_draft(n, k, 0.0)
        c.observe_target(n, k + 1, 10, seconds, emitted=int((acc + 1).sum()))
        c.observe_acceptance(acc, k)
    else:
        c.observe_target(n, 1, 10, seconds)


def warm(c: DraftLengthController, *ns: int) -> None:
    """Each batch size's first (warm-up) step: absurdly slow, as a GPU's first step is, and never timed."""
    for n in ns:
        c.observe_target(n, 1, 10, 100.0)


def drive(costs: dict[int, float], rate: float, n: int = 8, steps: int = 60) -> list[int]:
    """Simulate a machine where a step with k drafts takes costs[k] s and each draft is accepted with `rate`."""
    c, gen, chosen = DraftLengthController(7, "auto"), torch.Generator().manual_seed(0), []
    for _ in range(steps):
        k = c.choose(n, 10)
        chosen.append(k)
        step(c, n, k, costs[k], rate, gen)
    return chosen


def test_memory_bound_picks_speculation():
    # flat forward cost, good acceptance: deep drafting pays
    chosen = drive({k: 1.0 + 0.02 * k for k in range(8)}, 0.8)
    assert max(set(chosen[-20:]), key=chosen[-20:].count) >= 3


def test_compute_bound_switches_off():
    # cost grows with tokens in flight: every k loses to plain decoding
    chosen = drive({k: 1.0 * (k + 1) for k in range(8)}, 0.5)
    assert chosen[-20:].count(0) >= 17  # plain decoding except the periodic re-checks


def test_fixed_k_is_returned():
    c = DraftLengthController(7, 3)
    assert [c.choose(8, 10) for _ in range(5)] == [3] * 5


def test_new_batch_size_starts_from_nearest_measured_choice():
    c, gen = DraftLengthController(7, "auto"), torch.Generator().manual_seed(0)
    for _ in range(40):  # batch 8 on a memory-bound machine: settles on deep drafting
        k = c.choose(8, 10)
        step(c, 8, k, 1.0 + 0.02 * k, 0.8, gen)
    best8 = c._best(8)
    assert best8 >= 3
    # the batch drained to 4: its warm-up step (not timed), one plain step as this size's baseline, then straight
    # back to best8 (no re-climb)
    assert c.choose(4, 10) == 0
    c.observe_target(4, 1, 10, 100.0)
    assert c.choose(4, 10) == 0
    c.observe_target(4, 1, 10, 0.9)
    assert c.choose(4, 10) == best8


def test_cost_is_measured_against_plain_decoding_at_the_same_batch_size():
    # plain step time grows with n (t = 0.5 + 0.05 n); a k=1 step always costs exactly a plain step at that n,
    # so its cost ratio is 1 at every n although its raw step time varies 2x; the gain is then the yield
    c = DraftLengthController(7, "auto")
    warm(c, 32, 16)
    for n in (32, 24, 16, 9):
        c.observe_target(n, 1, 10, 0.5 + 0.05 * n)
    assert c.ar_seconds(20) == pytest.approx(1.5)
    for n in (30, 17, 12):
        c.observe_target(n, 2, 10, 0.5 + 0.05 * n, emitted=n)
        c.observe_acceptance(torch.tensor([0, 1] * (n // 2)), 1)  # half the drafts accepted
    assert c.cost(32, 1) == pytest.approx(1.0, rel=1e-6)
    assert c.cost(16, 1) == pytest.approx(1.0, rel=1e-6)
    assert c.gain(32, 1) == pytest.approx(1.5, rel=0.02)  # 1 + acceptance rate 0.5


def test_yield_comes_from_per_position_acceptance_not_one_noisy_step():
    # batch 1: a single step emits 1 or k+1 tokens; the estimate uses every step's acceptance
    c = DraftLengthController(3, "auto")
    warm(c, 1)
    c.observe_target(1, 1, 10, 1.0)
    for i in range(40):
        c.observe_target(1, 3, 10, 1.1, emitted=1 if i % 2 else 3)
        c.observe_acceptance(torch.tensor([0 if i % 2 else 2]), 2)
    c.observe_target(1, 3, 10, 1.1, emitted=1)  # one unlucky step
    c.observe_acceptance(torch.tensor([0]), 2)
    assert c.expected_tokens(2) == pytest.approx(1 + 0.5 + 0.5, rel=0.05)
    assert c.gain(1, 2) > 1.5  # still clearly worth drafting


def test_speculation_that_loses_at_a_drained_batch_size_is_switched_off_there():
    # big batch: compute-bound, speculation loses; small batch: memory-bound, it wins
    def cost(n, k):
        return 0.2 + 0.02 * n * (k + 1)

    c, gen = DraftLengthController(4, "auto"), torch.Generator().manual_seed(0)
    chosen = {32: [], 2: []}
    for n in [32] * 40 + [2] * 40:
        k = c.choose(n, 10)
        chosen[n].append(k)
        step(c, n, k, cost(n, k), 0.7, gen)
    assert chosen[32][-16:].count(0) >= 14
    tail = sorted(chosen[2][-16:])
    # speculating at every step but one periodic re-timing of plain decoding, mostly with k >= 2
    assert tail.count(0) <= 1 and tail[1] >= 1 and tail[len(tail) // 2] >= 2


def test_a_marginal_gain_does_not_switch_speculation_on():
    # estimated gain 1.03 < 1 + margin: the engine's unmeasured per-step costs would eat it, stay plain
    c = DraftLengthController(1, "auto", margin=0.05)
    warm(c, 8)
    c.observe_target(8, 1, 10, 1.0)
    c.observe_target(8, 2, 10, 1.0, emitted=8)
    c.att[0], c.acc[0] = 100.0, 3.0  # acceptance 0.03
    assert c.gain(8, 1) == pytest.approx(1.03)
    assert c._best(8) == 0
    c.acc[0] = 10.0  # acceptance 0.10: a clear gain
    assert c._best(8) == 1


def test_probes_back_off_while_plain_decoding_keeps_winning():
    # compute-bound: k=0 stays best; its k=1 probes come every 16, 32, 64, 64, ... steps, not every 16
    chosen = drive({k: 1.0 * (k + 1) for k in range(8)}, 0.5, steps=400)
    probes = [i for i, k in enumerate(chosen) if k > 0 and i >= 20]
    assert 3 <= len(probes) <= 8, probes
    gaps = [b - a for a, b in zip(probes, probes[1:], strict=False)]
    assert gaps[-1] == 64 and all(g1 <= g2 for g1, g2 in zip(gaps, gaps[1:], strict=False)), gaps


def test_probe_interval_resets_once_speculation_wins_again():
    c, gen = DraftLengthController(7, "auto"), torch.Generator().manual_seed(0)
    for _ in range(200):  # compute-bound: switched off, probes backed off
        k = c.choose(8, 10)
        step(c, 8, k, 1.0 * (k + 1), 0.5, gen)
    assert c._best(8) == 0 and c._quiet[8] >= 2
    for _ in range(200):  # the machine turns memory-bound and acceptance rises: the next probe switches it on
        k = c.choose(8, 10)
        step(c, 8, k, 1.0 + 0.02 * k, 0.9, gen)
    assert c._best(8) >= 2 and c._quiet[8] == 0


def test_plain_step_cost_is_predicted_from_the_same_batch_size_bucket():
    # a CPU-like convex cost: flat while memory-bound, then linear. One line through all sizes misses the middle;
    # the bucket's own plain steps do not
    c = DraftLengthController(7, "auto")
    cost = lambda n: max(1.0, 0.1 * n)  # noqa: E731
    warm(c, 1, 2, 4, 8, 16, 32, 64)
    for n in (1, 2, 4, 8, 32, 24, 16, 12, 6, 3):
        c.observe_target(n, 1, 10, cost(n))
    glob = c._line(c._fit, 14)
    assert abs(glob / cost(14) - 1) > 0.05  # the global chord is off by more than the speculation margin
    assert c.ar_seconds(14) == pytest.approx(cost(14), rel=1e-6)  # bucket 16 saw n = 16 and 12
    assert c.ar_seconds(28) == pytest.approx(cost(28), rel=1e-6)  # bucket 32 saw n = 32 and 24
    c.observe_target(40, 1, 10, cost(40))  # bucket 64 has one point: the global line moved through it
    assert c.ar_seconds(40) == pytest.approx(cost(40), rel=1e-6)


def test_one_measured_k_predicts_every_k_and_the_choice_jumps_to_the_predicted_best():
    # k=1 steps cost 1.03 plain steps at batch 1 (a flat verify): the cost line through them and (0, 1) predicts
    # 1 + 0.03 k, so with acceptance 0.8 the choice goes straight to the lookahead (k = 1 + 2), not one k at a time
    c = DraftLengthController(7, "auto")
    warm(c, 1)
    c.observe_target(1, 1, 10, 1.0)
    for _ in range(3):
        c.observe_target(1, 2, 10, 1.03, emitted=2)
        c.observe_acceptance(torch.tensor([1, 1, 1, 1, 0]), 1)
    assert c.cost(1, 5) == pytest.approx(1.15, rel=0.01)
    assert c.choose(1, 10) == 3


def test_the_cost_line_is_fitted_through_every_measured_k():
    # noisy steps at k = 1..3 on a machine where a step costs 1 + 0.1 k: the line predicts k = 6 within 3%
    c, gen = DraftLengthController(7, "auto"), torch.Generator().manual_seed(0)
    warm(c, 8)
    c.observe_target(8, 1, 10, 1.0)
    for i in range(60):
        k = 1 + i % 3
        noise = 1 + 0.05 * float(torch.randn((), generator=gen))
        c.observe_target(8, k + 1, 10, (1 + 0.1 * k) * noise, emitted=8)
    assert c.cost(8, 6) == pytest.approx(1.6, rel=0.03)


@pytest.mark.parametrize("n, verify_slope, draft_cost, rate", [
    (1, 0.023, 0.076, 0.67),  # batch 1 on this CPU (v = 1.07 at k = 3; eagle:think's measured c and acceptance)
    (8, 0.11, 0.086, 0.67),  # batch 8 (v = 1.34 at k = 3)
    (8, 0.11, 0.086, 0.45),  # a weaker drafter: k = 1 is best
    (8, 0.25, 0.1, 0.3),  # a verify too dear for the acceptance: plain decoding is best
])
def test_auto_k_is_within_5_percent_of_the_best_fixed_k_on_a_simulated_machine(n, verify_slope, draft_cost, rate):
    # a step with k drafts costs (1 + verify_slope k)(1 + 5% noise) plain steps plus draft_cost k; each position is
    # accepted with `rate`. The best fixed k's throughput is exact (1 + r + ... + r^k over its cost); auto's is
    # what it realises over 400 steps, exploring included
    def throughput(k: int) -> float:
        return sum(rate ** j for j in range(k + 1)) / (1 + (verify_slope + draft_cost) * k)

    best = max(throughput(k) for k in range(8))
    c, gen = DraftLengthController(7, "auto"), torch.Generator().manual_seed(0)
    tokens = seconds = 0.0
    for _ in range(400):
        k = c.choose(n, 10)
        t = (1 + verify_slope * k) * (1 + 0.05 * float(torch.randn((), generator=gen)))
        if k:
            acc = accepted(n, k, rate, gen)
            c.observe_draft(n, k, draft_cost * k)
            c.observe_target(n, k + 1, 10, t, emitted=int((acc + 1).sum()))
            c.observe_acceptance(acc, k)
            tokens, seconds = tokens + float((acc + 1).sum()), seconds + t + draft_cost * k
        else:
            c.observe_target(n, 1, 10, t)
            tokens, seconds = tokens + n, seconds + t
    assert tokens / seconds / n >= 0.95 * best


def run_machine(c: DraftLengthController, steps: int, plain, draft: float, rate: float, n: int = 8,
                ctx=lambda i: 10, gen=None) -> list[int]:
    """Drive `c` on a simulated machine whose plain step at step i costs plain(i) s (it may drift), whose verify of
    k drafts costs plain(i) (1 + 0.05 k) s and whose drafter costs `draft` s per draft (a fixed cost)."""
    gen = gen or torch.Generator().manual_seed(0)
    chosen = []
    for i in range(steps):
        L = ctx(i)
        k = c.choose(n, L)
        chosen.append(k)
        if k:
            acc = accepted(n, k, rate, gen)
            c.observe_draft(n, k, draft * k)
            c.observe_target(n, k + 1, L, plain(i) * (1 + 0.05 * k), emitted=int((acc + 1).sum()))
            c.observe_acceptance(acc, k)
        else:
            c.observe_target(n, 1, L, plain(i))
    return chosen


def test_the_controller_follows_a_plain_step_that_gets_cheaper_over_the_run():
    # the plain step falls from 1 s to 0.1 s over the first 150 steps (contention ending) while the drafter's cost
    # stays 0.1 s per draft: deep drafting wins at first (k = 3 costs 1.45 plain steps for 2.2 tokens) and loses
    # by far at the end (k = 1: 2 plain steps for 1.6 tokens). Timing plain decoding only on k = 0 steps, the
    # controller kept its first baseline and k >= 2 for ever; re-timed, it switches speculation off
    def plain(i):
        return max(0.1, 1.0 - 0.006 * i)

    c = DraftLengthController(7, "auto")
    chosen = run_machine(c, 400, plain, 0.1, 0.6)
    assert max(set(chosen[20:60]), key=chosen[20:60].count) >= 2  # speculating while it wins
    assert chosen[-60:].count(0) >= 54  # plain decoding at the end, but for the occasional probe
    assert c.ar_seconds(8, 10) == pytest.approx(0.1, rel=0.05)  # the baseline followed the machine


def test_the_controller_follows_a_plain_step_that_gets_dearer_over_the_run():
    # the reverse: the plain step rises from 0.1 s to 1 s (another job starts); speculation starts losing and ends
    # winning: the controller switches it on
    def plain(i):
        return min(1.0, 0.1 + 0.006 * i)

    c = DraftLengthController(7, "auto")
    chosen = run_machine(c, 400, plain, 0.1, 0.6)
    assert chosen[20:60].count(0) >= 30
    tail = chosen[-60:]
    assert tail.count(0) <= 4 and max(set(tail), key=tail.count) >= 2
    assert c.ar_seconds(8, 10) == pytest.approx(1.0, rel=0.05)


def test_a_bucket_s_first_step_is_a_warm_up_and_is_not_timed():
    # a compute-bound machine whose first step takes 50 s (a GPU compiling): timed, that baseline made every
    # speculative step look 50x cheaper than plain decoding and kept it on; untimed, speculation is switched off
    c = DraftLengthController(7, "auto")
    costs = {k: 1.0 * (k + 1) for k in range(8)}
    gen, chosen = torch.Generator().manual_seed(0), []
    for i in range(80):
        k = c.choose(8, 10)
        chosen.append(k)
        step(c, 8, k, 50.0 if i == 0 else costs[k], 0.5, gen)
    assert chosen[:2] == [0, 0]  # the warm-up step, then the timed baseline
    assert chosen[-30:].count(0) >= 27
    assert c.ar_seconds(8, 10) == pytest.approx(1.0)


def test_plain_decoding_is_timed_at_the_context_length_of_the_steps_it_scores():
    # a plain step costs 0.5 s at short context and 2 s at long context (attention over the cache); a speculative
    # step costs the plain step at its own context length x 1.1. Each context bucket gets its own plain baseline
    # before it is scored, so the cost ratio is 1.1 at both lengths instead of 1.1 x 4 at the long one
    def plain_at(L):
        return 0.5 if L < 1000 else 2.0

    c, gen = DraftLengthController(3, "auto"), torch.Generator().manual_seed(0)
    ks = {}
    for i in range(120):
        L = 100 if i < 60 else 4000
        k = c.choose(8, L)
        ks.setdefault(L, []).append(k)
        if k:
            acc = accepted(8, k, 0.7, gen)
            c.observe_target(8, k + 1, L, plain_at(L) * (1 + 0.1 * k / 3), emitted=int((acc + 1).sum()))
            c.observe_acceptance(acc, k)
        else:
            c.observe_target(8, 1, L, plain_at(L))
    assert ks[4000][0] == 0  # a new context bucket: a plain step first
    assert c.ar_seconds(8, 100) == pytest.approx(0.5) and c.ar_seconds(8, 4000) == pytest.approx(2.0)
    assert c.cost(8, 3) == pytest.approx(1.1, rel=0.02)
    assert min(ks[4000][1:]) >= 0 and max(set(ks[4000][-20:]), key=ks[4000][-20:].count) >= 2

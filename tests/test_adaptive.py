"""The adaptive draft-length controller follows measured throughput."""

import pytest
import torch

from specrl.rollout.adaptive import DraftLengthController


def drive(costs: dict[int, float], al: dict[int, float], n: int = 8, steps: int = 60) -> list[int]:
    """Simulate a machine where a step with k drafts takes costs[k] s and emits al[k] tokens per sequence."""
    c = DraftLengthController(7, "auto")
    chosen = []
    for _ in range(steps):
        k = c.choose(n, 10)
        chosen.append(k)
        if k:
            c.observe_draft(n, k, 0.0)
        c.observe_target(n, k + 1, 10, costs[k], emitted=int(n * al[k]))
        if k:
            c.observe_acceptance(torch.full((n,), min(k, 1)), k)
    return chosen


def test_memory_bound_picks_speculation():
    # flat forward cost, good acceptance: deeper drafting pays up to k=4
    al = {k: min(1 + 0.8 * k, 4.2) for k in range(8)}
    chosen = drive({k: 1.0 + 0.02 * k for k in range(8)}, al)
    assert max(set(chosen[-20:]), key=chosen[-20:].count) >= 3


def test_compute_bound_switches_off():
    # cost grows with tokens in flight: every k loses to plain decoding
    al = {k: 1 + 0.5 * k for k in range(8)}
    chosen = drive({k: 1.0 * (k + 1) for k in range(8)}, al)
    assert chosen[-20:].count(0) >= 17  # plain decoding except the periodic re-checks


def test_fixed_k_is_returned():
    c = DraftLengthController(7, 3)
    assert [c.choose(8, 10) for _ in range(5)] == [3] * 5


def test_new_batch_size_starts_from_nearest_measured_choice():
    c = DraftLengthController(7, "auto")
    for _ in range(40):  # batch 8 on a memory-bound machine: settles on deep drafting
        k = c.choose(8, 10)
        c.observe_target(8, k + 1, 10, 1.0 + 0.02 * k, emitted=int(8 * min(1 + 0.8 * k, 4.2)))
    best8 = c._best(8)
    assert best8 >= 3
    # the batch drained to 4: one plain step as this size's baseline, then straight back to best8 (no re-climb)
    first = c.choose(4, 10)
    assert first == 0
    c.observe_target(4, 1, 10, 0.9)
    assert c.choose(4, 10) == best8


def test_gain_is_measured_against_plain_decoding_at_the_same_batch_size():
    # plain step time grows with n (t = 0.5 + 0.05 n); a k=1 step always costs exactly a plain step at that n
    # and emits 1.5 tokens per sequence, so its gain is 1.5 at every n, although its raw tokens/s varies 3x
    c = DraftLengthController(7, "auto")
    for n in (32, 24, 16, 9):
        c.observe_target(n, 1, 10, 0.5 + 0.05 * n)
    assert c.ar_seconds(20) == pytest.approx(1.5)
    for n in (30, 17, 12):
        c.observe_target(n, 2, 10, 0.5 + 0.05 * n, emitted=int(1.5 * n) if n % 2 == 0 else round(1.5 * n))
    assert c.gain[(32, 1)] == pytest.approx(1.5, rel=0.05)
    assert c.gain[(16, 1)] == pytest.approx(1.5, rel=0.05)


def test_speculation_that_loses_at_a_drained_batch_size_is_switched_off_there():
    # big batch: compute-bound, speculation loses; small batch: memory-bound, it wins
    def cost(n, k):
        return 0.2 + 0.01 * n * (k + 1)

    c = DraftLengthController(4, "auto")
    chosen = {32: [], 2: []}
    for n in [32] * 40 + [2] * 40:
        k = c.choose(n, 10)
        chosen[n].append(k)
        c.observe_target(n, k + 1, 10, cost(n, k), emitted=n * (1 + 0.3 * k) if k else n)
    assert chosen[32][-16:].count(0) >= 14
    assert min(chosen[2][-16:]) >= 2

"""The adaptive draft-length controller follows measured throughput."""

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
    best8 = max((k for (b, k) in c.tput if b == 8), key=lambda k: c.tput[(8, k)])
    assert best8 >= 3
    assert c.choose(4, 10) == best8  # the batch drained to 4: no re-exploration from k=0

"""Per-sequence draft budgets (`specrl.rollout.spec_decode.seq_budget`, `RolloutEngine(per_sequence_k=True)`).

The rule on synthetic acceptance histories (a row that keeps rejecting drops to 0 and re-probes, a row that accepts
keeps k, state resets on entry and moves with compaction), the engine with budgets on: seed_exact emits the plain
decoding tokens of the same seeds, and rejection sampling keeps the exact distribution (chi-square, in the suite's
family: tests/stats.py) while budgets of 0, 1 and 2 occur inside the tested continuation. Bad values: clear errors.
"""

import copy

import pytest
import torch

from specrl import RolloutEngine, SamplingParams
from specrl.drafters import DraftModelDrafter, NGramDrafter
from specrl.errors import SpecRLError
from specrl.model.transformer import tiny_model
from specrl.rollout.spec_decode.seq_budget import PROBE_EVERY, SequenceDraftBudget
from specrl.trainer.config_check import validate_config
from tests.stats import DIST_PROMPT, FAMILY_ALPHA, V, speculative_pvalue


# ---------------------------------------------------------------- the rule on synthetic histories
def run_history(budget: SequenceDraftBudget, k: int, accepts: list[bool], steps: int) -> list[list[int]]:
    """Drive the budget: row i accepts all its drafts if accepts[i], else rejects the first. Budgets per step."""
    n = len(accepts)
    out = []
    for _ in range(steps):
        b = budget.budgets(n, k)
        out.append(b.tolist())
        acc = torch.where(torch.tensor(accepts), b, torch.zeros_like(b))
        budget.observe(b, acc)
    return out


def test_rejecting_row_goes_to_zero_and_reprobes_while_accepting_row_keeps_k():
    hist = run_history(SequenceDraftBudget(4), 3, [True, False], 40)
    assert all(step[0] == 3 for step in hist)  # the accepting row always drafts the step's k
    rej = [step[1] for step in hist]
    assert rej[0] == 3  # the prior: a fresh sequence drafts k
    first_zero = rej.index(0)
    assert first_zero <= 8 and rej[:first_zero] == sorted(rej[:first_zero], reverse=True)
    tail = rej[first_zero:]
    assert set(tail) == {0, 1}  # never back above one draft without an acceptance
    # a one-draft re-probe after every PROBE_EVERY steps at 0, and only then
    probes = [i for i, b in enumerate(tail) if b == 1]
    assert probes and all(b - a == PROBE_EVERY + 1 for a, b in zip(probes, probes[1:], strict=False))
    assert probes[0] == PROBE_EVERY


def test_a_probe_that_is_accepted_brings_drafting_back():
    budget = SequenceDraftBudget(1)
    run_history(budget, 3, [False], 30)
    seen = run_history(budget, 3, [True], 20)
    assert [s[0] for s in seen][-1] == 3 and 0 in [s[0] for s in seen]


def test_budget_never_exceeds_the_steps_k_and_k0_gives_zeros():
    budget = SequenceDraftBudget(3)
    assert budget.budgets(3, 0).tolist() == [0, 0, 0]
    assert budget.budgets(3, 1).tolist() == [1, 1, 1]
    assert int(budget.budgets(3, 7).max()) <= 7


def test_enter_resets_and_compaction_moves_state_with_the_sequence():
    budget = SequenceDraftBudget(4)
    run_history(budget, 3, [True, False, True, False], 12)
    before = budget.budgets(4, 3).tolist()
    rates = budget.rates(4).tolist()
    assert before[0] == 3 and before[1] < 3
    budget.compact([1, 2, 3])  # slot 0 finished: the others move down in order
    assert budget.rates(3).tolist() == rates[1:]
    assert budget.budgets(3, 3).tolist() == before[1:]
    budget.enter(3, 4)  # a new sequence in slot 3: the prior, not the old slot's history
    fresh = SequenceDraftBudget(1)
    assert budget.rates(4)[3] == fresh.rates(1)[0]
    assert int(budget.idle[3]) == 0


# ---------------------------------------------------------------- bad values
@pytest.mark.parametrize("kwargs,pattern", [
    ({"num_slots": 0}, r"num_slots must be an integer >= 1, got 0"),
    ({"threshold": 1.0}, r"threshold must be a number in \(0, 1\), got 1.0"),
    ({"threshold": True}, r"threshold must be a number in \(0, 1\), got True"),
    ({"prior_rate": 0}, r"prior_rate must be a number in \(0, 1\), got 0"),
    ({"forget": 1.5}, r"forget must be a number in \[0, 1\], got 1.5"),
    ({"probe_every": 0}, r"probe_every must be an integer >= 1 .*got 0"),
    ({"prior_weight": -1.0}, r"prior_weight must be a number > 0, got -1.0"),
])
def test_budget_bad_values(kwargs, pattern):
    args = {"num_slots": 2, **kwargs}
    with pytest.raises(SpecRLError, match=pattern):
        SequenceDraftBudget(**args)


@pytest.mark.parametrize("value", ["yes", 1, None])
def test_engine_per_sequence_k_must_be_a_bool(value):
    with pytest.raises(SpecRLError, match=r"per_sequence_k.*true or false"):
        RolloutEngine(tiny_model("llama", vocab_size=16, seed=0), max_batch_size=2, max_seq_len=32,
                      drafter=NGramDrafter(), per_sequence_k=value)


def test_config_per_sequence_k_bad_values():
    with pytest.raises(SpecRLError, match=r"per_sequence_k:.*true.*false.*'yes'"):
        validate_config({"speculative": {"per_sequence_k": "yes"}})
    with pytest.raises(SpecRLError, match=r"speculative\.per_sequence_k=true is native-only"):
        validate_config({"speculative": {"drafter": "ngram", "per_sequence_k": True},
                         "rollout": {"backend": "vllm"}})
    assert validate_config({"speculative": {"per_sequence_k": True}}).speculative.per_sequence_k is True


# ---------------------------------------------------------------- the engine with budgets on
def spy(engine) -> list[list[int]]:
    """Record the budgets the engine applies at each step."""
    seen, orig = [], engine.budget.budgets
    engine.budget.budgets = lambda n, k: seen.append(orig(n, k).tolist()) or torch.tensor(seen[-1])
    return seen


def noisy_copy(target, scale: float, seed: int):
    """A draft model near the target: moderate acceptance, so budgets take every value 0..k."""
    m = copy.deepcopy(target)
    torch.manual_seed(seed)
    with torch.no_grad():
        for p in m.parameters():
            p.add_(torch.randn_like(p) * scale)
    return m


def eagle64(target):
    from specrl.drafters.kinds.eagle import EagleDrafter

    d = EagleDrafter(target, layers=(0, 1, 3))
    torch.manual_seed(7)
    with torch.no_grad():
        for name, p in d.named_parameters():
            p.normal_(1.0 if "norm" in name else 0.0, 0.2 if "norm" in name else 0.3)
    return d.eval()


@pytest.fixture(scope="module")
def target64():
    return tiny_model("llama", vocab_size=64, seed=3)


@pytest.mark.parametrize("kind,k", [("draft-model", 3), ("draft-model", "varying"), ("eagle", 3), ("ngram", 3)])
def test_seed_exact_with_budgets_equals_plain_decoding(target64, kind, k):
    """fp32; 48 sequences of mixed lengths through 12 slots (compactions and refills) at T=1. "varying": the
    step's k follows a fixed pattern with plain steps between (as auto k moves; on this tiny model auto k itself
    settles on plain decoding, the drafter costing as much as the target)."""
    prompts = [[(7 * i + j) % 64 for j in range(1 + i % 5)] for i in range(48)]
    params = [SamplingParams(temperature=1.0 if i % 3 else 0.8, max_new_tokens=40 + 7 * (i % 4), seed=i % 11,
                             stop_token_ids=(63,) if i % 5 == 0 else ()) for i in range(48)]
    ar = RolloutEngine(target64, max_batch_size=12, max_seq_len=96).generate(prompts, params)
    drafter = {"draft-model": lambda: DraftModelDrafter(noisy_copy(target64, 0.02, 11)),
               "eagle": lambda: eagle64(target64), "ngram": NGramDrafter}[kind]()
    eng = RolloutEngine(target64, max_batch_size=12, max_seq_len=96, drafter=drafter,
                        num_draft_tokens="auto" if k == "varying" else k, verify="seed_exact", per_sequence_k=True)
    if k == "varying":
        pattern = iter([3, 3, 1, 0, 2, 3, 0, 0, 3, 2, 1, 3] * 100)
        eng.controller.choose = lambda n, ctx: next(pattern)
    seen = spy(eng)
    sd = eng.generate(prompts, params)
    mismatched = [i for i, (a, b) in enumerate(zip(ar, sd, strict=True)) if a.token_ids != b.token_ids]
    assert not mismatched, f"{len(mismatched)} sequences differ, first {mismatched[:5]}"
    mixed = sum(min(s) == 0 and max(s) > 0 for s in seen)
    assert mixed > 0, "no step had rows at k_i = 0 beside drafting rows: the test did not exercise the budgets"
    if kind == "draft-model":
        assert sd.metrics["accepted_tokens"] > 0


@pytest.mark.parametrize("kind", ["draft-model", "eagle"])
def test_rejection_with_budgets_keeps_the_exact_distribution(kind):
    """Continuations of 4 tokens at T=1, k=2: the prefill emits one, and the budgets of the following steps depend
    on the row's first outcome (a strict rule: prior 0.7 gives k_i=1, an acceptance 2, a rejection 0, then a
    one-draft probe), so rows with k_i in {0, 1, 2} are all inside the tested continuation."""
    target = tiny_model("llama", vocab_size=V, seed=5, num_layers=2)
    if kind == "draft-model":
        drafter = DraftModelDrafter(tiny_model("llama", vocab_size=V, seed=99, num_layers=1))
    else:
        from tests.test_spec_proof import make_small_drafter

        drafter = make_small_drafter("eagle", target)
    sp = SamplingParams(max_new_tokens=4, seed=777, temperature=1.0)
    engine = RolloutEngine(target, max_batch_size=2000, max_seq_len=48, drafter=drafter, num_draft_tokens=2,
                           verify="rejection", per_sequence_k=True)
    engine.budget = SequenceDraftBudget(2000, threshold=0.5, prior_rate=0.7, prior_weight=1.0, forget=0.5,
                                        probe_every=1)
    seen = spy(engine)
    pvalue = speculative_pvalue(engine, target, sp, DIST_PROMPT)
    values = {v for s in seen for v in s}
    assert {0, 1, 2} <= values, values
    assert pvalue > FAMILY_ALPHA

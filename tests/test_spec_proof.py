"""The proof suite: speculative decoding is lossless for every drafter, mode and sampling setting.

Exact distribution: a tiny target (vocab 8) and deliberately different drafters; every continuation of
length 3 gets its exact probability from plain forwards, and >= 20,000 speculative samples must pass a
chi-square test (family-adjusted p > 1e-3: see tests/stats.py for the suite's family-wise error rate), with
acceptance < 1 so the rejection path is exercised. The bonus-path cases use continuations of k + 2 tokens, so a
row that accepts all k drafts in its first step emits its bonus token inside the tested continuation, and assert
that many rows did. The stop-token cases make a likely token a stop token, so rows stop inside a speculative
step, and test the outcomes cut at their first stop token. Plus identities: greedy == AR greedy, seed_exact == AR
token for token, logprobs == a full forward, batch invariance. The verifier alone is tested with far more power
in tests/test_verify_power.py.
"""

import pytest
import torch

from specrl import RolloutEngine, SamplingParams
from specrl.drafters import DraftModelDrafter, NGramDrafter, SuffixDrafter
from specrl.model.transformer import tiny_model
from specrl.rollout.protocol import RolloutRequest
from tests.stats import DIST_PROMPT, FAMILY_ALPHA, SETTINGS, V, copy_prompt, speculative_pvalue


@pytest.fixture(scope="module")
def target():
    return tiny_model("llama", vocab_size=V, seed=5, num_layers=2)


def make_drafter(kind):
    if kind == "ngram":
        return NGramDrafter()
    if kind == "suffix":
        return SuffixDrafter()
    # draft-model-subset drafts only over some token ids: q is zero elsewhere, which the residual must cover
    return DraftModelDrafter(tiny_model("llama", vocab_size=V, seed=99, num_layers=1),
                             draft_vocab=[0, 2, 3, 5, 7] if kind == "draft-model-subset" else None)


@pytest.mark.parametrize("setting", list(SETTINGS))
@pytest.mark.parametrize("mode", ["rejection", "seed_exact"])
@pytest.mark.parametrize("kind", ["ngram", "suffix", "draft-model", "draft-model-subset"])
def test_exact_distribution(target, kind, mode, setting):
    sp = SamplingParams(max_new_tokens=3, seed=1234, **SETTINGS[setting])
    k = 2 if kind != "suffix" else 1  # k=1 makes the bonus token part of the tested continuation
    engine = RolloutEngine(target, max_batch_size=2000, max_seq_len=48, drafter=make_drafter(kind),
                           num_draft_tokens=k, verify=mode)
    assert speculative_pvalue(engine, target, sp, dist_prompt(kind, target)) > FAMILY_ALPHA


def dist_prompt(kind: str, target) -> list[int]:
    """The copying drafters draft only where a continuation exists (ragged proposals, no guessed padding): give
    them a prompt where every row has one (`copy_prompt`), so their accept and bonus paths run."""
    return copy_prompt(target) if kind in ("ngram", "suffix") else DIST_PROMPT


BONUS_KINDS = ["ngram", "suffix", "draft-model", "draft-model-subset", "eagle", "mtp"]


def make_small_drafter(kind, target):
    """Every drafter kind the suite covers, on the vocab-8 target (EAGLE and MTP as in test_drafter_eagle_mtp)."""
    from specrl.drafters.kinds.eagle import EagleDrafter
    from specrl.drafters.kinds.mtp import MTPDrafter

    def randomise(drafter, seed):  # as tests/test_drafter_eagle_mtp.randomise
        torch.manual_seed(seed)
        with torch.no_grad():
            for name, p in drafter.named_parameters():
                p.normal_(1.0 if "norm" in name else 0.0, 0.2 if "norm" in name else 0.3)
        return drafter

    if kind == "eagle":  # a 2-layer target: pick valid layers
        return randomise(EagleDrafter(target, layers=(0, 1, 1), draft_vocab=[0, 2, 3, 5, 6, 7]), seed=7).eval()
    if kind == "mtp":
        return randomise(MTPDrafter(target, num_modules=2), seed=7).eval()
    if kind == "hybrid":  # EAGLE + sibling suffix; min_match=1 and a low min_ratio so that both kinds of rows occur
        # on a vocab-8 target (its gate still reads the outcomes)
        from specrl.drafters.kinds.hybrid import HybridDrafter

        return HybridDrafter(make_small_drafter("eagle", target), min_match=1, min_ratio=0.1)
    return make_drafter(kind)


def spy_spec_steps(engine, count) -> list[int]:
    """Spy on the engine's speculative steps: after each, `count(active, k, before, result)` (the step's rows, its k,
    each row's output length before it, and the verifier's result) is added to the returned counter. Uses whatever
    `specrl.rollout.engine.verify` is at call time."""
    import specrl.rollout.engine as engine_module

    counter = [0]
    step = engine._spec_step

    def spied(active, k, *rest):
        before = [len(s.out) for s in active]
        real, seen = engine_module.verify, []
        engine_module.verify = lambda *a: seen.append(real(*a)) or seen[-1]
        try:
            step(active, k, *rest)
        finally:
            engine_module.verify = real
        counter[0] += count(active, k, before, seen[0])

    engine._spec_step = spied
    return counter


def count_bonus_emissions(engine, max_new_tokens: int) -> list[int]:
    """The rows that accepted all k drafts in a step whose k + 1 tokens (so the bonus token too) fit within
    max_new_tokens, i.e. emitted a bonus token that is part of the output (`spy_spec_steps`)."""
    return spy_spec_steps(engine, lambda active, k, before, res: sum(
        f and b + k + 1 <= max_new_tokens for b, f in zip(before, (res.num_accepted == k).tolist(), strict=True)))


def bonus_path_case(target, kind, mode, k=2, drafter=None) -> tuple[float, int]:
    """(family-adjusted chi-square p-value, rows whose output includes a bonus token) for continuations of k + 2
    tokens: the first comes from prefill, and a row accepting all k drafts in its first step emits k + 1 more."""
    sp = SamplingParams(max_new_tokens=k + 2, seed=4321, temperature=1.0)
    engine = RolloutEngine(target, max_batch_size=2000, max_seq_len=48,
                           drafter=drafter or make_small_drafter(kind, target), num_draft_tokens=k, verify=mode)
    bonus = count_bonus_emissions(engine, sp.max_new_tokens)
    return speculative_pvalue(engine, target, sp, dist_prompt(kind, target)), bonus[0]


@pytest.mark.parametrize("mode", ["rejection", "seed_exact"])
@pytest.mark.parametrize("kind", BONUS_KINDS)
def test_bonus_path_exact_distribution(target, kind, mode):
    """k = 2 with max_new_tokens = k + 2: the bonus token drawn after all k drafts are accepted is in the tested
    continuation (with max_new_tokens = 3 it was always truncated), and at least 1% of the rows emit one."""
    pvalue, bonus = bonus_path_case(target, kind, mode)
    assert bonus >= 0.01 * 20000, f"only {bonus} rows accepted all drafts and emitted a bonus token"
    assert pvalue > FAMILY_ALPHA


def count_dropped_after_stop(engine) -> list[int]:
    """The rows that emitted a stop token with more of the step's verified tokens (accepted drafts, a residual or a
    bonus token) after it, which the engine must drop (`spy_spec_steps`)."""
    return spy_spec_steps(engine, lambda active, k, before, res: sum(
        s.finish_reason == "stop" and len(s.out) - b < v
        for s, b, v in zip(active, before, res.num_emitted.tolist(), strict=True)))


@pytest.mark.parametrize("mode", ["rejection", "seed_exact"])
@pytest.mark.parametrize("kind", ["ngram", "draft-model", "eagle", "mtp"])
def test_exact_distribution_with_a_stop_token(target, kind, mode):
    """A stop token (the likeliest second token that every drafter here can propose, so it is drafted and
    accepted) ends a row inside a speculative step: the step's verified tokens after it are dropped, and the
    outcomes (continuations cut after their first stop token, or max_new_tokens long) keep the exact distribution,
    as a row's length does in RL."""
    from tests.stats import exact_distribution

    prompt = dist_prompt(kind, target)
    full = exact_distribution(target, SamplingParams(max_new_tokens=4, temperature=1.0), 4, prompt)
    second = [sum(p for c, p in full.items() if c[1] == t) for t in range(8)]
    stop = max([0, 2, 3, 5, 7], key=second.__getitem__)  # in the EAGLE head's draft vocabulary
    sp = SamplingParams(max_new_tokens=4, seed=97531, temperature=1.0, stop_token_ids=(stop,))
    engine = RolloutEngine(target, max_batch_size=2000, max_seq_len=48, drafter=make_small_drafter(kind, target),
                           num_draft_tokens=2, verify=mode)
    dropped = count_dropped_after_stop(engine)
    assert speculative_pvalue(engine, target, sp, prompt) > FAMILY_ALPHA
    assert dropped[0] >= 0.01 * 20000, f"only {dropped[0]} rows stopped before the end of their verified tokens"


@pytest.mark.parametrize("cut", ["row", "column"])
@pytest.mark.parametrize("mode", ["rejection", "seed_exact"])
@pytest.mark.parametrize("kind", ["draft-model", "draft-model-subset", "eagle", "mtp"])
def test_exact_distribution_with_confidence_cut(target, kind, mode, cut):
    """The engine's own confidence cut (default table and price, learned online) on the drafters that give q:
    rows verify fewer drafts than the step's k where their calibrated acceptance does not pay, and the output
    distribution stays exact (tests/test_confidence_cut.py forces a spread of lengths and shows a lossy cut fails)."""
    sp = SamplingParams(max_new_tokens=4, seed=2468, **SETTINGS["T0.7"])
    engine = RolloutEngine(target, max_batch_size=2000, max_seq_len=48, drafter=make_small_drafter(kind, target),
                           num_draft_tokens=2, verify=mode, confidence_cut=cut)
    seen, generate = [], engine.generate
    engine.generate = lambda *a: seen.append(generate(*a)) or seen[-1]
    assert speculative_pvalue(engine, target, sp, DIST_PROMPT) > FAMILY_ALPHA
    m = seen[0].metrics
    assert m["draft_tokens"] < 2 * m["verify_steps"], "no draft was cut: the test did not exercise the cut"


@pytest.mark.parametrize("mode", ["rejection", "seed_exact"])
def test_hybrid_drafter_exact_with_both_kinds_of_rows(target, mode):
    """The hybrid's rows mix one-hot suffix proposals and sampled EAGLE proposals (with their q) in one step; the
    output distribution stays exact, and both kinds of rows were really verified."""
    drafter = make_small_drafter("hybrid", target)
    pvalue, bonus = bonus_path_case(target, "hybrid", mode, drafter=drafter)
    assert 0.05 * drafter.rows < drafter.suffix_rows < 0.95 * drafter.rows, (drafter.suffix_rows, drafter.rows)
    assert bonus >= 0.01 * 20000
    assert pvalue > FAMILY_ALPHA


def test_hybrid_drafter_spec_and_bad_input(target):
    from specrl.drafters import make_drafter as spec_drafter
    from specrl.drafters.kinds.hybrid import HybridDrafter
    from specrl.errors import SpecRLError

    with pytest.raises(SpecRLError, match="combines a learned drafter"):
        HybridDrafter(SuffixDrafter())
    with pytest.raises(SpecRLError, match=r"min_match.*>= 1, got 0"):
        HybridDrafter(make_small_drafter("eagle", target), min_match=0)
    with pytest.raises(SpecRLError, match="unknown drafter 'hybrid:suffix'"):
        spec_drafter("hybrid:suffix", target)


# ---------------------------------------------------------------- identities
PROMPTS = [[1, 2, 3, 1, 2], [4, 5, 6, 7, 8], [9], [10, 11, 12, 13, 10, 11], [3, 3, 3, 3], [6, 1], [1, 2, 3, 1, 2]]


@pytest.fixture(scope="module")
def target64():
    return tiny_model("llama", vocab_size=64, seed=3)


def make64(kind):
    if kind.startswith("draft-model"):
        return DraftModelDrafter(tiny_model("llama", vocab_size=64, seed=4, num_layers=1),
                                 draft_vocab=list(range(0, 64, 2)) if kind == "draft-model-subset" else None)
    return make_drafter(kind)


@pytest.mark.parametrize("cut", ["off", "row"])
@pytest.mark.parametrize("k", [1, 3, "auto"])
@pytest.mark.parametrize("kind", ["ngram", "suffix", "draft-model", "draft-model-subset"])
def test_greedy_identical_to_ar(target64, kind, k, cut):
    sp = SamplingParams(temperature=0, max_new_tokens=40)
    ar = RolloutEngine(target64, max_batch_size=3, max_seq_len=64).generate(PROMPTS, sp)
    eng = RolloutEngine(target64, max_batch_size=3, max_seq_len=64, drafter=make64(kind), num_draft_tokens=k,
                        confidence_cut=cut)
    sd = eng.generate(PROMPTS, sp)
    assert [o.token_ids for o in sd] == [o.token_ids for o in ar]


@pytest.mark.parametrize("kind", ["ngram", "suffix", "draft-model"])
def test_seed_exact_identical_to_ar_over_100k_tokens(target64, kind):
    """fp32; 600 sequences x ~200 tokens at T=1 with stop tokens and mixed lengths; k = auto."""
    prompts = [[(7 * i + j) % 64 for j in range(1 + i % 5)] for i in range(600)]
    params = [SamplingParams(temperature=1.0 if i % 3 else 0.8, top_p=1.0 if i % 4 else 0.9,
                             max_new_tokens=200 if i % 7 else 150, stop_token_ids=(63,) if i % 5 == 0 else (),
                             seed=i % 11)
              for i in range(len(prompts))]
    ar = RolloutEngine(target64, max_batch_size=256, max_seq_len=224).generate(prompts, params)
    eng = RolloutEngine(target64, max_batch_size=256, max_seq_len=224, drafter=make64(kind),
                        num_draft_tokens="auto", verify="seed_exact")
    sd = eng.generate(prompts, params)
    total = sum(len(o.token_ids) for o in ar)
    assert total >= 100_000
    mismatched = [i for i, (a, b) in enumerate(zip(ar, sd, strict=True)) if a.token_ids != b.token_ids]
    assert not mismatched, f"{len(mismatched)} sequences differ, first {mismatched[:5]}"
    assert sd.metrics["accepted_tokens"] > 0


@pytest.mark.parametrize("kind", ["ngram", "suffix", "draft-model"])
def test_spec_logprobs_equal_full_forward(target64, kind):
    eng = RolloutEngine(target64, max_batch_size=4, max_seq_len=64, drafter=make64(kind), num_draft_tokens=3)
    sp = SamplingParams(temperature=0.9, max_new_tokens=30, seed=5)
    for p, o in zip(PROMPTS, eng.generate(PROMPTS, sp), strict=True):
        seq = torch.tensor([p + o.token_ids])
        with torch.no_grad():
            logits, _ = target64(seq)
        lp = torch.log_softmax(logits[0, len(p) - 1:-1] / 0.9, -1)
        ref = lp.gather(-1, torch.tensor(o.token_ids)[:, None]).squeeze(-1)
        assert (ref - torch.tensor(o.logprobs)).abs().max() < 1e-5


@pytest.mark.parametrize("kind,mode,k", [("ngram", "rejection", 3), ("draft-model", "rejection", 2),
                                         ("suffix", "seed_exact", "auto"), ("draft-model", "seed_exact", "auto")])
def test_spec_batch_invariance(target64, kind, mode, k):
    """Same seed -> same tokens whatever else is in the batch. In rejection mode this needs a fixed k and a
    drafter that looks only at its own sequence; seed_exact is invariant always."""
    sp = SamplingParams(temperature=1.0, max_new_tokens=30, seed=9)
    full = RolloutEngine(target64, max_batch_size=7, max_seq_len=64, drafter=make64(kind), num_draft_tokens=k,
                         verify=mode).generate(PROMPTS, sp)
    for i in (1, 4):
        alone = RolloutEngine(target64, max_batch_size=1, max_seq_len=64, drafter=make64(kind), num_draft_tokens=k,
                              verify=mode).generate([RolloutRequest(PROMPTS[i], i)], sp)
        assert alone[0].token_ids == full[i].token_ids


def test_draft_model_catch_up_after_plain_streaks_keeps_its_cache_exact(target64):
    """A draft model equal to the target must have every greedy draft accepted, also right after plain (k=0)
    streaks of different lengths per sequence, which it catches up on in one ragged forward (timed apart)."""
    import copy

    drafter = DraftModelDrafter(copy.deepcopy(target64))
    eng = RolloutEngine(target64, max_batch_size=4, max_seq_len=96, drafter=drafter, num_draft_tokens="auto")
    pattern = iter([0, 0, 0, 2, 0, 3, 1, 0, 0, 0, 0, 0, 0, 0, 0, 2] * 40)
    catch_ups = []

    def choose(n, ctx):
        k = next(pattern)
        if k:
            catch_ups.append(None)
        return k

    eng.controller.choose = choose
    orig = drafter.propose

    def propose(batch, k):
        out = orig(batch, k)
        catch_ups[-1] = drafter.catch_up_seconds
        return out

    drafter.propose = propose
    prompts = [[1, 2, 3], [4, 5, 6, 7, 8, 9, 10, 11], [12], [13, 14], [15, 16, 17, 18, 19]]
    params = [SamplingParams(temperature=0, max_new_tokens=m) for m in (60, 25, 70, 40, 55)]
    sd = eng.generate(prompts, params)
    ar = RolloutEngine(target64, max_batch_size=4, max_seq_len=96).generate(prompts, params)
    assert [o.token_ids for o in sd] == [o.token_ids for o in ar]
    m = sd.metrics
    assert m["draft_tokens"] > 50 and m["accepted_tokens"] == m["draft_tokens"], m
    assert any(c > 0 for c in catch_ups) and any(c == 0 for c in catch_ups)

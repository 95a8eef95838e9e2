"""Draft length from the drafter's confidence (`specrl.rollout.spec_decode.confidence`, `confidence_cut`).

The rule on hand-made calibrated confidences (row vs padded column, ragged drafts, the keep-one fallback, the price
from auto k's cost model), the calibration table and the engine's predicted-vs-realised record; the engine with
the cut on: seed_exact and greedy emit the plain-decoding tokens, rejection sampling keeps the exact distribution
at T > 0 (chi-square in the suite's family, tests/stats.py) while rows verify 0, 1 and 2 drafts inside the tested
continuation, and a cut that reads the proposed token's own probability is caught by the same test. Bad values:
clear errors.
"""

import pytest
import torch

from specrl import RolloutEngine, SamplingParams
from specrl.drafters import DraftModelDrafter
from specrl.errors import SpecRLError
from specrl.model.transformer import tiny_model
from specrl.rollout.spec_decode.adaptive import DraftLengthController
from specrl.rollout.spec_decode.confidence import THRESHOLD, ConfidenceCut
from specrl.trainer.config_check import validate_config
from tests.stats import DIST_PROMPT, FAMILY_ALPHA, V, speculative_pvalue
from tests.test_seq_budget import eagle64, noisy_copy


# ---------------------------------------------------------------- the rule
def test_row_mode_cuts_each_row_where_its_marginal_falls_below_the_price():
    cut = ConfidenceCut("row", 4)
    c = torch.tensor([[0.9, 0.9, 0.9, 0.9], [0.5, 0.5, 0.5, 0.5], [0.2, 0.9, 0.9, 0.9]], dtype=torch.float64)
    # marginals: row 0 .9 .81 .73 .66; row 1 .5 .25 ...; row 2 .2 ...
    assert cut.lengths(c, None, 0.3).tolist() == [4, 1, 0]
    assert cut.lengths(c, None, 0.7).tolist() == [3, 0, 0]
    assert cut.lengths(c, torch.tensor([2, 4, 4]), 0.3).tolist() == [2, 1, 0]  # never past a row's real drafts


def test_column_mode_keeps_a_padded_column_while_the_rows_mean_marginal_pays():
    cut = ConfidenceCut("column", 4)
    c = torch.tensor([[0.9, 0.9, 0.9, 0.9], [0.5, 0.5, 0.5, 0.5], [0.2, 0.9, 0.9, 0.9]], dtype=torch.float64)
    # column means: (.9+.5+.2)/3=.53, (.81+.25+.18)/3=.41, (.73+.125+.16)/3=.34, (.66+.06+.15)/3=.29
    assert cut.lengths(c, None, 0.3).tolist() == [3, 3, 3]
    # a row with one real draft adds nothing to later columns but still pays for them: column 3 mean .297
    assert cut.lengths(c, torch.tensor([4, 1, 4]), 0.3).tolist() == [2, 1, 2]


def test_when_nothing_pays_every_row_keeps_its_first_draft():
    for mode in ("row", "column"):
        cut = ConfidenceCut(mode, 3)
        c = torch.full((2, 3), 0.1, dtype=torch.float64)
        assert cut.lengths(c, torch.tensor([3, 0]), 0.5).tolist() == [1, 0]


def test_price_is_the_cost_slope_times_the_gain_once_auto_k_has_measured_the_bucket():
    cut = ConfidenceCut("row", 4)
    assert cut.price(None, 8, 3) == THRESHOLD
    assert cut.price(DraftLengthController(4, 3), 8, 3) == THRESHOLD  # a fixed k measures no cost
    ctl = DraftLengthController(4, "auto")
    assert cut.price(ctl, 8, 3) == THRESHOLD  # nothing measured yet
    ctl._ratio[8] = [10.0, 30.0, 90.0, 13.0, 39.0]  # ten steps at k = 3 costing 1.3 plain steps: with the anchor
    assert ctl.cost(8, 3) - ctl.cost(8, 2) == pytest.approx(0.1)  # (k = 0, cost 1), the line 1 + 0.1 k
    gain = ctl.gain(8, 3)  # (1 + .5 + .25 + .125) / 1.3 at the prior acceptance 0.5
    assert gain == pytest.approx(1.875 / 1.3)
    assert cut.price(ctl, 8, 3) == pytest.approx(0.1 * gain)


def test_calibration_learns_per_confidence_bin_and_reports_reached_drafts():
    cut = ConfidenceCut("row", 3, prior_rate=0.5, prior_weight=1.0, forget=1.0)
    f = torch.tensor([[0.95, 0.95, 0.95], [0.15, 0.15, 0.15]], dtype=torch.float64)
    for _ in range(50):  # confident row accepts everything, the unsure one rejects its first draft
        pred, att, acc = cut.observe(f, torch.tensor([3, 3]), torch.tensor([3, 0]))
    c = cut.calibrated(f)
    assert c[0, 0] > 0.95 and c[1, 0] < 0.05
    assert att.tolist() == [2.0, 1.0, 1.0] and acc.tolist() == [1.0, 1.0, 1.0]  # row 1 reached position 0 only
    assert pred[0] == pytest.approx(float(c[0, 0] + c[1, 0]), rel=0.05)


def test_calibration_is_per_draft_position():
    """The same top probability at a deeper position is a different cell: a row that always accepts its first
    draft and rejects its second teaches c ~ 1 at position 0 and c ~ 0 at position 1."""
    cut = ConfidenceCut("row", 2, prior_rate=0.5, prior_weight=1.0, forget=1.0)
    f = torch.full((1, 2), 0.55, dtype=torch.float64)
    for _ in range(50):
        cut.observe(f, torch.tensor([2]), torch.tensor([1]))
    c = cut.calibrated(f)[0]
    assert c[0] > 0.95 and c[1] < 0.05
    assert cut.lengths(cut.calibrated(f), None, 0.3).tolist() == [1]


def test_features_are_the_top_probability_or_one_for_one_hot_drafts():
    q = torch.tensor([[[0.7, 0.3], [0.4, 0.6]]])
    assert ConfidenceCut.features(q, 1, 2).tolist() == [[pytest.approx(0.7), pytest.approx(0.6)]]
    assert ConfidenceCut.features(None, 2, 3).tolist() == [[1.0] * 3] * 2


# ---------------------------------------------------------------- bad values
@pytest.mark.parametrize("value", ["yes", True, None, "rows"])
def test_engine_confidence_cut_must_be_a_known_mode(value):
    with pytest.raises(SpecRLError, match=r"confidence_cut.*\['off', 'row', 'column'\]"):
        RolloutEngine(tiny_model("llama", vocab_size=V, seed=5, num_layers=1), max_batch_size=2, max_seq_len=16,
                      confidence_cut=value)


@pytest.mark.parametrize("kwargs,match", [({"bins": 0}, "bins must be an integer >= 1"),
                                          ({"threshold": 0.0}, "threshold must be a number in"),
                                          ({"prior_rate": 1.0}, "prior_rate must be a number in"),
                                          ({"forget": 0.0}, r"forget must be a number in \(0, 1\]"),
                                          ({"prior_weight": -1}, "prior_weight must be a number > 0")])
def test_cut_parameters_bad_values(kwargs, match):
    with pytest.raises(SpecRLError, match=match):
        ConfidenceCut("row", 3, **kwargs)
    with pytest.raises(SpecRLError, match=r"'off' means no cut"):
        ConfidenceCut("off", 3)


def test_config_confidence_cut_bad_values_and_vllm_refusal():
    with pytest.raises(SpecRLError, match=r"confidence_cut:.*off.*column.*'rows'"):
        validate_config({"speculative": {"confidence_cut": "rows"}})
    with pytest.raises(SpecRLError, match=r"speculative\.confidence_cut is native-only"):
        validate_config({"speculative": {"drafter": "ngram", "confidence_cut": "row"},
                         "rollout": {"backend": "vllm"}})
    assert validate_config({"speculative": {"confidence_cut": "column"}}).speculative.confidence_cut == "column"


# ---------------------------------------------------------------- the engine with the cut on
def spy(engine) -> list[list[int]]:
    """Record the draft lengths the cut keeps at each step."""
    seen, orig = [], engine.cut.cut

    def spied(*a):
        kept, f = orig(*a)
        seen.append(kept.tolist())
        return kept, f

    engine.cut.cut = spied
    return seen


@pytest.fixture(scope="module")
def target64():
    return tiny_model("llama", vocab_size=64, seed=3)


@pytest.mark.parametrize("mode", ["row", "column"])
@pytest.mark.parametrize("kind,k", [("draft-model", 3), ("eagle", "auto")])
def test_seed_exact_and_greedy_with_the_cut_equal_plain_decoding(target64, kind, k, mode):
    """fp32; 36 sequences of mixed lengths through 12 slots (compactions and refills), T in {0, 0.8, 1}."""
    prompts = [[(7 * i + j) % 64 for j in range(1 + i % 5)] for i in range(36)]
    params = [SamplingParams(temperature=(0.0, 0.8, 1.0)[i % 3], max_new_tokens=30 + 7 * (i % 4), seed=i % 11,
                             stop_token_ids=(63,) if i % 5 == 0 else ()) for i in range(36)]
    ar = RolloutEngine(target64, max_batch_size=12, max_seq_len=96).generate(prompts, params)
    drafter = DraftModelDrafter(noisy_copy(target64, 0.02, 11)) if kind == "draft-model" else eagle64(target64)
    eng = RolloutEngine(target64, max_batch_size=12, max_seq_len=96, drafter=drafter, num_draft_tokens=k,
                        verify="seed_exact", confidence_cut=mode)
    eng.cut.threshold = 0.3
    if k == "auto":  # auto k on this tiny model settles on plain decoding (the drafter costs as much as the target)
        pattern = iter([3, 3, 1, 0, 2, 3, 0, 3, 2, 1, 3] * 100)
        eng.controller.choose = lambda n, ctx: next(pattern)
    seen = spy(eng)
    sd = eng.generate(prompts, params)
    mismatched = [i for i, (a, b) in enumerate(zip(ar, sd, strict=True)) if a.token_ids != b.token_ids]
    assert not mismatched, f"{len(mismatched)} sequences differ, first {mismatched[:5]}"
    assert len({v for s in seen for v in s}) >= 2, "the cut never varied: the test did not exercise it"
    cal = sd.metrics["confidence_calibration"]
    assert cal["attempts"][0] > 0 and 0 <= cal["predicted"][0] <= 1 and 0 <= cal["realised"][0] <= 1
    assert sd.metrics["verify_rows"] > 0


def seeded_cut(mode: str, threshold: float) -> ConfidenceCut:
    """A cut whose table is fixed (heavy seeded counts, no forgetting) so each test sees a spread of lengths: the
    rule is the engine's, only the calibration is not learned (it stays wrong, which a lossless rule may be)."""
    cut = ConfidenceCut(mode, 2, threshold=threshold, bins=4, forget=1.0)
    cut.attempts[:] = 1e4
    cut.accepts[:] = torch.tensor([0.3, 0.6, 0.9, 0.95], dtype=torch.float64) * 1e4
    return cut


def dist_engine(kind: str, mode: str, threshold: float = 0.45):
    target = tiny_model("llama", vocab_size=V, seed=5, num_layers=2)
    if kind == "draft-model":
        drafter = DraftModelDrafter(tiny_model("llama", vocab_size=V, seed=99, num_layers=1))
    else:
        from tests.test_spec_proof import make_small_drafter

        drafter = make_small_drafter(kind, target)
    engine = RolloutEngine(target, max_batch_size=2000, max_seq_len=48, drafter=drafter, num_draft_tokens=2,
                           verify="rejection", confidence_cut=mode)
    engine.cut = seeded_cut(mode, threshold)
    return target, engine


@pytest.mark.parametrize("kind,mode,threshold", [("draft-model", "row", 0.45), ("eagle", "row", 0.65),
                                                 ("draft-model", "column", 0.4)])
def test_rejection_with_the_cut_keeps_the_exact_distribution(kind, mode, threshold):
    """Continuations of 4 tokens at T=1, k=2: the prefill emits one, so the following steps' cuts (0, 1 or 2
    drafts per row, from the drafter's q at those positions; per step in column mode) are all inside the tested
    continuation."""
    target, engine = dist_engine(kind, mode, threshold)
    seen = spy(engine)
    sp = SamplingParams(max_new_tokens=4, seed=777, temperature=1.0)
    pvalue = speculative_pvalue(engine, target, sp, DIST_PROMPT)
    values = {v for s in seen for v in s}
    assert ({0, 1, 2} if mode == "row" else {1, 2}) <= values, values
    assert pvalue > FAMILY_ALPHA


def test_a_cut_on_the_proposed_tokens_own_probability_is_caught():
    """The test above has the power to see a lossy cut: dropping draft j when q_j(x_j) is low (the proposed token's
    own probability, which the lossless rule never reads) biases the output, and the chi-square test fails."""
    target, engine = dist_engine("draft-model", "row")
    real = engine.cut.cut

    def lossy(probs, nd, n, k, controller):
        _, f = real(probs, nd, n, k, controller)
        own = probs[:, :k].gather(-1, engine._last_tokens[:, :k, None])[..., 0]
        return (own >= 0.3).long().cumprod(1).sum(1), f

    orig_propose = engine.drafter.propose

    def remember(batch, k):
        p = orig_propose(batch, k)
        engine._last_tokens = p.tokens
        return p

    engine.drafter.propose = remember
    engine.cut.cut = lossy
    sp = SamplingParams(max_new_tokens=4, seed=777, temperature=1.0)
    assert speculative_pvalue(engine, target, sp, DIST_PROMPT) < FAMILY_ALPHA


@pytest.mark.parametrize("cut", ["off", "row", "column"])
def test_config_reaches_the_engine_through_the_backend_registry(cut):
    from specrl.backends.registry import native_backend

    cfg = validate_config({"speculative": {"drafter": "ngram", "confidence_cut": cut},
                           "model": {"rollout_dtype": "float32", "max_seq_len": 64},
                           "generation": {"max_new_tokens": 16, "max_batch_size": 4}})
    engine = native_backend(cfg, tiny_model("llama", vocab_size=V, seed=5, num_layers=1))
    assert (engine.cut is None) if cut == "off" else (engine.cut.mode == cut)


def test_calibration_and_verify_rows_survive_merging_metrics():
    from specrl.rollout.generation_metrics import SpecMetrics, merge_metrics

    m = SpecMetrics(3)
    m.record_spec(2, torch.tensor([2, 0]), torch.tensor([3, 1]), 0.1, 0.2, num_drafts=torch.tensor([2, 1]))
    m.record_confidence(*(torch.tensor(x, dtype=torch.float64) for x in ([1.5, 0.8], [2.0, 1.0], [1.0, 1.0])))
    d = m.as_dict()
    assert d["verify_rows"] == 6 and d["confidence_calibration"]["predicted"][:2] == [0.75, 0.8]
    assert d["confidence_calibration"]["realised"][:3] == [0.5, 1.0, None]
    merged = merge_metrics([d, d])
    assert merged["verify_rows"] == 12
    assert merged["confidence_calibration"]["attempts"] == [4.0, 2.0, 0.0]
    assert merged["confidence_calibration"]["predicted"][:2] == [0.75, 0.8]

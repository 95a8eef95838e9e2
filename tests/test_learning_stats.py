"""Learning with its uncertainty: reward curves with standard errors, the reward signal, held-out accuracy and the
TOST equivalence test (pure functions of records)."""

import math

import pytest
import torch

from specrl.algorithms.grpo import group_signal
from specrl.errors import SpecRLError
from specrl.observability import learning
from specrl.observability.step_record import StepRecord


def rec(step, rewards, correct, groups=None, nonzero=None):
    t = torch.tensor(rewards)
    return StepRecord(step=step, reward_mean=float(t.mean()), reward_std=float(t.std()),
                      response_lengths=[5] * len(rewards), train_accuracy=sum(correct) / len(correct),
                      groups=groups, groups_nonzero_advantage=nonzero)


def test_group_signal_counts_groups_whose_rewards_differ():
    r = torch.tensor([1.0, 0, 0, 0, 1, 1, 1, 1, 0, 0, 0, 0])
    assert group_signal(r, 4) == {"groups": 3, "groups_nonzero_advantage": 1}
    assert group_signal(r, 4, {"groups_trained": 2, "groups_filtered": 5}) == \
        {"groups": 7, "groups_nonzero_advantage": 2}
    with pytest.raises(SpecRLError, match=r"\b12 rewards.*\b5$"):
        group_signal(r, 5)


def test_reward_curve_standard_error_is_std_over_root_n():
    pts = learning.reward_curve([rec(1, [1.0, 0, 0, 1], [1, 0, 0, 1])])
    assert pts[0]["mean"] == 0.5 and pts[0]["n"] == 4
    assert pts[0]["se"] == pytest.approx(float(torch.tensor([1.0, 0, 0, 1]).std()) / 2)


def test_signal_reads_step0_success_and_the_nonzero_advantage_share():
    recs = [rec(1, [1.0, 0, 0, 0], [1, 0, 0, 0], 1, 1), rec(2, [0.0] * 4, [0] * 4, 1, 0),
            rec(3, [1.0, 1, 0, 0], [1, 1, 0, 0], 1, 1)]
    s = learning.signal(recs)
    assert s["step0_success_rate"] == 0.25 and s["step0_completions"] == 4 and s["step0_prompts"] == 1
    assert s["step0_success_rate_se"] == pytest.approx(math.sqrt(0.25 * 0.75 / 4))
    assert (s["groups"], s["groups_nonzero_advantage"], s["steps_with_signal"]) == (3, 2, 2)
    assert s["nonzero_advantage_share"] == pytest.approx(2 / 3)
    assert [x["nonzero"] for x in s["nonzero_advantage_per_step"]] == [1, 0, 1]
    assert learning.signal([])["step0_success_rate"] is None


def test_learning_line_has_standard_errors_from_the_question_count():
    val = [{"step": 0, "accuracy": 0.25, "val_questions": 16}, {"step": 6, "accuracy": 0.5, "val_questions": 16}]
    line = learning.learning_line(val)
    assert line["first"]["se"] == pytest.approx(math.sqrt(0.25 * 0.75 / 16))
    assert line["last"]["se"] == pytest.approx(0.125)
    assert line["change"] == 0.25
    assert learning.learning_line([{"step": 0, "accuracy": 0.5}], default_n=4)["first"]["se"] == 0.25
    assert learning.learning_line([]) is None


def test_tost_two_proportions():
    eq = learning.tost_two_proportions(60, 128, 62, 128, margin=0.15)
    assert eq["equivalent"] and eq["p_value"] < 0.05 and -0.15 < eq["ci"][0] < eq["ci"][1] < 0.15
    assert eq["ci_level"] == pytest.approx(0.9)
    # a 1.645-sigma one-sided bound: the CI matches diff ± z * se
    assert eq["ci"][1] - eq["difference"] == pytest.approx(1.6448536 * eq["se"], rel=1e-6)
    far = learning.tost_two_proportions(20, 128, 70, 128, margin=0.15)
    assert not far["equivalent"] and far["p_value"] > 0.5
    small = learning.tost_two_proportions(2, 16, 3, 16, margin=0.15)
    assert not small["equivalent"]  # 16 questions cannot show equivalence within 15 points
    assert learning.tost_two_proportions(0, 8, 0, 8)["equivalent"]  # exact: both 0
    with pytest.raises(SpecRLError, match=r"TOST.*0 <= successes <= trials"):
        learning.tost_two_proportions(9, 8, 0, 8)
    with pytest.raises(SpecRLError, match="0 < margin < 1"):
        learning.tost_two_proportions(1, 8, 1, 8, margin=0)


def test_final_equivalence_uses_the_last_evaluation_of_each_arm():
    val = {"speculative": [{"step": 0, "accuracy": 0.1, "val_questions": 100},
                           {"step": 60, "accuracy": 0.5, "val_questions": 100}],
           "autoregressive": [{"step": 0, "accuracy": 0.1, "val_questions": 100},
                              {"step": 60, "accuracy": 0.48, "val_questions": 100}]}
    eq = learning.final_equivalence(val)
    assert eq["step"] == 60 and (eq["p1"], eq["p2"]) == (0.5, 0.48) and eq["n1"] == 100
    assert learning.final_equivalence({"speculative": val["speculative"]}) is None


def test_proportion_se_rejects_bad_input():
    with pytest.raises(SpecRLError, match=r"n >= 1.*\bn=0\b"):
        learning.proportion_se(0.5, 0)


def test_tost_runs_matches_scipy_welch_tests():
    from scipy.stats import ttest_ind

    a, b, m = [0.64, 0.82, 0.71, 0.77], [0.91, 0.70, 0.85], 0.15
    t = learning.tost_runs(a, b, margin=m)
    lower = ttest_ind([x + m for x in a], b, equal_var=False, alternative="greater").pvalue
    upper = ttest_ind([x - m for x in a], b, equal_var=False, alternative="less").pvalue
    assert t["p_value"] == pytest.approx(max(lower, upper), rel=1e-9)
    assert t["difference_p_value"] == pytest.approx(ttest_ind(a, b, equal_var=False).pvalue, rel=1e-9)
    assert (t["n_a"], t["n_b"]) == (4, 3) and t["difference"] == pytest.approx(sum(a) / 4 - sum(b) / 3)
    assert not t["equivalent"]  # 3-4 runs this far apart cannot show equivalence within 15 points
    close = learning.tost_runs([0.80, 0.82, 0.81, 0.79], [0.81, 0.80, 0.83, 0.80], margin=m)
    assert close["equivalent"] and close["difference_p_value"] > 0.3 and -m < close["ci"][0] < close["ci"][1] < m
    # no spread at all: the difference is exact
    assert learning.tost_runs([0.5, 0.5], [0.5, 0.5])["equivalent"]
    apart = learning.tost_runs([0.9, 0.9], [0.5, 0.5])
    assert not apart["equivalent"] and apart["difference_p_value"] == 0.0


def test_tost_runs_rejects_bad_input():
    with pytest.raises(SpecRLError, match=r"got 1 and 3"):
        learning.tost_runs([0.5], [0.5, 0.6, 0.7])
    with pytest.raises(SpecRLError, match=r"accuracies in \[0, 1\]"):
        learning.tost_runs([0.5, 1.5], [0.5, 0.6])
    with pytest.raises(SpecRLError, match="0 < margin < 1"):
        learning.tost_runs([0.5, 0.6], [0.5, 0.6], margin=1.5)

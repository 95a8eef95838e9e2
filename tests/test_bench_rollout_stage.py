"""benchmarks/rollout_stage.py's pieces: the per-token ratio over all groups, and bad arguments refused before
anything loads."""

import pytest

from tests.bench import load_benchmark


@pytest.fixture(scope="module")
def rs():
    return load_benchmark("rollout_stage", "bench_rollout_stage")


def test_the_ratio_is_tokens_per_second_over_all_groups_of_each_arm(rs):
    groups = [{"arm": "autoregressive", "seconds": 10.0, "tokens": 500},
              {"arm": "speculative", "seconds": 8.0, "tokens": 600},
              {"arm": "autoregressive", "seconds": 30.0, "tokens": 1500},
              {"arm": "speculative", "seconds": 12.0, "tokens": 400}]
    r = rs.ratio(groups)
    assert r["autoregressive_tokens_per_second"] == pytest.approx(50.0)
    assert r["speculative_tokens_per_second"] == pytest.approx(50.0)
    assert r["speedup_per_token"] == pytest.approx(1.0)  # not the mean of the groups' ratios (1.5 and 0.67)
    with pytest.raises(ValueError, match="speculative"):
        rs.ratio(groups[:1])


def test_bad_arguments_are_refused_before_anything_loads(rs):
    for argv in (["--groups", "0"], ["--threads", "0"]):
        with pytest.raises(SystemExit, match="--groups >= 1"):
            rs.main(argv)


def test_a_config_without_a_drafter_is_refused_before_the_model_loads(rs):
    with pytest.raises(SystemExit, match=r"speculative\.drafter is none"):
        rs.main(["--set", "speculative.drafter=none", "--groups", "1"])


def test_a_further_arm_is_divided_by_the_autoregressive_arm(rs):
    groups = [{"arm": "autoregressive", "seconds": 10.0, "tokens": 500},
              {"arm": "speculative", "seconds": 8.0, "tokens": 600},
              {"arm": "speculative_drafter_bfloat16", "seconds": 10.0, "tokens": 600}]
    r = rs.ratio(groups)
    assert r["speculative_drafter_bfloat16_speedup_per_token"] == pytest.approx(1.2)
    assert r["speedup_per_token"] == pytest.approx(1.5)
    with pytest.raises(SystemExit):
        rs.main(["--drafter-dtype", "float16"])


def test_a_drafter_dtype_arm_needs_the_native_backend(rs):
    with pytest.raises(SystemExit, match="rollout.backend=native"):
        rs.main(["--drafter-dtype", "bfloat16", "--set", "rollout.backend=vllm", "--set",
                 "speculative.num_draft_tokens=3", "--groups", "1"])

"""benchmarks/sequence_law.py's pieces: candidate parsing (with a clear error) and the homogeneity test."""

import pytest

from tests.bench import load_benchmark


@pytest.fixture(scope="module")
def sl():
    return load_benchmark("sequence_law", "bench_sequence_law")


def test_candidates_parse_and_a_malformed_one_is_refused(sl):
    assert sl.parse_candidate("plain:speculative.drafter=none") == ("plain", ["speculative.drafter=none"])
    assert sl.parse_candidate("spec:") == ("spec", [])
    for bad in ("plain", ":x=1", "k3:num_draft_tokens"):
        with pytest.raises(SystemExit, match="NAME:KEY=VALUE"):
            sl.parse_candidate(bad)
    with pytest.raises(SystemExit, match=r"'num_draft_tokens' is not KEY=VALUE"):
        sl.parse_candidate("k3:a=1,num_draft_tokens")
    # one parser for the scripts that compare configs
    assert load_benchmark("task_difficulty", "bench_task_difficulty").parse_candidate is sl.parse_candidate


def test_homogeneity_tells_equal_bin_counts_from_shifted_ones(sl):
    even = [1000] * 10
    assert sl.homogeneity([even, [1010, 990] * 5]) > 0.5
    assert sl.homogeneity([even, [1300] * 5 + [700] * 5]) < 1e-10


def test_bad_sizes_are_refused_before_anything_loads(sl):
    for argv in (["--prompts", "0"], ["--group", "1"], ["--tokens", "1"], ["--threads", "0"]):
        with pytest.raises(SystemExit, match="--group >= 2"):
            sl.main(argv)

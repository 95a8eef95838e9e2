"""benchmarks/micro_batch.py: bad --micro, --lengths and counts are refused, naming the flag, before anything
loads."""

import pytest

from tests.bench import load_benchmark


@pytest.fixture(scope="module")
def mb():
    return load_benchmark("micro_batch", "bench_micro_batch")


@pytest.mark.parametrize(("argv", "flag"), [
    (["--micro", "1,x"], "--micro"), (["--micro", "0,8"], "--micro"), (["--micro", "8,8"], "--micro"),
    (["--lengths", "50"], "--lengths"), (["--lengths", "256,50"], "--lengths"), (["--lengths", "0,5"], "--lengths"),
    (["--repeats", "0"], "--repeats"), (["--group", "0"], "--group"),
])
def test_bad_arguments_are_refused_naming_the_flag(mb, capsys, argv, flag):
    with pytest.raises(SystemExit) as e:
        mb.main(argv)
    assert e.value.code == 2
    assert flag in capsys.readouterr().err


def test_sizes_and_span_parse_good_input(mb):
    assert mb.sizes("1,2,8") == [1, 2, 8]
    assert mb.span("50,256") == (50, 256)


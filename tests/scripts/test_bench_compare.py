"""scripts/bench_compare.py: the false-difference rate of the comparison's intervals."""

from helpers import load_script


def test_the_widened_interval_calls_equal_drafters_different_less_often_than_the_plain_one():
    bench = load_script("bench_compare")
    widened = bench.false_difference_rate(8, 200, resamples=500)
    plain = bench.false_difference_rate(8, 200, resamples=500, widen=False)
    assert widened <= 0.10 < plain

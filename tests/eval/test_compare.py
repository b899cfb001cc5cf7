"""Paired speed ratios and their bootstrap intervals (eval/compare.py)."""

import numpy as np
import pytest

from eval.compare import UNDECIDED, Timings, compare, speed_ratio, tau_counts, verdict


def timings(seconds, tokens=64.0):
    seconds = np.asarray(seconds, dtype=float)
    return Timings(np.full_like(seconds, tokens), seconds)


def test_the_ratio_is_tokens_per_second_pooled_over_repeats_and_prompts():
    a = Timings(np.array([[10.0, 30.0], [10.0, 30.0], [10.0, 30.0]]), np.array([[1.0, 1.0], [2.0, 2.0], [1.0, 3.0]]))
    b = timings([[2.0, 2.0], [2.0, 2.0], [1.0, 1.0]], tokens=20.0)
    assert compare(a, b, ["c", "c"]).ratio == pytest.approx((120 / 10) / (120 / 10))
    # a resample that drew prompt 0 twice: A 60 tokens in 8 s, B 120 tokens in 10 s
    assert speed_ratio(a, b, np.array([[0, 0]]))[0] == pytest.approx((60 / 8) / (120 / 10))


def test_ratios_compose_so_the_fastest_is_never_slower_than_another():
    rng = np.random.default_rng(2)
    a, b, c = (Timings(rng.integers(20, 64, size=(3, 6)).astype(float), rng.uniform(0.2, 1.0, size=(3, 6)))
               for _ in range(3))
    strata = ["x"] * 6
    assert compare(a, c, strata).ratio == pytest.approx(compare(a, b, strata).ratio * compare(b, c, strata).ratio)


def test_identical_runs_tie_exactly_and_a_uniform_factor_is_certain():
    rng = np.random.default_rng(0)
    b = timings(rng.uniform(0.5, 2.0, size=(3, 8)))
    same = compare(b, b, ["c"] * 8)
    assert (same.ratio, same.interval, same.verdict) == (1.0, [1.0, 1.0], "tied")
    twice = timings(b.seconds / 2)  # A takes half the time on every prompt of every repeat
    faster = compare(twice, b, ["c"] * 8)
    assert faster.ratio == pytest.approx(2.0) and faster.interval == pytest.approx([2.0, 2.0])
    assert faster.verdict == "faster" and compare(b, twice, ["c"] * 8).verdict == "slower"


def test_a_lead_that_depends_on_the_prompt_is_a_tie():
    b = timings(np.ones((3, 8)))
    a = timings(np.tile([0.5, 2.0, 0.6, 1.8, 0.55, 1.9, 0.7, 1.3], (3, 1)))  # twice as fast on some, half on others
    result = compare(a, b, ["c"] * 8)
    assert result.verdict == "tied" and result.low < 1 < result.high
    assert result.low <= result.ratio <= result.high


def test_categories_are_resampled_apart_so_the_mix_is_kept():
    # Within each category every prompt has the same ratio; only the mix of categories could move it.
    b = timings(np.ones((2, 6)))
    a = timings(np.tile([0.5, 0.5, 0.5, 2.0, 2.0, 2.0], (2, 1)))
    strata = ["code"] * 3 + ["json"] * 3
    kept = compare(a, b, strata)
    assert kept.interval == pytest.approx([kept.ratio, kept.ratio])
    pooled = compare(a, b, ["all"] * 6)  # resampled as one group, the mix itself varies
    assert pooled.high - pooled.low > 0.5


def test_one_prompt_in_a_category_gives_no_interval():
    a, b = timings(np.ones((3, 3))), timings(np.full((3, 3), 2.0))
    result = compare(a, b, ["code", "code", "json"])
    assert result.ratio == pytest.approx(2.0) and result.interval is None and result.verdict == "too few prompts"


def test_mismatched_timings_are_errors():
    with pytest.raises(ValueError, match="different shapes"):
        compare(timings(np.ones((3, 4))), timings(np.ones((2, 4))), ["c"] * 4)
    with pytest.raises(ValueError, match="3 categories for 4 prompts"):
        compare(timings(np.ones((3, 4))), timings(np.ones((3, 4))), ["c"] * 3)


def test_equal_drafters_are_called_different_about_as_often_as_the_level_allows():
    # A and B drawn from the same distribution: prompts of varying length, timing noise per run. A 95 %
    # interval should exclude 1 in about 5 % of such measurements, and an interval that never excludes 1
    # would be useless (scripts/bench_compare.py measures the rate on 400 measurements).
    rng = np.random.default_rng(1)
    wrong = 0
    trials = 200
    for _ in range(trials):
        length = rng.uniform(0.5, 2.0, size=20)  # seconds a prompt takes, the same for A and B
        noisy = lambda: timings(length * rng.lognormal(0.0, 0.15, size=(3, 20)))  # noqa: E731
        wrong += compare(noisy(), noisy(), ["c"] * 20, resamples=1000).verdict != "tied"
    assert 0.01 <= wrong / trials <= 0.12


def test_the_verdict_is_undecided_where_the_interval_holds_one():
    """The case a user met: 2.19× with an interval of 0.00–190.45 is no verdict."""
    assert verdict(2.19, [0.0, 190.45], 1.05) == UNDECIDED
    assert verdict(0.5, None, 1.05) == UNDECIDED  # one prompt: no interval
    assert verdict(1.0, [1.0, 1.0], 1.05) == UNDECIDED
    assert verdict(1.30, [1.10, 1.50], 1.05) == "pays off"
    assert verdict(1.03, [1.01, 1.05], 1.05) == "turn it off"  # surely faster, but below the bar
    assert verdict(0.70, [0.60, 0.90], 1.05) == "turn it off"


def test_tau_counts_compare_as_the_ratio_of_two_drafters_tau():
    """τ = 1 + kept guesses per round, pooled over prompts and repeats: compare() of two drafters' rounds and kept
    guesses is the ratio of their τ, with an interval over prompts that excludes 1 only where the lead holds on
    every prompt."""
    rounds_a, kept_a = np.array([[10, 20, 10, 5]]), np.array([[20, 30, 15, 10]])  # τ (65 + 45) / 45
    rounds_b, kept_b = np.array([[15, 30, 12, 8]]), np.array([[15, 20, 12, 8]])  # τ (65 + 55) / 65
    ratio = compare(tau_counts(rounds_a, kept_a), tau_counts(rounds_b, kept_b), ["c"] * 4)
    assert ratio.ratio == pytest.approx(((45 + 75) / 45) / ((65 + 55) / 65))
    assert ratio.verdict == "faster" and ratio.low > 1  # A keeps more on every prompt
    mixed = compare(tau_counts([[10, 10, 10, 10]], [[30, 0, 30, 0]]), tau_counts([[10] * 4], [[10] * 4]), ["c"] * 4)
    assert mixed.ratio == pytest.approx(2.5 / 2.0) and mixed.verdict == "tied"

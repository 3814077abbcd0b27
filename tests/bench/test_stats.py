"""The bench's interval for a median, against exact binomial sums and by
property; quantile bounds read off histogram buckets."""

from __future__ import annotations

import math
import random
import statistics

import pytest
from hypothesis import given
from hypothesis import strategies as st

from kvconn.bench.stats import MedianInterval, bucket_bound, median_interval


def test_nine_pairs_give_the_second_to_eighth_of_them() -> None:
    xs = [0.91, 0.84, 0.99, 1.02, 0.88, 0.95, 0.97, 0.93, 1.10]
    iv = median_interval(xs)
    # P(B(9, 1/2) <= 1) = 10/512: the 2nd and 8th order statistics hold the median with 1 - 20/512
    assert (iv.low, iv.high) == (0.88, 1.02)
    assert iv.confidence == pytest.approx(1 - 20 / 512)


def test_too_few_samples_give_the_widest_interval_and_say_how_sure() -> None:
    iv = median_interval([3.0, 1.0, 2.0, 5.0, 4.0])
    assert (iv.low, iv.high) == (1.0, 5.0)
    assert iv.confidence == pytest.approx(1 - 2 / 32)  # below the 95% asked for
    assert median_interval([7.0]) == MedianInterval(7.0, 7.0, 0.0)
    with pytest.raises(ValueError, match="no samples"):
        median_interval([])


def test_verdicts() -> None:
    assert MedianInterval(0.96, 1.10, 0.96).verdict(0.95) == "met"
    assert MedianInterval(0.95, 1.10, 0.96).verdict(0.95) == "met"
    assert MedianInterval(0.80, 0.94, 0.96).verdict(0.95) == "missed"
    assert MedianInterval(0.90, 1.01, 0.96).verdict(0.95) == "unclear"


@given(st.lists(st.floats(0.1, 10.0), min_size=1, max_size=40), st.sampled_from([0.5, 0.9, 0.95, 0.99]))
def test_interval_holds_the_sample_median_and_is_as_sure_as_asked(xs: list[float], level: float) -> None:
    iv = median_interval(xs, level)
    assert iv.low <= statistics.median(xs) <= iv.high
    assert iv.low in xs and iv.high in xs
    widest = median_interval(xs, 1.0)
    assert (widest.low, widest.high) == (min(xs), max(xs))
    assert iv.confidence >= level or (iv.low, iv.high) == (min(xs), max(xs))


def test_coverage_is_what_it_claims() -> None:
    """Draw 9 samples of a skewed distribution with a known median, many times:
    the interval holds the true median about as often as it claims."""
    rng = random.Random(7)
    true_median = 1.0  # of exp(N(0, 1)): e**0
    hits = trials = 0
    for _ in range(4000):
        iv = median_interval([rng.lognormvariate(0.0, 1.0) for _ in range(9)])
        hits += iv.low <= true_median <= iv.high
        trials += 1
    assert hits / trials == pytest.approx(1 - 20 / 512, abs=0.015)


def test_bucket_bound_is_the_first_bound_enough_observations_are_under() -> None:
    buckets = [(1.0, 2.0), (2.0, 5.0), (5.0, 10.0), (math.inf, 10.0)]
    assert bucket_bound(buckets, 0.5) == 2.0  # 5 of 10 at most 2
    assert bucket_bound(buckets, 0.51) == 5.0
    assert bucket_bound(buckets, 0.99) == 5.0
    assert bucket_bound([(1.0, 0.0), (math.inf, 3.0)], 0.5) == math.inf
    assert bucket_bound([(1.0, 0.0), (math.inf, 0.0)], 0.5) is None
    assert bucket_bound([], 0.5) is None
    with pytest.raises(ValueError, match="within"):
        bucket_bound(buckets, 1.5)


BOUNDS = (1e-4, 1e-3, 1e-2, 0.1, 1.0, math.inf)


@given(
    st.lists(st.floats(min_value=0.0, max_value=5.0), min_size=1, max_size=200),
    st.floats(min_value=0.01, max_value=1.0),
)
def test_bucket_bound_bounds_the_quantile_tightly(xs: list[float], q: float) -> None:
    """At least q of the observations are under the bound, and fewer than q
    under the bucket bound before it: the tightest bound the buckets allow."""
    buckets = [(b, float(sum(x <= b for x in xs))) for b in BOUNDS]
    bound = bucket_bound(buckets, q)
    assert bound is not None
    assert sum(x <= bound for x in xs) >= q * len(xs)
    below = [b for b in BOUNDS if b < bound]
    if below:
        assert sum(x <= below[-1] for x in xs) < q * len(xs)

"""How sure a benchmark's verdict is.

On a shared VM, one bench run's median ratio swings by 10-30% with the
hypervisor's steal; a target judged from it alone flips between runs. So the
verdict also comes with a distribution-free confidence interval for the
median: the order statistics ``x(k) <= median <= x(n + 1 - k)`` hold with
probability ``1 - 2 * P(Binomial(n, 1/2) < k)`` whatever the distribution,
for independent samples (the bench alternates which side runs first, so slow
drift hits both sides of a pair alike).
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Sequence

import attrs


@attrs.frozen
class MedianInterval:
    low: float
    high: float
    #: The probability that the interval holds the median (at least the
    #: level asked for, when there are enough samples; else the widest's).
    confidence: float

    def verdict(self, target: float) -> str:
        """``met`` (the whole interval is at or above ``target``), ``missed``
        (all of it below) or ``unclear``: measure more, or on a quieter machine."""
        if self.low >= target:
            return "met"
        if self.high < target:
            return "missed"
        return "unclear"


def median_interval(samples: Sequence[float], level: float = 0.95) -> MedianInterval:
    """The narrowest order-statistics interval holding the median with
    probability >= ``level``; with too few samples for that, the widest (the
    minimum to the maximum) and its lower confidence."""
    xs = sorted(samples)
    n = len(xs)
    if n == 0:
        raise ValueError("no samples")
    k = 1
    while 2 * (k + 1) <= n + 1 and _coverage(n, k + 1) >= level:
        k += 1
    return MedianInterval(xs[k - 1], xs[n - k], _coverage(n, k))


def _coverage(n: int, k: int) -> float:
    """P(x(k) <= median <= x(n + 1 - k)) for n independent samples."""
    below: float = sum(math.comb(n, i) for i in range(k)) / 2**n
    return max(0.0, 1.0 - 2.0 * below)


def bucket_bound(buckets: Sequence[tuple[float, float]], q: float) -> float | None:
    """An upper bound for the ``q``-quantile (0 to 1) of a histogram's
    observations: the smallest bucket bound that at least ``q`` of them are
    under, from its cumulative buckets ``(upper bound, count)`` in order
    (``inf`` when only the ``+Inf`` bucket reaches). A bound, not an estimate:
    interpolating inside buckets 3x wide would invent a tail. ``None``
    without observations."""
    if not 0.0 <= q <= 1.0:
        raise ValueError(f"q must be within [0, 1], got {q}")
    if not buckets or buckets[-1][1] <= 0:
        return None
    wanted = q * buckets[-1][1]
    return next(upper for upper, count in buckets if count >= wanted)


def stats(xs: Sequence[float]) -> dict[str, float]:
    """Count, median, 99th percentile (interpolated between the two nearest
    observations), maximum and mean; zeros without observations."""
    if not xs:
        return {"n": 0, "p50": 0.0, "p99": 0.0, "max": 0.0, "mean": 0.0}
    cuts = statistics.quantiles(xs, n=100, method="inclusive") if len(xs) > 1 else [xs[0]] * 99
    return {"n": len(xs), "p50": cuts[49], "p99": cuts[98], "max": max(xs), "mean": statistics.fmean(xs)}


def ratio(x: float, base: float) -> float | None:
    """``x / base``; None where ``base`` is 0 (nothing to compare with)."""
    return x / base if base else None

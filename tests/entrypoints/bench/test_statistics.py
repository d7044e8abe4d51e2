"""The statistics ``disagg-serve bench`` and bench/ share."""

from __future__ import annotations

import math

from entrypoints.bench.statistics import median, percentile, ratio, summarize


def test_statistics_helpers() -> None:
    assert percentile([1.0, 2.0, 3.0, 4.0], 50) == 2.5
    assert math.isnan(percentile([], 99))
    assert summarize([5.0])["p99"] == 5.0


def test_ratio_is_nan_under_a_zero_denominator_and_median_is_the_50th_percentile() -> None:
    assert ratio(3.0, 2.0) == 1.5
    assert math.isnan(ratio(1.0, 0.0)) and math.isnan(ratio(1.0, -1.0))
    assert median([3.0, 1.0, 2.0]) == 2.0

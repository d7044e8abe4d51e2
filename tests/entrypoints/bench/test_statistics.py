"""The statistics bench/ shares."""

from __future__ import annotations

import math

from entrypoints.bench.statistics import percentile, summarize


def test_statistics_helpers() -> None:
    assert percentile([1.0, 2.0, 3.0, 4.0], 50) == 2.5
    assert math.isnan(percentile([], 99))
    assert summarize([5.0])["p99"] == 5.0

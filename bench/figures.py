"""The statistics every benchmark computes: the packaged load generator's (``disagg-serve bench``), re-exported for
bench/'s modules, and the two they add."""

from __future__ import annotations

import math
from collections.abc import Sequence

from entrypoints.bench.statistics import finite as finite
from entrypoints.bench.statistics import percentile as percentile
from entrypoints.bench.statistics import summarize as summarize


def ratio(numerator: float, denominator: float) -> float:
    """numerator / denominator, NaN when the denominator is not positive (e.g. under one 10 ms CPU tick)."""
    return numerator / denominator if denominator > 0 else math.nan


def median(values: Sequence[float]) -> float:
    return percentile(values, 50)

"""A smoke run of ``bench.response_store``: both stores measured at a tiny size, every figure well formed."""

from __future__ import annotations

import math

from bench import response_store


def test_both_stores_are_measured_and_tabled() -> None:
    result = response_store.run((256, 4_096), calls=3, resident=5)
    assert result["redis_skipped"] is None  # scripts/test installs redis-server: the Redis column is measured
    assert set(result["stores"]) == {"memory", "redis"}
    for by_size in result["stores"].values():
        for size in (256, 4_096):
            for op in ("put", "get"):
                figures = by_size[size][op]
                assert all(math.isfinite(v) and v > 0 for v in figures.values())
                assert figures["p99_ms"] >= figures["p50_ms"]
    text = response_store.table(result)
    assert "| 4,096 B | redis |" in text and "| 256 B | memory |" in text

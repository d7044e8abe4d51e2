"""LoopLagMonitor records how late its timer fires: a blocked loop shows up as lag."""

from __future__ import annotations

import asyncio
import time

from frontend.loop_monitor import LoopLagMonitor
from frontend.metrics import Metrics


async def test_a_blocked_loop_is_recorded_as_lag() -> None:
    metrics = Metrics()
    monitor = LoopLagMonitor(metrics.event_loop_lag, interval_s=0.01)
    monitor.start()
    try:
        await asyncio.sleep(0.05)
        time.sleep(0.2)  # noqa: ASYNC251 - blocking the loop on purpose, as a CPU-bound handler would
        await asyncio.sleep(0.05)
    finally:
        await monitor.stop()
    registry = metrics.registry
    assert (registry.get_sample_value("disagg_event_loop_lag_seconds_count") or 0) >= 3
    slow = registry.get_sample_value("disagg_event_loop_lag_seconds_bucket", {"le": "0.1"}) or 0
    total = registry.get_sample_value("disagg_event_loop_lag_seconds_count") or 0
    assert total - slow >= 1  # at least one observation above 100 ms: the blocked stretch

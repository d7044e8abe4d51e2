"""LoopLagMonitor records how late its timer fires: a blocked loop shows up as lag."""

from __future__ import annotations

import functools
import time

from frontend.loop_monitor import LoopLagMonitor
from frontend.metrics import Metrics
from tests.waiting import eventually_async


async def test_a_blocked_loop_is_recorded_as_lag() -> None:
    metrics = Metrics()
    registry = metrics.registry

    def observations() -> float:
        return registry.get_sample_value("disagg_event_loop_lag_seconds_count") or 0

    monitor = LoopLagMonitor(metrics.event_loop_lag, interval_s=0.01)
    monitor.start()
    try:
        assert await eventually_async(lambda: observations() >= 1)
        # Block the loop on purpose, as a CPU-bound handler would: the monitor's timer is then at least
        # 200 - 10 ms late, however busy the machine.
        time.sleep(0.2)  # noqa: ASYNC251
        seen = observations()
        assert await eventually_async(lambda: observations() >= seen + 2)
    finally:
        await monitor.stop()
    slow = registry.get_sample_value("disagg_event_loop_lag_seconds_bucket", {"le": "0.1"}) or 0
    assert observations() - slow >= 1  # at least one observation above 100 ms: the blocked stretch


async def test_an_idle_process_ticks_at_the_idle_interval_and_a_busy_one_at_the_short_one() -> None:
    # Each case can only record anything if the monitor chose the interval that is short here (the other is an hour).
    for idle, interval_s, idle_interval_s in ((True, 3600.0, 0.01), (False, 0.01, 3600.0)):
        metrics = Metrics()
        monitor = LoopLagMonitor(metrics.event_loop_lag, interval_s=interval_s, is_idle=functools.partial(bool, idle),
                                 idle_interval_s=idle_interval_s)
        monitor.start()
        try:
            assert await eventually_async(functools.partial(_observed_twice, metrics))
        finally:
            await monitor.stop()


def _observed_twice(metrics: Metrics) -> bool:
    return (metrics.registry.get_sample_value("disagg_event_loop_lag_seconds_count") or 0) >= 2

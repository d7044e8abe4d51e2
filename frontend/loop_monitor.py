"""Event-loop lag, measured from inside: a task that sleeps a fixed interval and records how late it woke.

A Python front end is one event loop; when it is saturated, every request waits for it. The lag histogram
(``disagg_event_loop_lag_seconds``) shows that directly, without an outside prober.
"""

from __future__ import annotations

import asyncio

from prometheus_client import Histogram

from frontend.background import BackgroundLoop

INTERVAL_S = 0.05


class LoopLagMonitor(BackgroundLoop):
    task_name = "loop-lag-monitor"

    def __init__(self, histogram: Histogram, interval_s: float = INTERVAL_S) -> None:
        self.histogram = histogram
        self.interval_s = interval_s

    async def _run(self) -> None:
        loop = asyncio.get_running_loop()
        while True:
            expected = loop.time() + self.interval_s
            await asyncio.sleep(self.interval_s)
            self.histogram.observe(max(0.0, loop.time() - expected))


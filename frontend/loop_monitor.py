"""Event-loop lag, measured from inside: a task that sleeps a fixed interval and records how late it woke.

A Python front end is one event loop; when it is saturated, every request waits for it. The lag histogram
(``disagg_event_loop_lag_seconds``) shows that directly, without an outside prober.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable

from prometheus_client import Histogram

from frontend.background import BackgroundLoop

# Four samples a second: a lag that matters (tens of ms) lasts longer than that, and each tick is a wake-up of the
# process, which costs a busy orchestrator as much as relaying a token does.
INTERVAL_S = 0.25
# With no request in flight nothing can wait for the loop, so a sleeping process wakes once a second, not four
# times (the orchestrator's idle CPU, docs/benchmarks.md); the first tick after a request arrives comes at most
# this late.
IDLE_INTERVAL_S = 1.0


class LoopLagMonitor(BackgroundLoop):
    task_name = "loop-lag-monitor"

    def __init__(self, histogram: Histogram, interval_s: float = INTERVAL_S,
                 is_idle: Callable[[], bool] | None = None, idle_interval_s: float = IDLE_INTERVAL_S) -> None:
        self.histogram = histogram
        self.interval_s = interval_s
        self.is_idle = is_idle
        self.idle_interval_s = idle_interval_s

    async def _run(self) -> None:
        loop = asyncio.get_running_loop()
        while True:
            interval = self.idle_interval_s if self.is_idle is not None and self.is_idle() else self.interval_s
            expected = loop.time() + interval
            await asyncio.sleep(interval)
            self.histogram.observe(max(0.0, loop.time() - expected))


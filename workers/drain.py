"""A worker's graceful drain: what SIGTERM starts before the HTTP server stops.

While it drains, the worker takes no new request (each gets a 503 ``worker_draining``, which the orchestrator sends
elsewhere without counting it against the worker) and ``/health`` answers 503 ``draining``, so that Kubernetes,
load balancers and our orchestrators stop sending; the requests it is running go on. The drain ends when none is
left (and it has been visible for ``DRAIN_VISIBLE_S``), or at ``--drain-timeout-s``: the server then stops, and a
stream still running is cut (the orchestrator sees a broken stream, which it may continue on another worker).
Listening sockets and kept-alive connections stay open during the drain, so no request written to one is lost to a
close it could not see coming.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable, Callable

logger = logging.getLogger("disagg_serve.worker.drain")

DEFAULT_DRAIN_TIMEOUT_S = 30.0
# A drain lasts at least this long (or its timeout, if shorter), even with nothing in flight: longer than an
# orchestrator's default health-check interval (2 s), so that every orchestrator has seen "draining", and so waits
# for the worker to come back, before the port closes.
DRAIN_VISIBLE_S = 3.0
_POLL_S = 0.02  # how often the drain looks at the in-flight count (a counter many tasks move; no event to wait on)


class Drain:
    """``begin`` once (from the server's stop), then ``run`` until the requests in flight are done or the time is up.

    ``inflight``: the requests the worker is running now; ``on_begin``: what else must happen as the drain starts
    (a registered worker leaves its orchestrator)."""

    def __init__(self, timeout_s: float, inflight: Callable[[], int],
                 on_begin: Callable[[], Awaitable[None]] | None = None) -> None:
        self.timeout_s = timeout_s
        self._inflight = inflight
        self._on_begin = on_begin
        self.draining = False
        self.started_at: float | None = None

    async def run(self) -> bool:
        """Drain: True when every request in flight finished in time, False when some were left at the timeout."""
        self.draining = True
        self.started_at = time.monotonic()
        running = self._inflight()
        logger.info("draining: %d request(s) in flight, up to %g s; new requests are refused", running,
                    self.timeout_s)
        if self._on_begin is not None:
            try:
                await self._on_begin()
            except Exception:  # leaving a registry is a courtesy: health checks notice the drain anyway
                logger.exception("a drain's first step failed")
        deadline = self.started_at + self.timeout_s
        visible_until = self.started_at + min(self.timeout_s, DRAIN_VISIBLE_S)
        while True:  # the in-flight count is a counter many tasks move, with no event: looked at every _POLL_S
            left = self._inflight()
            now = time.monotonic()
            if now >= deadline or (not left and now >= visible_until):
                break
            await asyncio.sleep(_POLL_S)
        took = time.monotonic() - self.started_at
        if left:
            logger.warning("drain timed out after %.1f s with %d request(s) still running: they are cut", took, left)
            return False
        logger.info("drained in %.2f s", took)
        return True

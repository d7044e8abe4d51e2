"""A worker's graceful drain: what SIGTERM starts before the HTTP server stops.

While it drains, the worker takes no new request (each gets a 503 ``worker_draining``, which the orchestrator sends
elsewhere without counting it against the worker) and ``/health`` answers 503 ``draining``, so that Kubernetes,
load balancers and our orchestrators stop sending; the requests it is running go on. The drain ends when none is
left and those who watch this worker have seen it drain, or at ``--drain-timeout-s``: the server then stops, and a
stream still running is cut (the orchestrator sees a broken stream, which it may continue on another worker).
Listening sockets and kept-alive connections stay open during the drain, so no request written to one is lost to a
close it could not see coming.

Who watches: a host that found this worker healthy at least twice in the last ``WATCH_S`` (an orchestrator's
health checks, a readiness probe) routes requests here. Each must have been told (a ``/health`` answered
``draining``, or a request refused) before the port closes, so that it waits for the worker to come back rather
than meet a closed port; one that does not look within ``DRAIN_VISIBLE_S`` is not waited for longer. A worker that
no one watches (a test's, a laptop's) stops as soon as its requests are done.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable, Callable

logger = logging.getLogger("disagg_serve.worker.drain")

DEFAULT_DRAIN_TIMEOUT_S = 30.0
WATCH_S = 10.0  # a host that found the worker healthy twice within this long watches it
# The longest a drain with nothing in flight waits for its watchers to look: over an orchestrator's default
# health-check interval (2 s).
DRAIN_VISIBLE_S = 3.0
_MAX_WATCHERS = 256  # hosts remembered (the oldest forgotten first): a worker's peers are a handful
_POLL_S = 0.02  # how often the drain looks at the in-flight count (a counter many tasks move; no event to wait on)


class Drain:
    """``run`` once (the server's stop): it returns when the requests in flight are done and the watchers told, or
    when the time is up. The worker's routes report to it: ``checked`` for each ``/health`` answered, ``refused``
    for each request turned away while it drains.

    ``inflight``: the requests the worker is running now; ``on_begin``: what else must happen as the drain starts
    (a registered worker leaves its orchestrator)."""

    def __init__(self, timeout_s: float, inflight: Callable[[], int],
                 on_begin: Callable[[], Awaitable[None]] | None = None,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.timeout_s = timeout_s
        self._inflight = inflight
        self._on_begin = on_begin
        self._clock = clock
        self.draining = False
        self.started_at: float | None = None
        self._healthy_seen: dict[str, tuple[float, float]] = {}  # host -> its last two healthy checks (before)
        self._watchers: set[str] = set()  # hosts to tell, fixed when the drain begins
        self._told: set[str] = set()

    def checked(self, host: str | None, healthy: bool) -> None:
        """``/health`` was answered to ``host`` (healthy, or not: draining says so itself)."""
        if host is None:
            return
        if self.draining:
            self._told.add(host)
        elif healthy:
            now = self._clock()
            seen = self._healthy_seen.pop(host, None)
            self._healthy_seen[host] = (seen[1] if seen else float("-inf"), now)  # (re)inserted: newest last
            if len(self._healthy_seen) > _MAX_WATCHERS:
                del self._healthy_seen[next(iter(self._healthy_seen))]

    def refused(self, host: str | None) -> None:
        """A request from ``host`` was refused because the worker drains: that host knows."""
        if host is not None:
            self._told.add(host)

    @property
    def watchers_told(self) -> bool:
        return self._watchers <= self._told

    async def run(self) -> bool:
        """Drain: True when every request in flight finished in time, False when some were left at the timeout."""
        self.draining = True
        self.started_at = now = self._clock()
        self._watchers = {host for host, (before, last) in self._healthy_seen.items() if before >= now - WATCH_S}
        logger.info("draining: %d request(s) in flight, up to %g s; new requests are refused; %d watcher(s) to tell",
                    self._inflight(), self.timeout_s, len(self._watchers))
        if self._on_begin is not None:
            try:
                await self._on_begin()
            except Exception:  # leaving a registry is a courtesy: health checks notice the drain anyway
                logger.exception("a drain's first step failed")
        deadline = self.started_at + self.timeout_s
        visible_until = self.started_at + min(self.timeout_s, DRAIN_VISIBLE_S)
        while True:  # the in-flight count is a counter many tasks move, with no event: looked at every _POLL_S
            left = self._inflight()
            now = self._clock()
            if now >= deadline or (not left and (self.watchers_told or now >= visible_until)):
                break
            await asyncio.sleep(_POLL_S)
        took = now - self.started_at
        if left:
            logger.warning("drain timed out after %.1f s with %d request(s) still running: they are cut", took, left)
            return False
        logger.info("drained in %.2f s", took)
        return True

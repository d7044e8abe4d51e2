"""Admission at the orchestrator: requests over the running limit wait in a bounded queue, by priority class, up
to a deadline, instead of an immediate 429.

Lower classes leave a reserve free for ``interactive``; a client that leaves while queued is out of the queue at
once, through its handler's cancellation. A request that finds no worker to serve it waits, within the same
timeout, while one is expected back (a worker restarting or draining). Classes, bounds and ``Retry-After``:
docs/admission.md."""

from __future__ import annotations

import asyncio
import math
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Protocol

from frontend.config import AdmissionConfig
from frontend.errors import InvalidRequestError, OverloadedError, UpstreamUnavailableError
from frontend.metrics import Metrics

PRIORITIES = ("interactive", "default", "batch")  # highest first: the order waiters are served in
INTERACTIVE, DEFAULT, BATCH = range(3)
_BY_NAME = {name: n for n, name in enumerate(PRIORITIES)}
# How admissions end (disagg_admission_total's outcome label).
OUTCOMES = ("admitted", "queued", "queue_full", "timed_out", "left", "no_worker")
_DRAIN_WINDOW_S = 10.0  # the drain rate is of requests finished within this long
_MAX_RETRY_AFTER_S = 60
_RECHECK_S = 0.5  # how often a waiter at a moving limit looks at it again


def priority_of(header: str | None) -> int:
    """The class the ``x-priority`` header names (``default`` when absent); a 400 for any other value."""
    if header is None:
        return DEFAULT
    priority = _BY_NAME.get(header.strip().lower())
    if priority is None:
        raise InvalidRequestError(f"the x-priority header must be one of {', '.join(PRIORITIES)}",
                                  code="invalid_priority")
    return priority


class DrainRate:
    """Requests finished per second over the last few seconds."""

    def __init__(self, clock: Callable[[], float]) -> None:
        self._clock = clock
        self._finished: deque[float] = deque()
        self._since = clock()

    def finished(self) -> None:
        now = self._clock()
        self._finished.append(now)
        self._forget(now)

    def per_second(self) -> float:
        now = self._clock()
        self._forget(now)
        span = min(_DRAIN_WINDOW_S, now - self._since)
        return len(self._finished) / span if span > 0 else 0.0

    def _forget(self, now: float) -> None:
        while self._finished and self._finished[0] < now - _DRAIN_WINDOW_S:
            self._finished.popleft()


class WorkerWait(Protocol):
    """What the admission queue knows of the workers a request needs, when none can serve it now."""

    def expected(self) -> bool:
        """Whether one is expected back (a worker draining or restarting): a request then waits for it."""

    async def back(self, timeout_s: float) -> None:
        """Return once one serves again; ``UpstreamUnavailableError`` if none does within ``timeout_s``."""


@dataclass(eq=False)
class _Waiter:
    priority: int
    granted: asyncio.Future[None] = field(default_factory=lambda: asyncio.get_running_loop().create_future())


class Admission:
    """``limit`` running at once: a number, or a function of the moment (the prefill gate's: the room of the CTX
    workers that take requests now); ``gate`` names it in refusals and metrics. ``has_workers``: whether a request
    could be served now; ``worker_wait``: where a request that could not waits for a worker expected back."""

    def __init__(self, limit: int | Callable[[], int], config: AdmissionConfig, metrics: Metrics,
                 has_workers: Callable[[], bool], clock: Callable[[], float] = time.monotonic,
                 gate: str = "orchestrator", worker_wait: WorkerWait | None = None) -> None:
        self._limit = limit
        self.config = config
        self.gate = gate
        self._has_workers = has_workers
        self._worker_wait = worker_wait
        self.awaiting_workers = 0  # requests waiting for a worker to come back (bounded by max_queued too)
        self.running = [0, 0, 0]
        self._queues: tuple[deque[_Waiter], ...] = (deque(), deque(), deque())
        self._drain = DrainRate(clock)
        self._clock = clock
        self._queue_length = [metrics.admission_queue_length.labels(gate=gate, priority=p) for p in PRIORITIES]
        self._wait = [metrics.admission_wait.labels(gate=gate, priority=p) for p in PRIORITIES]
        self._outcomes = {(p, outcome): metrics.admissions.labels(gate=gate, priority=PRIORITIES[p], outcome=outcome)
                          for p in range(3) for outcome in OUTCOMES}

    @property
    def limit(self) -> int:
        return self._limit() if callable(self._limit) else self._limit

    def poke(self) -> None:
        """The limit may have grown (a worker came back): give waiters the slots it opened."""
        self._grant()

    @property
    def queued(self) -> int:
        return sum(len(queue) for queue in self._queues)

    async def admit(self, priority: int) -> None:
        """Return once the request may run (it then holds a slot until ``release``); raise a 429 or 503 if it may
        not. Cancelled while waiting, it holds nothing."""
        queue_timeout_s = self.config.queue_timeout_s
        if self._worker_wait is not None and not self._has_workers() and self._worker_wait.expected():
            began = self._clock()
            await self._wait_for_workers(self._worker_wait, priority)
            # One timeout for both waits: the queue's is what the wait for a worker left of it.
            queue_timeout_s = max(0.0, queue_timeout_s - (self._clock() - began))
        if self._may_run(priority) and not any(self._queues[p] for p in range(priority + 1)):
            self._start(priority, "admitted")
            return
        if not self._has_workers():
            self._outcomes[priority, "no_worker"].inc()
            raise UpstreamUnavailableError("no healthy worker is available")
        if self.queued >= self.config.max_queued:
            self._outcomes[priority, "queue_full"].inc()
            raise OverloadedError(f"the {self.gate} is at its limit of {self.limit} running and "
                                  f"{self.config.max_queued} queued requests",
                                  retry_after_s=self._retry_after(priority))
        waiter = _Waiter(priority)
        self._queues[priority].append(waiter)
        self._queue_length[priority].inc()
        enqueued = self._clock()
        try:
            async with asyncio.timeout(queue_timeout_s):
                while not waiter.granted.done():
                    if callable(self._limit):
                        # A limit that moves without an event (a worker's circuit breaker turning half-open):
                        # looked at again every so often, so no waiter is stranded while room has opened.
                        await asyncio.wait([waiter.granted], timeout=_RECHECK_S)
                        self._grant()
                    else:
                        await asyncio.shield(waiter.granted)
        except TimeoutError:
            if not waiter.granted.done():
                self._leave(waiter, "timed_out")
                raise OverloadedError(f"no slot freed within {self.config.queue_timeout_s:g} s in the {self.gate}'s "
                                      "admission queue", retry_after_s=self._retry_after(priority)) from None
        except asyncio.CancelledError:  # the client left
            if waiter.granted.done():
                self.release(priority)  # granted as it left: the slot goes to the next waiter
            else:
                self._leave(waiter, "left")
            raise
        self._wait[priority].observe(self._clock() - enqueued)

    async def _wait_for_workers(self, wait: WorkerWait, priority: int) -> None:
        """No worker could serve a request now, but one is expected back: it waits up to the queue's timeout; a
        503 ``upstream_unavailable`` if none came back in time, or at once if as many wait as may queue."""
        if self.awaiting_workers + self.queued >= self.config.max_queued:
            self._outcomes[priority, "no_worker"].inc()
            raise UpstreamUnavailableError(f"no healthy worker is available, and {self.config.max_queued} requests "
                                           "already wait for one")
        self.awaiting_workers += 1
        try:
            await wait.back(self.config.queue_timeout_s)
        except UpstreamUnavailableError:
            self._outcomes[priority, "no_worker"].inc()
            raise
        finally:
            self.awaiting_workers -= 1

    def release(self, priority: int) -> None:
        """A request that was admitted has finished (however it ended)."""
        self.running[priority] -= 1
        self._drain.finished()
        self._grant()

    def _may_run(self, priority: int) -> bool:
        running, limit = sum(self.running), self.limit
        if priority == INTERACTIVE:
            return running < limit
        # Whole slots: the reserve rounds down (a limit of 2 reserves none at 10 %), and batch may always run
        # one. Below interactive, a class runs only while the slots running, of every class, leave the reserve.
        if running >= limit - math.floor(limit * self.config.interactive_reserve):
            return False
        return priority != BATCH or self.running[BATCH] < max(1, math.floor(limit * self.config.batch_share))

    def _start(self, priority: int, outcome: str) -> None:
        self.running[priority] += 1
        self._outcomes[priority, outcome].inc()

    def _grant(self) -> None:
        for priority, queue in enumerate(self._queues):
            while queue and self._may_run(priority):
                waiter = queue.popleft()
                self._queue_length[priority].dec()
                self._start(priority, "queued")
                waiter.granted.set_result(None)
            if sum(self.running) >= self.limit:
                return

    def _leave(self, waiter: _Waiter, outcome: str) -> None:
        self._queues[waiter.priority].remove(waiter)
        self._queue_length[waiter.priority].dec()
        self._outcomes[waiter.priority, outcome].inc()

    def _retry_after(self, priority: int) -> int:
        """Seconds until the queue ahead of a request of this class has drained, at the recent finishing rate."""
        ahead = sum(len(self._queues[p]) for p in range(priority + 1))
        rate = self._drain.per_second()
        if rate <= 0:  # nothing finished lately: a queue that does not move, or none to wait in
            return min(_MAX_RETRY_AFTER_S, math.ceil(self.config.queue_timeout_s)) if ahead else 1
        ahead += 1
        return min(_MAX_RETRY_AFTER_S, max(1, math.ceil(ahead / rate)))

"""uvicorn's ``Server``, ticking once a second instead of ten times, with a stop that is still immediate.

Idle, uvicorn's ten wake-ups a second (to look at ``should_exit``, and every tenth to renew the ``Date`` header)
were most of what an orchestrator with no request burns. Here the main loop waits up to a second on an event that
setting ``should_exit`` sets, from a signal handler or another thread alike: a stop is as prompt, and the ``Date``
header renewed as often, as on uvicorn's own loop.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Awaitable, Callable

import uvicorn

TICK_S = 1.0
_DATE_EVERY = 10  # uvicorn renews the Date header when its tick counter is a multiple of 10


class TickServer(uvicorn.Server):
    """uvicorn's ``Server`` with a one-second tick, woken at once by ``should_exit``."""

    def __init__(self, config: uvicorn.Config, before_stop: Callable[[], Awaitable[object]] | None = None) -> None:
        # What a stop runs first, while the server still listens and serves (a worker's drain): the sockets close
        # and the graceful shutdown begins only after it, or at once on a forced exit (a second Ctrl-C).
        self.before_stop = before_stop
        self._should_exit = False
        self._wake: asyncio.Event | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        super().__init__(config)

    @property
    def should_exit(self) -> bool:
        return self._should_exit

    @should_exit.setter
    def should_exit(self, value: bool) -> None:
        self._should_exit = value
        loop, wake = self._loop, self._wake
        if value and loop is not None and wake is not None:
            # From a signal handler, or a thread that is not the loop's; a loop closed meanwhile has stopped anyway.
            with contextlib.suppress(RuntimeError):
                loop.call_soon_threadsafe(wake.set)

    async def main_loop(self) -> None:
        self._wake = asyncio.Event()
        self._loop = asyncio.get_running_loop()
        counter = 0
        should_exit = await self.on_tick(counter)
        while not should_exit:
            counter = (counter + _DATE_EVERY) % 864_000
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._wake.wait(), TICK_S)
            self._wake.clear()  # a should_exit set back to False waits for the next tick again
            should_exit = await self.on_tick(counter)
        if self.before_stop is not None and not self.force_exit:
            await self._before_stop(self.before_stop, counter)

    async def _before_stop(self, before_stop: Callable[[], Awaitable[object]], counter: int) -> None:
        """Run ``before_stop`` with the server still ticking (the ``Date`` header renewed), until it ends or a forced
        exit cancels it."""
        task = asyncio.ensure_future(before_stop())
        while not task.done():
            await asyncio.wait([task], timeout=TICK_S)
            if self.force_exit:
                task.cancel()
                break
            counter = (counter + _DATE_EVERY) % 864_000
            await self.on_tick(counter)
        with contextlib.suppress(asyncio.CancelledError):
            await task

"""Waiting on conditions, never on the clock: the suite's one way to wait for state set by another thread,
task or process.

A test polls the condition it needs and fails only if it has not held within a generous bound. The bound is not
a performance claim: on a busy 2-core machine a step that takes milliseconds alone can take seconds, so it only
stops a broken test from hanging the suite.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable

DEFAULT_TIMEOUT_S = 60.0


def eventually(condition: Callable[[], bool], timeout_s: float = DEFAULT_TIMEOUT_S, every_s: float = 0.01) -> bool:
    """Poll ``condition`` from a plain thread until it holds (True) or ``timeout_s`` has passed (False)."""
    deadline = time.monotonic() + timeout_s
    while not condition():
        if time.monotonic() > deadline:
            return False
        time.sleep(every_s)
    return True


async def eventually_async(
    condition: Callable[[], bool | Awaitable[bool]], timeout_s: float = DEFAULT_TIMEOUT_S, every_s: float = 0.01
) -> bool:
    """As ``eventually``, from a coroutine: the event loop keeps running while it waits. ``condition`` may be a
    plain function or a coroutine function."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout_s
    while True:
        result = condition()
        if not isinstance(result, bool):
            result = await result
        if result:
            return True
        if loop.time() > deadline:
            return False
        await asyncio.sleep(every_s)

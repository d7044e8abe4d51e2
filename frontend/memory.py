"""Give memory back to the OS after a burst of long prompts, without taxing the hot path.

glibc keeps a burst's multi-megabyte bodies resident, and serving them from mmap instead costs page faults on every
request. So the heap's thresholds are fixed high (``keep_request_buffers_on_the_heap``) and a process with no
request in flight for a while calls ``malloc_trim(0)`` (docs/architecture.md#memory)."""

from __future__ import annotations

import asyncio
import ctypes
from collections.abc import Callable

from frontend.background import BackgroundLoop

_INTERVAL_S = 10.0


_M_TRIM_THRESHOLD, _M_MMAP_THRESHOLD = -1, -3  # mallopt's parameters (malloc.h)
_MMAP_THRESHOLD = 32 * 1024 * 1024  # glibc's largest on 64-bit: request-sized buffers come from the heap
_TRIM_THRESHOLD = 128 * 1024 * 1024  # the heap's top goes back to the OS past this, or when idle (below)


def _libc_function(name: str) -> Callable[..., int] | None:
    try:
        function: Callable[..., int] = getattr(ctypes.CDLL("libc.so.6"), name)
    except (OSError, AttributeError):  # not glibc: nothing to do
        return None
    return function


def _malloc_trim() -> Callable[[int], int] | None:
    return _libc_function("malloc_trim")


def keep_request_buffers_on_the_heap() -> bool:
    """Fix glibc's mmap and trim thresholds high, for this process; False where that is not glibc."""
    mallopt = _libc_function("mallopt")
    if mallopt is None:
        return False
    return bool(mallopt(_M_MMAP_THRESHOLD, _MMAP_THRESHOLD)) and bool(mallopt(_M_TRIM_THRESHOLD, _TRIM_THRESHOLD))


class IdleMemoryTrimmer(BackgroundLoop):
    task_name = "idle-memory-trim"

    def __init__(self, is_idle: Callable[[], bool], interval_s: float = _INTERVAL_S) -> None:
        self.is_idle = is_idle
        self.interval_s = interval_s
        self._trim = _malloc_trim()
        self.trims = 0
        self.checks = 0  # ticks so far: lets a caller wait for the trimmer to have looked, not for the clock

    async def _run(self) -> None:
        busy_since_last = True
        while True:
            await asyncio.sleep(self.interval_s)
            self.checks += 1
            if not self.is_idle():
                busy_since_last = True
            elif busy_since_last and self._trim is not None:
                self._trim(0)  # a few ms at most, and only on an idle process
                self.trims += 1
                busy_since_last = False


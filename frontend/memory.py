"""Give memory back to the OS after a burst of long prompts, without taxing the hot path.

Multi-megabyte bodies come from the heap once glibc's adaptive mmap threshold has risen, and fragmentation then
keeps a burst's memory resident long after it ended. Serving such buffers from mmap instead (a fixed
M_MMAP_THRESHOLD) was measured to cost a GEN worker 1.3 ms per 131k-token request in page faults, 3x its whole
array path. So instead, when a process has had no request in flight for a while, it calls ``malloc_trim(0)``.

glibc's *adaptive* thresholds only rise when a buffer that came from mmap is freed, and its trim threshold is
twice the mmap threshold: a process whose largest buffer per request is the ~0.5 MB body itself gives the heap's
top back to the OS after every request and faults it in again on the next (the orchestrator holding a 131k
prompt's body as bytes, never as a str: ~250 page faults and ~0.3 ms a request). ``keep_request_buffers_on_the_heap``
fixes both thresholds high instead; the idle trim above still gives a burst's memory back.
"""

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


"""Give memory back to the OS after a burst of long prompts, without taxing the hot path.

Multi-megabyte bodies come from the heap once glibc's adaptive mmap threshold has risen, and fragmentation then
keeps a burst's memory resident long after it ended. Serving such buffers from mmap instead (a fixed
M_MMAP_THRESHOLD) was measured to cost a GEN worker 1.3 ms per 131k-token request in page faults, 3x its whole
array path. So instead, when a process has had no request in flight for a while, it calls ``malloc_trim(0)``.
"""

from __future__ import annotations

import asyncio
import ctypes
from collections.abc import Callable

from frontend.background import BackgroundLoop

_INTERVAL_S = 10.0


def _malloc_trim() -> Callable[[int], int] | None:
    try:
        trim: Callable[[int], int] = ctypes.CDLL("libc.so.6").malloc_trim
    except (OSError, AttributeError):  # not glibc: nothing to do
        return None
    return trim


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


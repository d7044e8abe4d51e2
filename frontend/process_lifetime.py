"""Child processes that never outlive their parent: the launcher's children, the front ends' engine core."""

from __future__ import annotations

import contextlib
import ctypes
import signal

_PR_SET_PDEATHSIG = 1


def die_with_parent() -> None:
    """Runs in a child before exec: the kernel sends it SIGTERM when its parent dies (Linux)."""
    with contextlib.suppress(OSError):  # not Linux: the parent's own handlers still stop its children
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(_PR_SET_PDEATHSIG, signal.SIGTERM)

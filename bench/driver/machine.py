"""The machine a benchmark runs on, read from /proc: what it is, how busy it is, and the CPU each process (or tree
of processes) has used; also the resident memory and open descriptors of a process."""

from __future__ import annotations

import contextlib
import math
import os
import platform
import time
from pathlib import Path
from typing import Any

_CLK_TCK = os.sysconf("SC_CLK_TCK")


# -- the machine ---------------------------------------------------------------------------------------------
def machine_info() -> dict[str, Any]:
    """What the figures were measured on: CPU model, cores, memory, and the versions that matter here."""
    cpu_model, flags = "unknown", ""
    with contextlib.suppress(OSError):
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            key, _, value = line.partition(":")
            if key.strip() == "model name" and cpu_model == "unknown":
                cpu_model = value.strip()
            if key.strip() == "flags" and not flags:
                flags = value.strip()
    mem_gib = None
    with contextlib.suppress(OSError, ValueError, IndexError):
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemTotal:"):
                mem_gib = round(int(line.split()[1]) / 1024**2, 1)
    versions = {}
    for name in ("numpy", "orjson", "pybase64", "pydantic", "fastapi", "uvicorn", "uvloop", "httptools", "httpx"):
        with contextlib.suppress(Exception):
            from importlib.metadata import version

            versions[name] = version(name)
    return {
        "cpu_model": cpu_model,
        "nproc": os.cpu_count(),
        "sched_affinity": len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else None,
        "avx2": "avx2" in flags.split(),
        "avx512f": "avx512f" in flags.split(),
        "mem_gib": mem_gib,
        "kernel": platform.release(),
        "python": platform.python_version(),
        "python_impl": platform.python_implementation(),
        "versions": versions,
        "loadavg_at_start": loadavg(),
    }


def loadavg() -> list[float] | None:
    try:
        return [float(x) for x in Path("/proc/loadavg").read_text().split()[:3]]
    except (OSError, ValueError):
        return None


# -- CPU accounting ------------------------------------------------------------------------------------------
def cpu_seconds(pid: int) -> float:
    """utime + stime of one process (all its threads), from /proc/<pid>/stat."""
    with open(f"/proc/{pid}/stat", "rb") as f:
        raw = f.read()
    fields = raw[raw.rindex(b")") + 2 :].split()  # after "(comm) ": fields[0] is state (field 3)
    return (int(fields[11]) + int(fields[12])) / _CLK_TCK  # fields 14 and 15 of proc(5)


def machine_busy_seconds() -> float:
    """CPU seconds all cores spent busy since boot (/proc/stat: everything but idle and iowait)."""
    with open("/proc/stat", "rb") as f:
        fields = [int(x) for x in f.readline().split()[1:]]
    idle = fields[3] + (fields[4] if len(fields) > 4 else 0)
    busy = sum(fields[:8]) - idle  # user nice system idle iowait irq softirq steal; guest is inside user
    return busy / _CLK_TCK


def busy_cores(interval_s: float = 0.5) -> float:
    """How many cores were busy (anything at all) over the next ``interval_s`` seconds."""
    b0, t0 = machine_busy_seconds(), time.monotonic()
    time.sleep(interval_s)
    return (machine_busy_seconds() - b0) / max(time.monotonic() - t0, 1e-9)


def wait_for_quiet(max_wait_s: float, threshold_cores: float = 0.35) -> dict[str, float]:
    """Wait (at most ``max_wait_s``) until the machine is nearly idle, so that another user's test run does not
    land in a measurement; returns how long it waited and how busy the machine was when it stopped waiting."""
    started = time.monotonic()
    busy = busy_cores(0.3) if max_wait_s > 0 else math.nan
    while max_wait_s > 0 and busy > threshold_cores and time.monotonic() - started < max_wait_s:
        busy = busy_cores(0.5)
    return {"waited_s": time.monotonic() - started, "busy_cores": busy}


def descendants(pid: int) -> list[int]:
    """``pid`` and every live process below it (engine cores, extra API worker processes)."""
    children: dict[int, list[int]] = {}
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat", "rb") as f:
                raw = f.read()
            parent = int(raw[raw.rindex(b")") + 2 :].split()[1])
        except (OSError, ValueError, IndexError):
            continue
        children.setdefault(parent, []).append(int(entry))
    found, stack = [], [pid]
    while stack:
        current = stack.pop()
        found.append(current)
        stack.extend(children.get(current, ()))
    return found


def tree_cpu_seconds(pid: int) -> float:
    total = 0.0
    for member in descendants(pid):
        with contextlib.suppress(OSError, ValueError, IndexError):
            total += cpu_seconds(member)
    return total


# -- memory and descriptors --------------------------------------------------------------------------------
def rss_mb(pid: int) -> float | None:
    with contextlib.suppress(OSError, ValueError, IndexError):
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    return None


def open_fds(pid: int) -> int | None:
    try:
        return len(os.listdir(f"/proc/{pid}/fd"))
    except OSError:
        return None

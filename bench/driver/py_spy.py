"""Where a process's time goes under load: py-spy samples it while a load point runs, and its collapsed stacks are
summed by leaf frame, by library and inclusively (bench.system_load and bench.orchestrator_cost profile the
orchestrator this way)."""

from __future__ import annotations

import contextlib
import shutil
import subprocess
import time
from collections import Counter
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

from bench.driver.common import PYTHON, Processes, Server
from bench.driver.report import fmt, markdown_table

NOT_INSTALLED = {"available": False, "note": "py-spy is not installed (pip install '.[bench]')"}


def py_spy_path() -> str | None:
    beside = Path(PYTHON).parent / "py-spy"
    if beside.exists():
        return str(beside)
    return shutil.which("py-spy")


@contextlib.contextmanager
def py_spy_recording(processes: Processes, tool: str, pid: int, raw: Path, duration_s: int) -> Iterator[Server]:
    """py-spy samples ``pid`` at 250 Hz into ``raw`` (collapsed stacks) while the block runs."""
    spy = processes.spawn("py-spy", [tool, "record", "--pid", str(pid), "--rate", "250", "--nonblocking",
                                     "--format", "raw", "--output", str(raw), "--duration", str(duration_s)])
    time.sleep(1.0)  # let py-spy attach before the load starts
    try:
        yield spy
    finally:
        if spy.process.poll() is None:
            spy.process.send_signal(2)  # SIGINT: py-spy writes what it has and exits
            try:
                spy.process.wait(timeout=30)
            except subprocess.TimeoutExpired:
                processes.stop([spy])


_CATEGORIES = (
    ("orjson / json", ("orjson", "json/")),
    ("project: orchestrator/", ("orchestrator/",)),
    ("project: frontend/", ("frontend/",)),
    ("httpx / httpcore / h11 (client side)", ("httpx/", "httpcore/", "h11/")),
    ("uvicorn / httptools (server side)", ("uvicorn/", "httptools")),
    ("starlette / fastapi", ("starlette/", "fastapi/")),
    ("anyio", ("anyio/",)),
    ("asyncio / uvloop", ("asyncio/", "uvloop")),
    ("prometheus_client", ("prometheus_client/",)),
    ("pydantic", ("pydantic",)),
)


def _category(frame: str) -> str:
    for name, needles in _CATEGORIES:
        if any(needle in frame for needle in needles):
            return name
    return "other"


def summarize_profile(text: str, top: int = 15) -> dict[str, Any]:
    """py-spy's raw (collapsed) stacks -> shares of samples by leaf frame, by library, and inclusive."""
    leaf: Counter[str] = Counter()
    category: Counter[str] = Counter()
    inclusive: Counter[str] = Counter()
    total = 0
    for line in text.splitlines():
        stack, _, count_text = line.rstrip().rpartition(" ")
        if not stack or not count_text.isdigit():
            continue
        count = int(count_text)
        frames = [f for f in stack.split(";") if f and not f.startswith(("process ", "thread "))]
        if not frames:
            continue
        total += count
        leaf[frames[-1]] += count
        category[_category(frames[-1])] += count
        for frame in set(frames):
            inclusive[frame] += count
    share = (lambda n: 100.0 * n / total) if total else (lambda n: 0.0)
    project = [(f, n) for f, n in inclusive.most_common()
               if ("orchestrator/" in f or "frontend/" in f) and "entrypoints/cli.py" not in f]
    return {
        "samples": total,
        "by_library_pct": {name: share(n) for name, n in category.most_common()},
        "top_self_pct": [[frame, share(n)] for frame, n in leaf.most_common(top)],
        "top_project_inclusive_pct": [[frame, share(n)] for frame, n in project[:top]],
    }


def profile(processes: Processes, pid: int, raw: Path, duration_s: int,
            measure: Callable[[], dict[str, Any]]) -> tuple[dict[str, Any], dict[str, Any] | None]:
    """py-spy on ``pid`` while ``measure()`` runs its load point: the profile's summary (``available`` False with a
    note when py-spy is missing, and then nothing is measured, or wrote nothing) and the point measured."""
    tool = py_spy_path()
    if tool is None:
        return dict(NOT_INSTALLED), None
    with py_spy_recording(processes, tool, pid, raw, duration_s) as spy:
        measured = measure()
    if not raw.exists():
        return {"available": False, "note": f"py-spy wrote nothing: {spy.log_tail()}"}, measured
    summary = summarize_profile(raw.read_text())
    summary["available"] = True
    return summary, measured


def profile_tables(profile: dict[str, Any]) -> list[str]:
    """The shares of samples by library and the top leaf frames, as markdown tables, with a blank line before
    each."""
    return ["", markdown_table(["where (leaf frame's library)", "% of samples"],
                               [[k, fmt(v, 1)] for k, v in profile["by_library_pct"].items()]),
            "", markdown_table(["leaf frame (self time)", "% of samples"],
                               [[f"`{f}`", fmt(v, 1)] for f, v in profile["top_self_pct"][:12]])]

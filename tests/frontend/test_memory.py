"""IdleMemoryTrimmer: trims once after busy periods, never while requests are in flight."""

from __future__ import annotations

import pathlib
import subprocess
import sys

import pytest

from frontend.memory import IdleMemoryTrimmer
from tests.waiting import eventually_async


async def _ticks(trimmer: IdleMemoryTrimmer, count: int) -> None:
    """Let the trimmer look at the state ``count`` more times (however long its ticks take on a busy machine)."""
    target = trimmer.checks + count
    assert await eventually_async(lambda: trimmer.checks >= target)


async def test_trims_only_when_idle_and_once_per_idle_period() -> None:
    state = {"idle": False}
    trimmer = IdleMemoryTrimmer(lambda: state["idle"], interval_s=0.01)
    trimmer.start()
    try:
        await _ticks(trimmer, 5)
        assert trimmer.trims == 0  # busy the whole time
        state["idle"] = True
        await _ticks(trimmer, 5)
        assert trimmer.trims == 1  # one trim for the idle period, not one per tick
        state["idle"] = False
        await _ticks(trimmer, 2)
        state["idle"] = True
        await _ticks(trimmer, 5)
        assert trimmer.trims == 2
    finally:
        await trimmer.stop()


FAULTS_PER_REQUEST = """
import resource, sys
from frontend.memory import keep_request_buffers_on_the_heap
if sys.argv[1] == "kept":
    assert keep_request_buffers_on_the_heap()

def request():  # a 512 KB body read, joined, then an answer of the same size: the orchestrator's pattern
    pieces = bytearray(512 * 1024)
    body = bytes(pieces)
    del pieces
    answer = bytearray(512 * 1024)
    del body, answer

def faults():
    return resource.getrusage(resource.RUSAGE_SELF).ru_minflt

for _ in range(5):
    request()
before = faults()
for _ in range(50):
    request()
print((faults() - before) / 50)
"""


def faults_per_request(mode: str) -> float:
    result = subprocess.run([sys.executable, "-c", FAULTS_PER_REQUEST, mode], capture_output=True, text=True,
                            timeout=60, check=True, cwd=pathlib.Path(__file__).parents[2])
    return float(result.stdout)


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc's allocator")
def test_request_sized_buffers_stay_on_the_heap_instead_of_faulting_in_every_time() -> None:
    # glibc's adaptive thresholds give the heap's top back after each such request and fault it in again.
    assert faults_per_request("adaptive") > 100
    assert faults_per_request("kept") < 5

"""IdleMemoryTrimmer: trims once after busy periods, never while requests are in flight."""

from __future__ import annotations

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

"""IdleMemoryTrimmer: trims once after busy periods, never while requests are in flight."""

from __future__ import annotations

import asyncio

from frontend.memory import IdleMemoryTrimmer


async def test_trims_only_when_idle_and_once_per_idle_period() -> None:
    state = {"idle": False}
    trimmer = IdleMemoryTrimmer(lambda: state["idle"], interval_s=0.01)
    trimmer.start()
    try:
        await asyncio.sleep(0.1)
        assert trimmer.trims == 0  # busy the whole time
        state["idle"] = True
        await asyncio.sleep(0.1)
        assert trimmer.trims == 1  # one trim for the idle period, not one per tick
        state["idle"] = False
        await asyncio.sleep(0.05)
        state["idle"] = True
        await asyncio.sleep(0.1)
        assert trimmer.trims == 2
    finally:
        await trimmer.stop()

"""The orchestrator's and workers' uvicorn server ticks once a second, yet stops at once when told to, from a
signal handler or another thread."""

from __future__ import annotations

import asyncio
import signal
import threading
from typing import Any

import pytest
import uvicorn

from entrypoints.http import server as tick_server
from entrypoints.http.server import TickServer
from tests.waiting import eventually


async def hello(scope: Any, receive: Any, send: Any) -> None:  # pragma: no cover - never called
    raise AssertionError("no request is made")


def start(server: TickServer) -> threading.Thread:
    thread = threading.Thread(target=lambda: asyncio.run(server.serve()), daemon=True)
    thread.start()
    assert eventually(lambda: server.started)
    return thread


def counted_server() -> tuple[TickServer, list[int]]:
    """A server, and the counters its ticks were called with, in order."""
    server = TickServer(uvicorn.Config(hello, host="127.0.0.1", port=0, log_level="warning", lifespan="off",
                                          ws="none"))
    ticks: list[int] = []
    on_tick = server.on_tick

    async def counted(counter: int) -> bool:
        ticks.append(counter)
        return await on_tick(counter)

    server.on_tick = counted  # type: ignore[method-assign]
    return server, ticks


@pytest.mark.parametrize("stop", ["should_exit", "signal"])
def test_a_stop_does_not_wait_for_the_tick(monkeypatch: pytest.MonkeyPatch, stop: str) -> None:
    monkeypatch.setattr(tick_server, "TICK_S", 3600.0)  # a stop that waited for the tick would hang here
    server, ticks = counted_server()
    thread = start(server)
    assert eventually(lambda: ticks == [0])  # the main loop runs: a stop now must wake it
    if stop == "signal":
        server.handle_exit(signal.SIGTERM, None)  # what uvicorn's signal handler calls
    else:
        server.should_exit = True
    thread.join(timeout=60)
    assert not thread.is_alive()
    assert ticks == [0, 10]  # the first tick, and the one the stop woke: nothing in between


def test_every_tick_renews_the_date_header(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(tick_server, "TICK_S", 0.001)
    server, ticks = counted_server()
    thread = start(server)
    assert eventually(lambda: len(ticks) >= 5)
    server.should_exit = True
    thread.join(timeout=60)
    assert all(counter % 10 == 0 for counter in ticks)  # uvicorn renews the Date header on multiples of 10
    assert ticks[:5] == [0, 10, 20, 30, 40]

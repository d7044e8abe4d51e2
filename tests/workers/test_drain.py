"""A worker's drain on SIGTERM (workers/drain.py), on the real HTTP server the command runs (entrypoints/http's
``TickServer`` with the drain as its ``before_stop``), stopped the way its signal handler stops it.

The engine holds its streams at a gate the test opens, so "a stream still in flight" is a state, not a race.
"""

from __future__ import annotations

import asyncio
import contextlib
import signal
import socket
import threading
from collections.abc import AsyncGenerator, Iterator, Mapping
from dataclasses import dataclass

import httpx
import orjson
import pytest
import uvicorn

from entrypoints.http.server import TickServer
from tests.waiting import eventually, eventually_async
from workers.drain import DRAIN_VISIBLE_S, WATCH_S, Drain
from workers.engines.base import HandoffLedger, KVHandoffStore
from workers.engines.outputs import EngineOutput
from workers.engines.request import GenerationRequest
from workers.engines.synthetic import SyntheticEngine, synthetic_text
from workers.server import create_worker_app
from workers.settings import Role, WorkerSettings

MAX_TOKENS = 6


class GatedEngine(SyntheticEngine):
    """The synthetic engine, each stream held after its first token until ``gate`` opens."""

    def __init__(self) -> None:
        super().__init__()
        self.gate = threading.Event()
        self.held = 0  # streams waiting at the gate now

    def generate(self, request: GenerationRequest) -> AsyncGenerator[EngineOutput, None]:
        return self._held(super().generate(request))

    async def _held(self, outputs: AsyncGenerator[EngineOutput, None]) -> AsyncGenerator[EngineOutput, None]:
        first = True
        async for output in outputs:
            yield output
            if first:
                first = False
                self.held += 1
                try:
                    await asyncio.to_thread(self.gate.wait, 60)  # the test's thread opens it
                finally:
                    self.held -= 1


@dataclass
class DrainingWorker:
    url: str
    engine: GatedEngine
    server: TickServer
    thread: threading.Thread

    def sigterm(self) -> None:
        self.server.handle_exit(signal.SIGTERM, None)  # what uvicorn's handler for the signal calls


@contextlib.contextmanager
def draining_worker(drain_timeout_s: float, engine: GatedEngine | None = None,
                    role: Role = "both") -> Iterator[DrainingWorker]:
    engine = engine or GatedEngine()
    app = create_worker_app(engine, WorkerSettings(role=role, drain_timeout_s=drain_timeout_s))
    listener = socket.socket()
    listener.bind(("127.0.0.1", 0))
    port = listener.getsockname()[1]
    config = uvicorn.Config(app, host="127.0.0.1", port=port, log_level="warning", loop="asyncio", ws="none",
                            timeout_graceful_shutdown=1, lifespan="on")
    server = TickServer(config, before_stop=app.state.drain.run)
    thread = threading.Thread(target=server.run, kwargs={"sockets": [listener]}, daemon=True)
    thread.start()
    assert eventually(lambda: server.started or not thread.is_alive())
    worker = DrainingWorker(f"http://127.0.0.1:{port}", engine, server, thread)
    try:
        yield worker
    finally:
        engine.gate.set()
        server.should_exit = True
        thread.join(timeout=30)
        listener.close()


def chat_body(stream: bool) -> dict[str, object]:
    return {"model": "synthetic", "messages": [{"role": "user", "content": "hello"}], "max_tokens": MAX_TOKENS,
            "stream": stream}


def frames_of(lines: Iterator[str]) -> Iterator[dict[str, object] | str]:
    for line in lines:
        if line.startswith("data: "):
            data = line.removeprefix("data: ")
            yield data if data == "[DONE]" else orjson.loads(data)


def test_a_draining_worker_refuses_new_requests_says_so_and_lets_its_stream_finish(
        caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level("INFO", logger="frontend.http")
    with draining_worker(drain_timeout_s=60) as worker, httpx.Client(timeout=30) as client, \
            client.stream("POST", worker.url + "/v1/chat/completions", json=chat_body(True)) as stream:
        assert stream.status_code == 200
        frames = frames_of(stream.iter_lines())
        first = next(frames)
        assert eventually(lambda: worker.engine.held == 1)  # the stream is in flight, held at the gate

        worker.sigterm()
        assert eventually(lambda: httpx.get(worker.url + "/health", timeout=10).status_code == 503)
        health = httpx.get(worker.url + "/health", timeout=10).json()
        assert health["status"] == "draining" and health["inflight"] == 1

        for streamed in (False, True):  # a new request, whole or streamed, is refused before it runs
            refused = httpx.post(worker.url + "/v1/chat/completions", json=chat_body(streamed), timeout=10)
            assert refused.status_code == 503
            assert refused.headers["retry-after"] == "1"
            error = refused.json()["error"]
            assert error["code"] == "worker_draining" and error["type"] == "service_unavailable"
        assert worker.thread.is_alive()  # still serving: the stream in flight holds the drain open
        # Logged, but as what they are: expected refusals the orchestrator sends elsewhere, not server errors.
        refusals = [r for r in caplog.records if "is draining" in r.getMessage()]
        assert len(refusals) == 2 and {r.levelname for r in refusals} == {"INFO"}

        worker.engine.gate.set()
        rest = list(frames)
        assert rest[-1] == "[DONE]"
        text = "".join(str(f["choices"][0]["delta"].get("content") or "")  # type: ignore[index]
                       for f in [first, *rest[:-1]] if isinstance(f, dict) and f.get("choices"))
        assert text == synthetic_text(MAX_TOKENS)
    # Nothing in flight any more: the drain ends and the server stops by itself.
    worker.thread.join(timeout=60)
    assert not worker.thread.is_alive()


def test_a_stream_still_running_at_the_drain_timeout_is_cut() -> None:
    with draining_worker(drain_timeout_s=0.2) as worker, httpx.Client(timeout=30) as client, \
            client.stream("POST", worker.url + "/v1/chat/completions", json=chat_body(True)) as stream:
        frames = frames_of(stream.iter_lines())
        next(frames)
        assert eventually(lambda: worker.engine.held == 1)
        worker.sigterm()  # the gate never opens: the stream outlives the drain
        with pytest.raises(httpx.RemoteProtocolError):  # cut: the answer's chunked body never ends
            list(frames)
        worker.engine.gate.set()  # (frees the engine's thread that held the stream, so the loop can close)
        worker.thread.join(timeout=60)
        assert not worker.thread.is_alive()


class ParkingEngine(GatedEngine):
    """A CTX engine that says it holds ``parked`` KV hand-offs (the store's side of ``KVHandoffStore``)."""

    def __init__(self) -> None:
        super().__init__()
        self.parked = 0
        self.asked = 0  # how often the count was read

    async def release_handoff(self, ctx_request_id: str, opaque_state: bytes) -> bool:
        return False

    def kv_store_stats(self) -> tuple[int, int]:
        self.asked += 1
        return self.parked, 1024 * self.parked

    def kv_handoff_totals(self) -> Mapping[str, int]:
        return {}

    async def handoff_ledger(self) -> HandoffLedger:
        raise NotImplementedError


def test_a_draining_ctx_waits_for_the_hand_offs_it_parked_to_be_taken() -> None:
    engine = ParkingEngine()
    assert isinstance(engine, KVHandoffStore)
    with draining_worker(drain_timeout_s=60, engine=engine, role="context") as worker:
        engine.parked = 1  # a GEN is about to fetch it
        worker.sigterm()
        assert eventually(lambda: httpx.get(worker.url + "/health", timeout=10).json()["status"] == "draining")
        asked = engine.asked
        assert eventually(lambda: engine.asked > asked + 10)  # the drain keeps looking ...
        assert worker.thread.is_alive()  # ... and the server keeps serving: the port stays open for the fetch
        engine.parked = 0  # taken
        worker.thread.join(timeout=60)
        assert not worker.thread.is_alive()


# -- who must see the drain before the port closes ---------------------------------------------------------------
class StoppedClock:
    """Time that moves only when the test moves it; counts how often it is read (each turn of the drain's loop)."""

    def __init__(self) -> None:
        self.now = 1000.0
        self.reads = 0

    def __call__(self) -> float:
        self.reads += 1
        return self.now


async def drained_within(drain: Drain) -> bool:
    """Whether ``drain.run`` returns with the clock stopped (bounded only so that a drain that waits fails the test
    rather than hanging it)."""
    return await asyncio.wait_for(drain.run(), 60)


async def test_a_drain_no_one_watches_ends_as_soon_as_nothing_is_in_flight() -> None:
    clock = StoppedClock()
    drain = Drain(30, lambda: 0, clock=clock)
    drain.checked("127.0.0.1", healthy=True)  # one check (a harness waiting for the start): not a watcher
    assert await drained_within(drain) is True


async def test_a_drain_waits_until_its_watchers_are_told_or_have_had_their_chance() -> None:
    clock = StoppedClock()
    drain = Drain(30, lambda: 0, clock=clock)
    drain.checked("10.0.0.3", healthy=True)
    clock.now += WATCH_S + 1
    drain.checked("10.0.0.3", healthy=True)  # its previous check is too old: a harness, not a watcher
    for host in ("10.0.0.1", "10.0.0.2"):  # orchestrators (or probes), each checking on an interval
        drain.checked(host, healthy=True)
        clock.now += 2
        drain.checked(host, healthy=True)
    running = asyncio.create_task(drain.run())
    reads = clock.reads
    assert await eventually_async(lambda: clock.reads > reads + 10)  # the drain's loop turns ...
    assert not running.done()  # ... and waits: two watchers have not been told
    drain.checked("10.0.0.1", healthy=False)  # its health check saw "draining"
    drain.refused("10.0.0.2")  # its request was refused
    assert await asyncio.wait_for(running, 60) is True
    assert drain.watchers_told

    late = Drain(30, lambda: 0, clock=(clock := StoppedClock()))
    late.checked("10.0.0.1", healthy=True)
    late.checked("10.0.0.1", healthy=True)
    running = asyncio.create_task(late.run())
    reads = clock.reads
    assert await eventually_async(lambda: clock.reads > reads + 10) and not running.done()
    clock.now += DRAIN_VISIBLE_S  # a watcher that does not look in time is not waited for longer
    assert await asyncio.wait_for(running, 60) is True
    assert not late.watchers_told

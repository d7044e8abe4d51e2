"""The httptools transport's pool against raw asyncio servers that misbehave on purpose: connections kept alive and
reused, the connection limit and the callers waiting their turn, idle ones closed, the request's head, and the same
under uvloop (the orchestrator's loop). Its connection is tested in test_connection.py, its stream in
test_stream.py; what every transport does against real workers is in ../test_base.py."""


from __future__ import annotations

import asyncio

import pytest
import uvloop

from frontend.errors import UpstreamError, UpstreamTimeoutError
from orchestrator.upstream.base import WorkerTimeouts
from orchestrator.upstream.httptools import pool as httptools_pool
from orchestrator.upstream.httptools.pool import HttptoolsTransport
from tests.orchestrator.upstream.httptools.raw_worker import RawWorker, answer, answer_after, client_of, echo_keep_alive
from tests.waiting import DEFAULT_TIMEOUT_S, eventually_async


async def test_connections_are_kept_alive_and_reused() -> None:
    async with client_of(echo_keep_alive) as (worker, transport):
        for i in range(3):
            reply = await transport.post("/v1/x", b'{"i":%d}' % i, {"X-Request-Id": f"r{i}"})
            assert (reply.status_code, reply.content) == (200, b'{"i":%d}' % i)
        assert worker.connections == 1
        head = worker.requests[0].split(b"\r\n\r\n")[0].split(b"\r\n")
        assert head[0] == b"POST /v1/x HTTP/1.1"
        assert b"Host: 127.0.0.1:" + worker.url.rsplit(":", 1)[1].encode() in head
        assert {b"Content-Type: application/json", b"Content-Length: 7", b"X-Request-Id: r0"} <= set(head)


async def test_a_worker_that_closes_after_each_answer_gets_a_fresh_connection_each_time() -> None:
    async def once(worker: RawWorker, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        body = await worker.read_request(reader)
        writer.write(answer(body or b"", close=True))
        await writer.drain()

    async with client_of(once) as (worker, transport):
        for _ in range(3):
            assert (await transport.post("/x", b"{}")).content == b"{}"
        assert worker.connections == 3


async def test_a_pooled_connection_the_worker_closed_while_idle_is_not_used_again() -> None:
    """The worker closes a kept connection while it is idle (its keep-alive timeout): the next request goes on a
    new connection, sent once."""
    async def answer_then_close(worker: RawWorker, reader: asyncio.StreamReader,
                                writer: asyncio.StreamWriter) -> None:
        body = await worker.read_request(reader)
        writer.write(answer(body or b""))
        await writer.drain()

    async with client_of(answer_then_close) as (worker, transport):
        assert (await transport.post("/x", b"1")).content == b"1"
        assert await eventually_async(lambda: not any(c.reusable for c in transport._idle))
        assert (await transport.post("/x", b"2")).content == b"2"
        assert worker.connections == 2
        assert [r.rsplit(b"\r\n", 1)[1] for r in worker.requests] == [b"1", b"2"]


async def test_a_caller_waits_for_a_busy_pool_no_longer_than_the_connect_timeout(
        monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(httptools_pool, "_MAX_CONNECTIONS", 1)
    release = asyncio.Event()
    async with client_of(answer_after(release), WorkerTimeouts(connect_s=0.2)) as (worker, transport):
        first = asyncio.ensure_future(transport.post("/x", b"1"))
        assert await eventually_async(lambda: len(worker.requests) == 1)
        with pytest.raises(UpstreamTimeoutError, match="connections busy"):
            await transport.post("/x", b"2")
        release.set()
        assert (await first).content == b"1"


async def test_no_more_connections_than_the_limit_the_rest_wait_their_turn(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(httptools_pool, "_MAX_CONNECTIONS", 2)
    release = asyncio.Event()
    async with client_of(answer_after(release)) as (worker, transport):
        calls = [asyncio.ensure_future(transport.post("/x", b"%d" % i)) for i in range(6)]
        assert await eventually_async(lambda: len(worker.requests) == 2 and len(transport._waiters) == 4)
        assert worker.connections == 2 and len(transport._waiters) == 4
        release.set()
        replies = await asyncio.gather(*calls)
        assert sorted(r.content for r in replies) == [b"%d" % i for i in range(6)]
        assert worker.most_open == 2


async def test_a_caller_cancelled_while_waiting_for_a_connection_passes_its_turn_on(
        monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(httptools_pool, "_MAX_CONNECTIONS", 1)
    release = asyncio.Event()
    async with client_of(answer_after(release)) as (_worker, transport):
        first = asyncio.ensure_future(transport.post("/x", b"1"))
        cancelled = asyncio.ensure_future(transport.post("/x", b"2"))
        last = asyncio.ensure_future(transport.post("/x", b"3"))
        assert await eventually_async(lambda: len(transport._waiters) == 2)
        cancelled.cancel()
        release.set()
        assert (await first).content == b"1"
        assert (await asyncio.wait_for(last, DEFAULT_TIMEOUT_S)).content == b"3"
        assert cancelled.cancelled()


async def test_a_header_that_would_split_the_request_is_refused() -> None:
    transport = HttptoolsTransport("http://127.0.0.1:9", WorkerTimeouts())
    try:
        with pytest.raises(UpstreamError, match="not a valid HTTP header"):
            await transport.post("/x", b"{}", {"X-Request-Id": "a\r\nX-Evil: 1"})
    finally:
        await transport.aclose()


def test_a_worker_url_with_a_path_prefixes_every_request() -> None:
    transport = HttptoolsTransport("http://w:81/base/", WorkerTimeouts())
    head = transport._head("POST", "/v1/x", 2, None)
    assert head.startswith(b"POST /base/v1/x HTTP/1.1\r\nHost: w:81\r\n")
    assert HttptoolsTransport("https://w", WorkerTimeouts())._head("GET", "/h", None, None) == \
        b"GET /h HTTP/1.1\r\nHost: w\r\n\r\n"


def test_the_same_under_uvloop() -> None:
    """The orchestrator runs on uvloop, whose transports are not asyncio's classes."""
    async def main() -> None:
        async with client_of(echo_keep_alive) as (worker, transport):
            big = b"x" * 3_000_000  # more than the kernel takes in one send
            chunks = (b'{"a":"', memoryview(big), b'"}')
            reply = await transport.post("/x", chunks)
            assert reply.content == b"".join(chunks)
            assert (await transport.post("/x", b"{}")).content == b"{}"
            assert worker.connections == 1

    with asyncio.Runner(loop_factory=uvloop.new_event_loop) as runner:
        runner.run(main())


async def test_idle_pooled_connections_are_closed_by_the_transport(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(httptools_pool, "_IDLE_S", 0.05)  # the transport's setting, not a wait of the test's
    async with client_of(echo_keep_alive) as (worker, transport):
        assert (await transport.post("/x", b"1")).content == b"1"
        assert worker.open_now == 1
        assert await eventually_async(lambda: worker.open_now == 0)  # the transport closed it: no request came
        assert transport._idle == []

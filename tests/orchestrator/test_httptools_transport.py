"""The httptools transport's own machinery, against raw asyncio servers that misbehave on purpose: the keep-alive
pool, the stale-connection retry, the connection limit, an abandoned stream closing its connection, flow control,
answers framed every way HTTP allows, and the same under uvloop (the orchestrator's loop). What every transport
does against real workers is in test_transport.py."""

from __future__ import annotations

import asyncio
import contextlib
import gc
import ssl
import subprocess
from collections.abc import AsyncIterator, Awaitable, Callable

import pytest
import uvloop

from frontend import read_buffers
from frontend.errors import UpstreamError, UpstreamTimeoutError
from orchestrator import httptools_transport, worker_connection
from orchestrator.httptools_transport import HttptoolsTransport
from orchestrator.transport import WorkerTimeouts
from tests.waiting import eventually_async

# How a raw worker answers: given the worker (its counters, ``read_request``) and one client connection.
Handler = Callable[["RawWorker", asyncio.StreamReader, asyncio.StreamWriter], Awaitable[None]]


class RawWorker:
    """A TCP server answering each request with ``handler``; counts connections and requests."""

    def __init__(self, handler: Handler) -> None:
        self.handler = handler
        self.connections = 0
        self.requests: list[bytes] = []
        self.open_now = 0
        self.most_open = 0
        self.closed = asyncio.Event()  # set whenever a client connection ends
        self.url = ""

    async def serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.connections += 1
        self.open_now += 1
        self.most_open = max(self.most_open, self.open_now)
        try:
            await self.handler(self, reader, writer)
        except (ConnectionError, asyncio.IncompleteReadError, asyncio.CancelledError):
            pass  # the client went, or the test is over
        finally:
            self.open_now -= 1
            writer.close()
            self.closed.set()

    async def read_request(self, reader: asyncio.StreamReader) -> bytes | None:
        """One request, head and body (Content-Length), or None at the end of the connection."""
        try:
            head = await reader.readuntil(b"\r\n\r\n")
        except asyncio.IncompleteReadError:
            return None
        length = next((int(line.split(b":")[1]) for line in head.split(b"\r\n")
                       if line.lower().startswith(b"content-length:")), 0)
        body = await reader.readexactly(length)
        self.requests.append(head + body)
        return body


@contextlib.asynccontextmanager
async def client_of(handler: Handler, timeouts: WorkerTimeouts | None = None
                    ) -> AsyncIterator[tuple[RawWorker, HttptoolsTransport]]:
    """A raw worker answering with ``handler`` on loopback, and a transport to it; both closed after."""
    worker = RawWorker(handler)
    server = await asyncio.start_server(worker.serve, "127.0.0.1", 0)
    worker.url = f"http://127.0.0.1:{server.sockets[0].getsockname()[1]}"
    transport = HttptoolsTransport(worker.url, timeouts or WorkerTimeouts())
    try:
        yield worker, transport
    finally:
        await transport.aclose()
        server.close()
        await server.wait_closed()


def answer(body: bytes, *, close: bool = False) -> bytes:
    connection = b"Connection: close\r\n" if close else b""
    return (b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\n" + connection
            + b"Content-Length: " + str(len(body)).encode() + b"\r\n\r\n" + body)


def answer_after(release: asyncio.Event) -> Handler:
    """A keep-alive echo that holds every answer until ``release`` is set."""
    async def slow(worker: RawWorker, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        while (body := await worker.read_request(reader)) is not None:
            await release.wait()
            writer.write(answer(body))
            await writer.drain()

    return slow


async def echo_keep_alive(worker: RawWorker, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
    while (body := await worker.read_request(reader)) is not None:
        writer.write(answer(body))
        await writer.drain()


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


async def test_a_request_written_and_met_by_a_close_is_not_sent_again() -> None:
    """A reused connection closed by the worker after the request was written, before a byte of the answer: the
    idle-timeout race looks so, and so does a worker that took the request and died. It may have run, so the
    transport does not send it again (the retry policy above it decides, on another worker)."""
    async def answer_then_drop(worker: RawWorker, reader: asyncio.StreamReader,
                               writer: asyncio.StreamWriter) -> None:
        body = await worker.read_request(reader)
        writer.write(answer(body or b""))
        await writer.drain()
        await worker.read_request(reader)  # the next request arrives ... and the worker hangs up unanswered

    async with client_of(answer_then_drop) as (worker, transport):
        assert (await transport.post("/x", b"1")).content == b"1"
        with pytest.raises(UpstreamError, match="lost before the answer began"):
            await transport.post("/x", b"2")
        assert worker.connections == 1
        assert [r.rsplit(b"\r\n", 1)[1] for r in worker.requests] == [b"1", b"2"]


async def test_a_fresh_connection_lost_before_the_answer_is_an_upstream_error_not_a_retry() -> None:
    async def drop(worker: RawWorker, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await worker.read_request(reader)

    async with client_of(drop) as (worker, transport):
        with pytest.raises(UpstreamError, match="connection was lost"):
            await transport.post("/x", b"{}")
        assert worker.connections == 1


async def test_an_answer_that_is_not_http_is_an_upstream_error() -> None:
    async def garbage(worker: RawWorker, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await worker.read_request(reader)
        writer.write(b"SPDY/9 what\r\n\r\n")
        await writer.drain()
        await reader.read()

    async with client_of(garbage) as (_worker, transport):
        with pytest.raises(UpstreamError, match="not valid HTTP"):
            await transport.post("/x", b"{}")


async def test_an_answer_framed_by_chunks_or_by_the_connection_end_arrives_whole() -> None:
    async def framed(worker: RawWorker, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await worker.read_request(reader)
        writer.write(b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n3\r\nabc\r\n2\r\nde\r\n0\r\n\r\n")
        await worker.read_request(reader)
        writer.write(b"HTTP/1.1 200 OK\r\nConnection: close\r\n\r\nuntil the end")
        await writer.drain()

    async with client_of(framed) as (worker, transport):
        assert (await transport.post("/x", b"{}")).content == b"abcde"
        assert (await transport.post("/x", b"{}")).content == b"until the end"
        assert worker.connections == 1


async def test_an_abandoned_stream_closes_its_connection_so_the_worker_stops() -> None:
    async def endless(worker: RawWorker, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await worker.read_request(reader)
        writer.write(b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n")
        while True:
            writer.write(b"5\r\nframe\r\n")
            await writer.drain()
            await asyncio.sleep(0.01)

    async with client_of(endless) as (worker, transport):
        stream = await transport.open_stream("/x", b"{}")
        chunks = stream.chunks()
        assert (await anext(chunks)).startswith(b"frame")
        await chunks.aclose()
        await asyncio.wait_for(worker.closed.wait(), 10)
        assert worker.open_now == 0
        assert not transport._idle  # never pooled half read


async def test_a_stream_read_slower_than_it_arrives_pauses_the_socket_and_loses_nothing(
        monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(worker_connection, "_PAUSE_AT", 64)
    frames = [b"%04d" % i * 8 for i in range(200)]
    all_written, finish = asyncio.Event(), asyncio.Event()

    async def burst(worker: RawWorker, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await worker.read_request(reader)
        writer.write(b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n")
        await writer.drain()
        for frame in frames:
            writer.write(b"%x\r\n%s\r\n" % (len(frame), frame))
        await writer.drain()  # 6 KB: the kernel's buffers take it all, paused reader or not
        all_written.set()
        await finish.wait()
        writer.write(b"0\r\n\r\n")
        await writer.drain()
        while (body := await worker.read_request(reader)) is not None:
            writer.write(answer(body))
            await writer.drain()

    async with client_of(burst) as (worker, transport):
        stream = await transport.open_stream("/x", b"{}")
        await asyncio.wait_for(all_written.wait(), 10)
        # Nobody read yet: past _PAUSE_AT the socket was paused.
        assert await eventually_async(lambda: any(c._paused for c in transport._open))
        finish.set()
        received = [chunk async for chunk in stream.chunks()]
        assert b"".join(received) == b"".join(frames)
        assert len(transport._idle) == 1 and not transport._idle[0]._paused  # back in the pool, reading
        assert (await transport.post("/x", b"next")).content == b"next"  # and it serves the next request
        assert worker.connections == 1


async def test_a_stream_that_ends_while_paused_is_pooled_reading_and_serves_the_next_request(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """The read that passes _PAUSE_AT also carries the answer's end: the connection is complete while paused. Given
    back like that, the next request's answer would never be read."""
    monkeypatch.setattr(worker_connection, "_PAUSE_AT", 64)
    everything = b"".join(b"%x\r\n%s\r\n" % (len(f), f) for f in [b"x" * 100] * 5) + b"0\r\n\r\n"

    async def at_once(worker: RawWorker, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await worker.read_request(reader)
        writer.write(b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n" + everything)
        await writer.drain()
        while (body := await worker.read_request(reader)) is not None:
            writer.write(answer(body))
            await writer.drain()

    async with client_of(at_once, WorkerTimeouts(request_s=60)) as (_worker, transport):
        stream = await transport.open_stream("/x", b"{}")
        assert await eventually_async(lambda: all(c.complete for c in transport._open))
        await stream.aclose()  # the client left without reading: the answer is whole, so it is pooled
        assert len(transport._idle) == 1
        assert (await asyncio.wait_for(transport.post("/x", b"next"), 30)).content == b"next"


async def test_a_stream_dropped_without_aclose_closes_its_connection() -> None:
    """A relay generator that never started never closes its stream: the stream, collected, closes it."""
    async def endless(worker: RawWorker, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await worker.read_request(reader)
        writer.write(b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n5\r\nframe\r\n")
        await writer.drain()
        await reader.read()  # until the client hangs up

    async with client_of(endless) as (worker, transport):
        stream = await transport.open_stream("/x", b"{}")
        assert len(transport._open) == 1
        del stream
        gc.collect()
        assert not transport._open  # the slot is free
        await asyncio.wait_for(worker.closed.wait(), 10)  # and the worker saw the hang-up


async def test_a_caller_waits_for_a_busy_pool_no_longer_than_the_connect_timeout(
        monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(httptools_transport, "_MAX_CONNECTIONS", 1)
    release = asyncio.Event()
    async with client_of(answer_after(release), WorkerTimeouts(connect_s=0.2)) as (worker, transport):
        first = asyncio.ensure_future(transport.post("/x", b"1"))
        assert await eventually_async(lambda: len(worker.requests) == 1)
        with pytest.raises(UpstreamTimeoutError, match="connections busy"):
            await transport.post("/x", b"2")
        release.set()
        assert (await first).content == b"1"


@pytest.mark.parametrize("when", ["with the answer", "later"])
async def test_an_unasked_answer_never_becomes_the_next_requests(when: str) -> None:
    answered = asyncio.Event()

    async def extra(worker: RawWorker, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        body = await worker.read_request(reader)
        if when == "later":
            writer.write(answer(body or b""))
            await writer.drain()
            await answered.wait()
            writer.write(answer(b"unasked"))
        else:
            writer.write(answer(body or b"") + answer(b"unasked"))  # one write: likely one read on the other side
        await writer.drain()
        while (body := await worker.read_request(reader)) is not None:
            writer.write(answer(body))
            await writer.drain()

    async with client_of(extra) as (worker, transport):
        assert (await transport.post("/x", b"1")).content == b"1"
        answered.set()
        assert await eventually_async(lambda: not any(c.reusable for c in transport._idle))
        assert (await transport.post("/x", b"2")).content == b"2"
        assert worker.connections == 2


async def test_no_more_connections_than_the_limit_the_rest_wait_their_turn(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(httptools_transport, "_MAX_CONNECTIONS", 2)
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
    monkeypatch.setattr(httptools_transport, "_MAX_CONNECTIONS", 1)
    release = asyncio.Event()
    async with client_of(answer_after(release)) as (_worker, transport):
        first = asyncio.ensure_future(transport.post("/x", b"1"))
        cancelled = asyncio.ensure_future(transport.post("/x", b"2"))
        last = asyncio.ensure_future(transport.post("/x", b"3"))
        assert await eventually_async(lambda: len(transport._waiters) == 2)
        cancelled.cancel()
        release.set()
        assert (await first).content == b"1"
        assert (await asyncio.wait_for(last, 10)).content == b"3"
        assert cancelled.cancelled()


async def test_a_worker_that_stalls_on_a_kept_connection_times_out_after_answers_that_came_in_time() -> None:
    """The read timer outlives each answer on its connection (it is not made per request): it must still time the
    request that stalls."""
    async def answers_twice_then_stalls(worker: RawWorker, reader: asyncio.StreamReader,
                                        writer: asyncio.StreamWriter) -> None:
        while (body := await worker.read_request(reader)) is not None:
            if len(worker.requests) > 2:
                await asyncio.Event().wait()  # read, never answered
            writer.write(answer(body))
            await writer.drain()

    async with client_of(answers_twice_then_stalls, WorkerTimeouts(request_s=0.3)) as (worker, transport):
        for n in range(2):
            assert (await transport.post("/x", b"%d" % n)).content == b"%d" % n
        with pytest.raises(UpstreamTimeoutError, match=r"nothing read for 0\.3 s"):
            await asyncio.wait_for(transport.post("/x", b"2"), 10)  # a timer never armed again would hang
        assert worker.connections == 1


async def test_a_timer_armed_for_an_earlier_request_does_not_fail_a_later_one_answered_in_time() -> None:
    """The read timer of the first request is still armed when the second goes out on the same connection; it
    fires while the second is awaited and must measure the second's own wait, not the first's."""
    async def second_answer_late(worker: RawWorker, reader: asyncio.StreamReader,
                                 writer: asyncio.StreamWriter) -> None:
        while (body := await worker.read_request(reader)) is not None:
            if len(worker.requests) == 2:
                await asyncio.sleep(1.0)  # half the timeout: in time, but past the first request's timer
            writer.write(answer(body))
            await writer.drain()

    async with client_of(second_answer_late, WorkerTimeouts(request_s=2.0)) as (worker, transport):
        assert (await transport.post("/x", b"first")).content == b"first"
        await asyncio.sleep(1.5)  # the first timer (due 2 s after the first request) fires during the second
        assert (await asyncio.wait_for(transport.post("/x", b"second"), 10)).content == b"second"
        assert worker.connections == 1


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


def long_body(size: int) -> bytes:
    return bytes(i % 251 for i in range(size))


async def long_answers_then_more_on_the_same_connection(parsed: list[int]) -> None:
    first, second = long_body(1_000_000), long_body(300_000)[::-1]

    async def in_pieces(worker: RawWorker, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        if worker.connections > 1:
            return await echo_keep_alive(worker, reader, writer)
        await worker.read_request(reader)
        whole = answer(first)
        for start in range(0, len(whole), 100_000):  # the head and the body's start together, then pieces
            writer.write(whole[start:start + 100_000])
            await writer.drain()
        await worker.read_request(reader)
        writer.write(answer(second) + answer(b"unasked"))  # the body's end and an unasked answer in one write
        await writer.drain()
        await echo_keep_alive(worker, reader, writer)

    async with client_of(in_pieces) as (worker, transport):
        reply = await transport.post("/x", b"{}")
        assert type(reply.content) is bytes and reply.content == first
        # At most the reads of the head went through the parser: the rest straight into the answer's bytes.
        assert 0 < sum(parsed) <= 2 * read_buffers.HEAD_READ_BYTES
        assert (await transport.post("/x", b"{}")).content == second
        # The unasked answer was not read into the body, nor taken for the next request's answer.
        assert (await transport.post("/x", b"3")).content == b"3"
        assert worker.connections == 2


@pytest.fixture
def parsed(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """The size of every piece the answer parser is handed."""
    sizes: list[int] = []
    feed = worker_connection.WorkerConnection.data_received

    def counted(self: worker_connection.WorkerConnection, data: bytes) -> None:
        sizes.append(len(data))
        feed(self, data)

    monkeypatch.setattr(worker_connection.WorkerConnection, "data_received", counted)
    return sizes


async def test_a_long_whole_answer_is_read_past_the_parser_and_ends_where_its_length_says(parsed: list[int]) -> None:
    await long_answers_then_more_on_the_same_connection(parsed)


def test_a_long_whole_answer_is_read_past_the_parser_under_uvloop_too(parsed: list[int]) -> None:
    with asyncio.Runner(loop_factory=uvloop.new_event_loop) as runner:
        runner.run(long_answers_then_more_on_the_same_connection(parsed))


async def test_a_long_answer_to_a_stream_comes_as_it_arrives_and_one_cut_short_is_an_error(
        parsed: list[int]) -> None:
    body = long_body(500_000)
    cut = asyncio.Event()

    async def long_then_cut(worker: RawWorker, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await worker.read_request(reader)
        writer.write(answer(body))
        await writer.drain()
        await worker.read_request(reader)
        writer.write(answer(body)[:300_000])
        await writer.drain()
        await cut.wait()

    async with client_of(long_then_cut) as (_worker, transport):
        stream = await transport.open_stream("/x", b"{}")
        assert b"".join([chunk async for chunk in stream.chunks()]) == body
        assert sum(parsed) > len(body)  # a stream's body goes through the parser, piece by piece
        with pytest.raises(UpstreamError, match="lost before the answer ended"):
            post = asyncio.ensure_future(transport.post("/x", b"{}"))
            assert await eventually_async(lambda: len(_worker.requests) == 2)
            cut.set()
            await post


@pytest.fixture(scope="module")
def certificate(tmp_path_factory: pytest.TempPathFactory) -> tuple[str, str]:
    """A self-signed certificate for 127.0.0.1 and its key (made with the openssl command line)."""
    where = tmp_path_factory.mktemp("tls")
    cert, key = str(where / "cert.pem"), str(where / "key.pem")
    subprocess.run(["openssl", "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-days", "1", "-subj", "/CN=127.0.0.1",
                    "-addext", "subjectAltName=IP:127.0.0.1", "-keyout", key, "-out", cert],
                   check=True, capture_output=True, timeout=120)
    return cert, key


async def long_answers_over_tls(certificate: tuple[str, str], parsed: list[int]) -> None:
    cert, key = certificate
    served = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
    served.load_cert_chain(cert, key)
    body = long_body(1_000_000)

    async def long_then_echo(worker: RawWorker, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await worker.read_request(reader)
        writer.write(answer(body))
        await writer.drain()
        await echo_keep_alive(worker, reader, writer)

    worker = RawWorker(long_then_echo)
    server = await asyncio.start_server(worker.serve, "127.0.0.1", 0, ssl=served)
    transport = HttptoolsTransport(f"https://127.0.0.1:{server.sockets[0].getsockname()[1]}", WorkerTimeouts())
    transport._ssl = ssl.create_default_context(cafile=cert)  # trust the test's own certificate
    try:
        assert (await transport.post("/x", b"{}")).content == body
        assert 0 < sum(parsed) <= 2 * read_buffers.HEAD_READ_BYTES  # through TLS too, past the parser
        assert (await transport.post("/x", b"again")).content == b"again"
        assert worker.connections == 1
    finally:
        await transport.aclose()
        server.close()
        await server.wait_closed()


async def test_a_long_answer_over_tls_is_read_past_the_parser(certificate: tuple[str, str],
                                                               parsed: list[int]) -> None:
    await long_answers_over_tls(certificate, parsed)


def test_a_long_answer_over_tls_is_read_past_the_parser_under_uvloop(certificate: tuple[str, str],
                                                                      parsed: list[int]) -> None:
    with asyncio.Runner(loop_factory=uvloop.new_event_loop) as runner:
        runner.run(long_answers_over_tls(certificate, parsed))


# -- odd workers: interim answers, upgrades, huge heads, half answers, idle connections -------------------------
# A transport that gives up on a silent worker in a minute, so that a defect fails these tests rather than hangs them.
BOUNDED = WorkerTimeouts(request_s=60.0)


@pytest.mark.parametrize("interim", [b"HTTP/1.1 100 Continue\r\n\r\n",
                                     b"HTTP/1.1 103 Early Hints\r\nLink: </a>; rel=preload\r\n\r\n"
                                     b"HTTP/1.1 100 Continue\r\n\r\n"], ids=["100", "103 then 100"])
async def test_interim_answers_are_skipped_and_each_request_gets_its_own_answer(interim: bytes) -> None:
    """A worker (or a proxy before it) that sends 1xx first: the final answer is the request's, and the next
    request on the kept connection gets its own (before, the 1xx was taken as the answer and the next request read
    this one's: one user's completion went to another)."""
    async def continue_first(worker: RawWorker, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        while (body := await worker.read_request(reader)) is not None:
            writer.write(interim + answer(body))
            await writer.drain()

    async with client_of(continue_first, BOUNDED) as (worker, transport):
        for i in range(3):
            reply = await transport.post("/x", b'{"i":%d}' % i)
            assert (reply.status_code, reply.content) == (200, b'{"i":%d}' % i)
        stream = await transport.open_stream("/x", b'{"s":1}')
        assert stream.status_code == 200
        assert await stream.read() == b'{"s":1}'
        assert worker.connections == 1


async def test_a_101_is_an_upstream_error_and_the_connection_is_dropped() -> None:
    async def upgrade(worker: RawWorker, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await worker.read_request(reader)
        writer.write(b"HTTP/1.1 101 Switching Protocols\r\nUpgrade: h2c\r\nConnection: Upgrade\r\n\r\nbinary")
        await writer.drain()
        await reader.read()

    async with client_of(upgrade, BOUNDED) as (worker, transport):
        with pytest.raises(UpstreamError, match="101 Switching Protocols"):
            await transport.post("/x", b"{}")
        await asyncio.wait_for(worker.closed.wait(), 60)  # dropped, not pooled


async def test_an_answer_head_over_the_limit_is_an_upstream_error() -> None:
    async def huge_head(worker: RawWorker, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await worker.read_request(reader)
        writer.write(b"HTTP/1.1 200 OK\r\nX-Big: " + b"a" * (worker_connection._MAX_HEAD_BYTES * 4))
        await writer.drain()
        await reader.read()

    async with client_of(huge_head, BOUNDED) as (worker, transport):
        with pytest.raises(UpstreamError, match="head is over"):
            await transport.post("/x", b"{}")
        await asyncio.wait_for(worker.closed.wait(), 60)


async def test_a_half_answer_is_an_upstream_error_and_never_pooled() -> None:
    async def half(worker: RawWorker, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        body = await worker.read_request(reader)
        if len(worker.requests) == 1:
            writer.write(b"HTTP/1.1 200 OK\r\nContent-Length: 10\r\n\r\nhalf")
            await writer.drain()
            return  # and the connection ends
        writer.write(answer(body or b""))
        await writer.drain()

    async with client_of(half) as (worker, transport):
        with pytest.raises(UpstreamError, match="lost before the answer ended"):
            await transport.post("/x", b"{}")
        assert (await transport.post("/x", b"2")).content == b"2"
        assert worker.connections == 2


async def test_idle_pooled_connections_are_closed_by_the_transport(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(httptools_transport, "_IDLE_S", 0.05)  # the transport's setting, not a wait of the test's
    async with client_of(echo_keep_alive) as (worker, transport):
        assert (await transport.post("/x", b"1")).content == b"1"
        assert worker.open_now == 1
        assert await eventually_async(lambda: worker.open_now == 0)  # the transport closed it: no request came
        assert transport._idle == []

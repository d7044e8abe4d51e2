"""One connection of the httptools transport against raw asyncio servers that misbehave on purpose: a request met by
a close, answers framed every way HTTP allows, flow control, an unasked answer, the read timer, long answers read
past the parser (plain, under uvloop, over TLS), interim heads, a 101, an over-long head, a half answer."""


from __future__ import annotations

import asyncio
import ssl
import subprocess

import pytest
import uvloop

from frontend import read_buffers
from frontend.errors import UpstreamError, UpstreamTimeoutError
from orchestrator.upstream.base import WorkerTimeouts
from orchestrator.upstream.httptools import connection as worker_connection
from orchestrator.upstream.httptools.pool import HttptoolsTransport
from tests.orchestrator.upstream.httptools.raw_worker import RawWorker, answer, client_of, echo_keep_alive
from tests.waiting import DEFAULT_TIMEOUT_S, eventually_async


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
        await asyncio.wait_for(all_written.wait(), DEFAULT_TIMEOUT_S)
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
        assert (await asyncio.wait_for(transport.post("/x", b"next"), DEFAULT_TIMEOUT_S)).content == b"next"


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
            # (A hang guard: a timer never armed again would wait for ever.)
            await asyncio.wait_for(transport.post("/x", b"2"), DEFAULT_TIMEOUT_S)
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
        assert (await asyncio.wait_for(transport.post("/x", b"second"), DEFAULT_TIMEOUT_S)).content == b"second"
        assert worker.connections == 1


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
        await asyncio.wait_for(worker.closed.wait(), DEFAULT_TIMEOUT_S)  # dropped, not pooled


async def test_an_answer_head_over_the_limit_is_an_upstream_error() -> None:
    async def huge_head(worker: RawWorker, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await worker.read_request(reader)
        writer.write(b"HTTP/1.1 200 OK\r\nX-Big: " + b"a" * (worker_connection._MAX_HEAD_BYTES * 4))
        await writer.drain()
        await reader.read()

    async with client_of(huge_head, BOUNDED) as (worker, transport):
        with pytest.raises(UpstreamError, match="head is over"):
            await transport.post("/x", b"{}")
        await asyncio.wait_for(worker.closed.wait(), DEFAULT_TIMEOUT_S)


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

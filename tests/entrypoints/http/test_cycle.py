"""The rules of an answer sent through ASGI on the project's own protocol (``entrypoints/http/cycle.py``): a
real uvicorn server running ``guarded_protocol`` in a thread, on uvloop, raw client sockets (so the bytes on the
wire are the test's to read)."""

from __future__ import annotations

import asyncio
import logging
import socket
import threading
from collections.abc import Iterator
from typing import Any

import orjson
import pytest
import uvloop

from entrypoints.http.protocol import guarded_protocol
from tests.entrypoints.http.test_protocol import connected
from tests.security.test_hostile_clients import header, read_until_closed
from tests.servers import ServerThread
from tests.waiting import eventually

Message = dict[str, Any]


class Answers:
    """An ASGI app whose answer to ``GET /<name>`` is the test's: each route one way an app may answer."""

    def __init__(self) -> None:
        self.release: asyncio.Event | None = None  # what ``/held`` waits for between its two pieces
        self.loop: asyncio.AbstractEventLoop | None = None
        self.told_gone = threading.Event()  # ``/waits`` was told that its client left

    async def __call__(self, scope: Message, receive: Any, send: Any) -> None:
        assert scope["type"] == "http"
        route = getattr(self, scope["path"].strip("/").replace("-", "_"))
        await route(scope, receive, send)

    @staticmethod
    async def _start(send: Any, status: int = 200, headers: list[tuple[bytes, bytes]] | None = None) -> None:
        await send({"type": "http.response.start", "status": status, "headers": headers or []})

    async def echo(self, scope: Message, receive: Any, send: Any) -> None:
        body = scope["path"].encode() + b"?" + scope["query_string"]
        await self._start(send, headers=[(b"content-length", b"%d" % len(body))])
        await send({"type": "http.response.body", "body": body})

    async def split_header(self, scope: Message, receive: Any, send: Any) -> None:
        # A header value an app built from a client's input: CR LF would end the head and start an answer of the
        # client's making.
        await self._start(send, headers=[(b"x-echo", b"a\r\ncontent-length: 0\r\n\r\nHTTP/1.1 200 OK")])

    async def bad_name(self, scope: Message, receive: Any, send: Any) -> None:
        await self._start(send, headers=[(b"x echo", b"a")])

    async def too_long(self, scope: Message, receive: Any, send: Any) -> None:
        await self._start(send, headers=[(b"content-length", b"3")])
        await send({"type": "http.response.body", "body": b"abcdef"})

    async def no_content(self, scope: Message, receive: Any, send: Any) -> None:
        await self._start(send, 204)
        await send({"type": "http.response.body", "body": b"not for the wire"})

    async def fails(self, scope: Message, receive: Any, send: Any) -> None:
        raise RuntimeError("the app failed before answering")

    async def chunked(self, scope: Message, receive: Any, send: Any) -> None:
        await self._start(send, headers=[(b"transfer-encoding", b"chunked")])
        await send({"type": "http.response.body", "body": b"one ", "more_body": True})
        await send({"type": "http.response.body", "body": b"two"})

    async def exits(self, scope: Message, receive: Any, send: Any) -> None:
        raise SystemExit("an app that asked the process to exit")

    async def fails_late(self, scope: Message, receive: Any, send: Any) -> None:
        await self._start(send)
        await send({"type": "http.response.body", "body": b"first", "more_body": True})
        raise RuntimeError("the app failed after its answer started")

    async def waits(self, scope: Message, receive: Any, send: Any) -> None:
        # A streamed answer whose app stops its work when the client leaves, as the workers' streams do.
        await self._start(send)
        await send({"type": "http.response.body", "body": b"first", "more_body": True})
        while (await receive())["type"] != "http.disconnect":
            pass
        self.told_gone.set()

    async def reads(self, scope: Message, receive: Any, send: Any) -> None:
        message = await receive()
        await self._start(send, headers=[(b"content-length", b"%d" % len(message.get("body", b"")))])
        await send({"type": "http.response.body", "body": message.get("body", b"")})

    async def refuses(self, scope: Message, receive: Any, send: Any) -> None:
        await self._start(send, 413, [(b"content-length", b"0")])  # at once, the body unread
        await send({"type": "http.response.body", "body": b""})

    async def held(self, scope: Message, receive: Any, send: Any) -> None:
        self.loop = asyncio.get_running_loop()
        self.release = asyncio.Event()
        await self._start(send)
        await send({"type": "http.response.body", "body": b"first ", "more_body": True})
        await self.release.wait()
        await send({"type": "http.response.body", "body": b"second"})


@pytest.fixture()
def served() -> Iterator[tuple[Answers, ServerThread, int]]:
    app = Answers()
    thread = ServerThread(app, event_loop=uvloop.new_event_loop, http=guarded_protocol(), lifespan="off")
    port = int(thread.start().rsplit(":", 1)[1])
    try:
        yield app, thread, port
    finally:
        thread.stop()


def get(path: bytes, method: bytes = b"GET", extra: bytes = b"") -> bytes:
    return b"%b %b HTTP/1.1\r\nHost: t\r\n%b\r\n" % (method, path, extra)


def split(answer: bytes) -> tuple[bytes, bytes]:
    head, _, body = answer.partition(b"\r\n\r\n")
    return head, body


def test_a_header_that_would_split_the_answer_is_refused_with_a_500(served: tuple[Answers, ServerThread, int]) -> None:
    _, _, port = served
    for path in (b"/split-header", b"/bad-name"):
        with connected(port) as sock:
            sock.sendall(get(path))
            head, body = split(read_until_closed(sock))
        assert head.startswith(b"HTTP/1.1 500 "), head
        assert b"x-echo" not in head.lower() and b"x echo" not in head.lower()
        assert orjson.loads(body)["error"]["type"] == "server_error"
        assert header(head, b"connection") == b"close"


def test_a_body_longer_than_its_declared_length_is_cut_at_it(served: tuple[Answers, ServerThread, int]) -> None:
    _, _, port = served
    with connected(port) as sock:
        sock.sendall(get(b"/too-long"))
        head, body = split(read_until_closed(sock))
    assert head.startswith(b"HTTP/1.1 200 ")
    assert body == b""  # the connection is closed: no byte past the declared length, and no whole-looking answer


def test_head_and_204_answers_carry_no_body_and_the_connection_is_kept(
        served: tuple[Answers, ServerThread, int]) -> None:
    _, _, port = served
    with connected(port) as sock:
        sock.sendall(get(b"/no-content") + get(b"/echo", b"HEAD") + get(b"/echo?x=1"))
        received = b""
        while not received.endswith(b"/echo?x=1"):
            chunk = sock.recv(65536)
            assert chunk, received
            received += chunk
    no_content, head_answer, get_answer, body = received.split(b"\r\n\r\n")
    # Nothing between the heads: the 204's body and the HEAD's were not written.
    assert no_content.startswith(b"HTTP/1.1 204 ") and header(no_content, b"transfer-encoding") is None
    assert head_answer.startswith(b"HTTP/1.1 200 ") and header(head_answer, b"content-length") == b"6"
    assert get_answer.startswith(b"HTTP/1.1 200 ") and body == b"/echo?x=1"


def test_pipelined_requests_are_answered_in_order_each_after_the_one_before(
        served: tuple[Answers, ServerThread, int]) -> None:
    app, _, port = served
    with connected(port) as sock:
        sock.sendall(get(b"/held") + b"".join(get(b"/echo?n=%d" % n) for n in range(4)))
        received = b""
        while b"first " not in received:
            chunk = sock.recv(65536)
            assert chunk, received
            received += chunk
        assert eventually(lambda: app.release is not None)
        assert app.loop is not None and app.release is not None
        sock.settimeout(0.2)  # nothing of the queued answers while the first is held (a wait for a non-event)
        with pytest.raises(TimeoutError):
            received += sock.recv(65536)
        sock.settimeout(60)
        app.loop.call_soon_threadsafe(app.release.set)
        while not received.endswith(b"/echo?n=3"):
            chunk = sock.recv(65536)
            assert chunk, received
            received += chunk
    first, rest = received.split(b"0\r\n\r\n", 1)
    assert first.endswith(b"6\r\nsecond\r\n")
    assert [answer.rsplit(b"\r\n\r\n", 1)[1] for answer in rest.split(b"HTTP/1.1 ")[1:]] == \
        [b"/echo?n=%d" % n for n in range(4)]


def test_a_client_gone_with_a_request_queued_is_told_to_the_one_being_answered(
        served: tuple[Answers, ServerThread, int]) -> None:
    app, _, port = served
    with connected(port) as sock:
        sock.sendall(get(b"/waits") + get(b"/echo"))
        received = b""
        while b"first" not in received:
            chunk = sock.recv(65536)
            assert chunk, received
            received += chunk
    assert app.told_gone.wait(60), "the answer in progress was never told that its client left"


def test_a_request_refused_mid_body_gets_no_100_continue_after_its_answer(
        served: tuple[Answers, ServerThread, int], caplog: pytest.LogCaptureFixture) -> None:
    _, thread, port = served
    with caplog.at_level(logging.ERROR), connected(port) as sock:
        sock.sendall(b"POST /reads HTTP/1.1\r\nHost: t\r\nExpect: 100-continue\r\nTransfer-Encoding: chunked\r\n"
                     b"\r\nzz\r\nnot a chunk\r\n")
        answer = read_until_closed(sock)
        # The handler has run to its end (its task is no longer the server's): whatever it logs is logged.
        assert eventually(lambda: not thread.server.server_state.tasks)
    assert answer.startswith(b"HTTP/1.1 400 ") and b"100 Continue" not in answer
    assert [record.getMessage() for record in caplog.records if record.name.startswith("entrypoints")] == []


def test_a_body_answered_before_it_is_read_is_drained_not_reset_after_reading_paused(
        served: tuple[Answers, ServerThread, int]) -> None:
    # Chunked: read piece by piece, so reading pauses past 64 KiB unread; the app refuses it unread.
    _, _, port = served
    piece = b"x" * 16384
    # 16 MiB: more than the socket buffers hold, so the whole of it is sent only if the server drains it.
    body = b"".join(b"%x\r\n%b\r\n" % (len(piece), piece) for _ in range(1024)) + b"0\r\n\r\n"
    with connected(port) as sock:
        sock.sendall(b"POST /refuses HTTP/1.1\r\nHost: t\r\nTransfer-Encoding: chunked\r\n\r\n" + body)
        answer = read_until_closed(sock)
    assert answer.startswith(b"HTTP/1.1 413 ")


def test_a_failure_before_the_answer_is_a_500_and_after_it_a_closed_connection(
        served: tuple[Answers, ServerThread, int]) -> None:
    _, _, port = served
    with connected(port) as sock:
        sock.sendall(get(b"/fails", extra=b"X-Request-Id: failing-1\r\n"))
        head, body = split(read_until_closed(sock))
    assert head.startswith(b"HTTP/1.1 500 ")
    assert header(head, b"x-request-id") == b"failing-1"
    assert orjson.loads(body) == {"error": {"message": "internal server error", "type": "server_error",
                                            "param": None, "code": None}}
    with connected(port) as sock:
        sock.sendall(get(b"/fails-late"))
        head, body = split(read_until_closed(sock))
    assert header(head, b"transfer-encoding") == b"chunked"
    assert body == b"5\r\nfirst\r\n"  # cut short: no last chunk, so the client cannot take it for whole


def test_an_app_that_raises_what_is_no_exception_gets_a_500_and_the_server_serves_on(
        served: tuple[Answers, ServerThread, int]) -> None:
    _, _, port = served
    with connected(port) as sock:
        sock.sendall(get(b"/exits"))
        head, _ = split(read_until_closed(sock))
    assert head.startswith(b"HTTP/1.1 500 ")
    with connected(port) as sock:
        sock.sendall(get(b"/echo", extra=b"Connection: close\r\n"))
        assert split(read_until_closed(sock))[1] == b"/echo?"


def test_a_client_that_asks_to_close_gets_its_answer_then_the_close(served: tuple[Answers, ServerThread, int]) -> None:
    _, _, port = served
    with connected(port) as sock:
        sock.sendall(get(b"/echo", extra=b"Connection: close\r\n") + get(b"/echo?never"))
        head, body = split(read_until_closed(sock))
    assert header(head, b"connection") == b"close"
    assert body == b"/echo?"


def test_a_graceful_shutdown_lets_the_answer_in_progress_finish_then_closes(
        served: tuple[Answers, ServerThread, int]) -> None:
    app, thread, port = served
    with connected(port) as sock:
        sock.sendall(get(b"/held"))
        received = b""
        while b"first " not in received:
            received += sock.recv(65536)
        thread.server.should_exit = True  # (the fixture's stop then finds it stopped)

        def refused() -> bool:
            try:
                socket.create_connection(("127.0.0.1", port), timeout=5).close()
            except ConnectionRefusedError:
                return True
            return False
        assert eventually(refused, every_s=0.05), "the server kept accepting connections"
        # Sent now, queued behind the answer in progress: a connection kept after it would answer it too.
        sock.sendall(get(b"/echo?after-the-shutdown"))
        assert app.loop is not None and app.release is not None
        app.loop.call_soon_threadsafe(app.release.set)
        received += read_until_closed(sock)
    assert received.endswith(b"6\r\nsecond\r\n0\r\n\r\n")
    assert received.count(b"HTTP/1.1 ") == 1


def test_an_http_1_0_client_gets_no_chunks_even_where_the_app_asks_for_them(
        served: tuple[Answers, ServerThread, int]) -> None:
    _, _, port = served
    with connected(port) as sock:
        sock.sendall(b"GET /chunked HTTP/1.0\r\n\r\n")
        head, body = split(read_until_closed(sock))
    assert header(head, b"transfer-encoding") is None
    assert body == b"one two"
    with connected(port) as sock:  # and an HTTP/1.1 client gets the chunks the app asked for
        sock.sendall(get(b"/chunked", extra=b"Connection: close\r\n"))
        head, body = split(read_until_closed(sock))
    assert header(head, b"transfer-encoding") == b"chunked"
    assert body == b"4\r\none \r\n3\r\ntwo\r\n0\r\n\r\n"

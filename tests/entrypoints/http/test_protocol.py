"""The front ends' HTTP protocol (``entrypoints/http/protocol.py``) hands the app a request body of declared length
whole, in one message, however many pieces it arrived in, read past the parser into its own buffer; other bodies
arrive uvicorn's way. Real uvicorn server on asyncio's event loop and on uvloop (production's: it reads into a
protocol's buffers by other code), raw client sockets (so the pieces and their timing are the test's)."""

from __future__ import annotations

import asyncio
import contextlib
import socket
import threading
from collections.abc import Iterator
from typing import Any

import pytest
import uvloop

from entrypoints.http import protocol as http_protocol
from entrypoints.http.protocol import guarded_protocol
from frontend import read_buffers
from tests.servers import ServerThread
from tests.waiting import eventually


class Recorder:
    """An ASGI app that reads the whole body, keeps every message it received, and answers the body's length; a
    body declared longer than ``refuse_over`` gets a 413 at once, unread."""

    def __init__(self) -> None:
        self.messages: list[list[dict[str, Any]]] = []
        self.lock = threading.Lock()
        self.refuse_over: int | None = None

    async def __call__(self, scope: dict[str, Any], receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            return
        declared = dict(scope["headers"]).get(b"content-length", b"0")
        if self.refuse_over is not None and int(declared) > self.refuse_over:
            await send({"type": "http.response.start", "status": 413, "headers": [(b"content-length", b"0")]})
            await send({"type": "http.response.body", "body": b""})
            return
        got: list[dict[str, Any]] = []
        with self.lock:
            self.messages.append(got)
        while True:
            message = await receive()
            got.append(message)
            if message["type"] == "http.disconnect" or not message.get("more_body", False):
                break
        if got[-1]["type"] == "http.disconnect":
            return
        answer = b"%d" % sum(len(m.get("body", b"")) for m in got)
        await send({"type": "http.response.start", "status": 200,
                    "headers": [(b"content-type", b"text/plain"), (b"content-length", b"%d" % len(answer))]})
        await send({"type": "http.response.body", "body": answer})


@pytest.fixture(params=[asyncio.new_event_loop, uvloop.new_event_loop], ids=["asyncio", "uvloop"])
def server(request: pytest.FixtureRequest) -> Iterator[tuple[Recorder, int]]:
    app = Recorder()
    thread = ServerThread(app, event_loop=request.param, http=guarded_protocol(), lifespan="off")
    url = thread.start()
    try:
        yield app, int(url.rsplit(":", 1)[1])
    finally:
        thread.stop()


def head(length: int | None) -> bytes:
    framing = b"Transfer-Encoding: chunked\r\n" if length is None else b"Content-Length: %d\r\n" % length
    return b"POST /x HTTP/1.1\r\nHost: t\r\n" + framing + b"\r\n"


def read_answer(sock: socket.socket, status: bytes = b"200") -> bytes:
    received = b""
    while b"\r\n\r\n" not in received:
        chunk = sock.recv(65536)
        assert chunk, f"closed before an answer: {received!r}"
        received += chunk
    head_part, _, body = received.partition(b"\r\n\r\n")
    assert head_part.split(b" ")[1] == status, head_part
    length = next(int(line.split(b":")[1]) for line in head_part.split(b"\r\n")
                  if line.lower().startswith(b"content-length"))
    while len(body) < length:
        body += sock.recv(65536)
    return body


def read_answers(sock: socket.socket, count: int) -> list[bytes]:
    """The bodies of ``count`` answers with a Content-Length, however the server's sends split or joined them."""
    received, bodies = b"", list[bytes]()
    while len(bodies) < count:
        head_part, separator, rest = received.partition(b"\r\n\r\n")
        if separator:
            length = next(int(line.split(b":")[1]) for line in head_part.split(b"\r\n")
                          if line.lower().startswith(b"content-length"))
            if len(rest) >= length:
                bodies.append(rest[:length])
                received = rest[length:]
                continue
        received += sock.recv(65536)
    return bodies


@contextlib.contextmanager
def connected(port: int) -> Iterator[socket.socket]:
    with socket.create_connection(("127.0.0.1", port), timeout=60) as sock:
        yield sock


def send_in_pieces(sock: socket.socket, data: bytes, size: int) -> None:
    for start in range(0, len(data), size):
        sock.sendall(data[start:start + size])


def body_of(size: int) -> bytes:
    return bytes(i % 251 for i in range(size))


@pytest.mark.parametrize("piece_bytes", [read_buffers.PIECE_BYTES, 70_000], ids=["one piece", "many pieces"])
def test_a_long_body_sent_in_pieces_reaches_the_app_whole_in_one_message(
        server: tuple[Recorder, int], monkeypatch: pytest.MonkeyPatch, piece_bytes: int) -> None:
    app, port = server
    monkeypatch.setattr(read_buffers, "PIECE_BYTES", piece_bytes)  # the buffers it is read into, joined at the end
    body = body_of(1_000_000)
    with connected(port) as sock:
        sock.sendall(head(len(body)))
        send_in_pieces(sock, body, 100_000)  # ten pieces, each its own send
        assert read_answer(sock) == b"1000000"
        # The same connection, kept alive: the next request is read whole as well.
        sock.sendall(head(len(body)) + body)
        assert read_answer(sock) == b"1000000"
    assert [[(m["type"], len(m["body"]), m["more_body"]) for m in got] for got in app.messages] == \
        [[("http.request", 1_000_000, False)]] * 2
    assert all(got[0]["body"] == body for got in app.messages)


def test_a_body_over_the_limit_or_without_a_length_arrives_in_pieces_intact(
        server: tuple[Recorder, int], monkeypatch: pytest.MonkeyPatch) -> None:
    app, port = server
    monkeypatch.setattr(http_protocol, "WHOLE_BODY_UP_TO", 200_000)
    body = body_of(1_000_000)
    with connected(port) as sock:
        sock.sendall(head(len(body)))
        send_in_pieces(sock, body, 100_000)
        assert read_answer(sock) == b"1000000"
        sock.sendall(head(None))
        for start in range(0, len(body), 100_000):
            piece = body[start:start + 100_000]
            sock.sendall(b"%x\r\n%s\r\n" % (len(piece), piece))
        sock.sendall(b"0\r\n\r\n")
        assert read_answer(sock) == b"1000000"
    for got in app.messages:
        assert b"".join(m["body"] for m in got) == body
        assert [m["more_body"] for m in got][-1] is False


def test_a_client_gone_mid_body_is_a_disconnect_not_a_body(server: tuple[Recorder, int]) -> None:
    app, port = server
    with connected(port) as sock:
        sock.sendall(head(1_000_000) + body_of(300_000))
        assert eventually(lambda: len(app.messages) == 1)
    assert eventually(lambda: bool(app.messages[0]))
    assert [m["type"] for m in app.messages[0]] == ["http.disconnect"]


@pytest.fixture
def parsed(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """The size of every piece the HTTP parser is handed."""
    sizes: list[int] = []
    feed = http_protocol.GuardedProtocol.data_received

    def counted(self: Any, data: bytes) -> None:
        sizes.append(len(data))
        feed(self, data)

    monkeypatch.setattr(http_protocol.GuardedProtocol, "data_received", counted)
    return sizes


def test_a_long_body_goes_past_the_parser_into_its_own_buffer(server: tuple[Recorder, int], parsed: list[int]) -> None:
    app, port = server
    body = body_of(1_000_000)
    with connected(port) as sock:
        sock.sendall(head(len(body)) + body)
        assert read_answer(sock) == b"1000000"
    # At most the read of the head passed the parser: the rest went straight into the body's buffer.
    assert 0 < sum(parsed) <= read_buffers.HEAD_READ_BYTES
    [[message]] = app.messages
    assert type(message["body"]) is bytes and message["body"] == body


def test_the_read_of_a_body_stops_at_its_end_so_the_next_request_on_the_connection_is_parsed(
        server: tuple[Recorder, int]) -> None:
    app, port = server
    first, second = body_of(500_000), body_of(200_000)[::-1]
    with connected(port) as sock:
        # Both requests in one send: the first body's last bytes and the second request's head arrive together.
        sock.sendall(head(len(first)) + first + head(len(second)) + second + head(3) + b"abc")
        assert read_answers(sock, 3) == [b"500000", b"200000", b"3"]
    assert [got[0]["body"] for got in app.messages] == [first, second, b"abc"]


def test_a_body_answered_before_it_is_read_is_dropped_and_the_connection_closes_after_the_answer(
        server: tuple[Recorder, int]) -> None:
    """The answer says ``connection: close``; what the client still sends of the body is read and dropped, never
    parsed, and nothing after it is taken for a request (it would be the rest of the body to a server that reads
    on, or a next request to one that does not: the client cannot tell which)."""
    app, port = server
    app.refuse_over = 400_000
    body = body_of(1_000_000)
    with connected(port) as sock:
        sock.sendall(head(len(body)))
        answer = b""
        while b"\r\n\r\n" not in answer:
            chunk = sock.recv(65536)
            assert chunk, "closed before the answer"
            answer += chunk
        assert answer.startswith(b"HTTP/1.1 413 ")
        assert b"\r\nconnection: close\r\n" in answer.lower()
        with contextlib.suppress(ConnectionError):  # the server may close once its linger is over
            send_in_pieces(sock, body, 100_000)
            sock.sendall(head(5) + b"hello")
        rest = b""
        with contextlib.suppress(ConnectionResetError):
            while chunk := sock.recv(65536):
                rest += chunk
        assert rest == b""  # no second answer: the connection ended
    assert app.messages == []  # nor did the request after the body reach the app: what followed was dropped


def test_after_a_long_body_a_pipelined_request_that_closes_is_still_answered(server: tuple[Recorder, int]) -> None:
    # uvicorn's parser is lenient about bytes after a request that says Connection: close (it answers that one);
    # the parser that replaces it after a body read past it must be too.
    _, port = server
    with connected(port) as sock:
        sock.sendall(head(100_000) + body_of(100_000))
        assert read_answer(sock) == b"100000"
        closing = b"POST /x HTTP/1.1\r\nHost: t\r\nConnection: close\r\nContent-Length: 3\r\n\r\nabc"
        sock.sendall(closing + head(3) + b"def")
        assert read_answer(sock) == b"3"
        assert sock.recv(1) == b""  # then closed: the request after it is not served

"""The bare-ASGI fast path (``frontend.asgi_fast_path``) on real uvicorn servers, raw sockets where bytes matter.

Every behaviour is checked under both ways the exchange learns that a client left: uvicorn's own protocol (a task
waiting on ``receive``) and the project's protocol (``entrypoints/http/protocol.py``, the ``CLIENT_GONE``
extension, no task), which also drops a stalled client at once.
"""

from __future__ import annotations

import asyncio
import contextlib
import http.client
import logging
import socket
import threading
from collections.abc import AsyncIterator, Iterator
from dataclasses import dataclass
from typing import Any

import httpx
import orjson
import pytest
from fastapi import Request
from starlette.responses import Response, StreamingResponse

from entrypoints.http.limits import ClientLimits
from entrypoints.http.protocol import guarded_protocol
from frontend.asgi_fast_path import ChunkWriter, Drained, Exchange, FastPathApp, LastChunkWriter
from frontend.errors import OverloadedError, UpstreamError
from frontend.http import error_response, install_error_handlers, install_request_ids, json_response, read_body
from frontend.send_timeout import with_send_timeout
from frontend.sse import SSE_HEADERS, SSE_MEDIA_TYPE, SSE_RAW_HEADERS
from tests.servers import ServerThread
from tests.waiting import eventually

LIMIT = 1024
SEND_TIMEOUT_S = 1.0
FRAMES = [b'data: {"n": 1}\n\n', b'data: {"n": 2}\n\n', b"data: [DONE]\n\n"]
BIG_FRAME = b"data: " + b"x" * 65_536 + b"\n\n"
CHUNKS = [b"%x\r\n%b\r\n" % (len(frame), frame) for frame in FRAMES]  # FRAMES as a chunked body frames them


class Probe:
    """What the handlers saw, written on the server's thread and read on the test's."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.waiting: set[str] = set()
        self.cancelled: set[str] = set()
        self.streamed: dict[str, int] = {}
        self.survived: set[str] = set()
        self.failed: set[str] = set()  # raised past its answer's end (what follows in the same loop step)
        self.clean_up = threading.Event()  # set by the test: the handler's clean-up may end
        self.first_piece = threading.Event()  # set by the test: a late pushed stream's first piece may come
        self.fail_after_end = threading.Event()  # set by the test: a pushed stream past its end may fail

    def add(self, kind: set[str], request_id: str) -> None:
        with self.lock:
            kind.add(request_id)


def make_app(probe: Probe) -> FastPathApp:
    app = FastPathApp()
    install_error_handlers(app)
    install_request_ids(app)

    async def echo(exchange: Exchange) -> None:
        await exchange.answer(await exchange.read_body(LIMIT))

    async def fail(exchange: Exchange) -> None:
        await exchange.read_body(LIMIT)  # (an answer before the body is in closes the connection: not this test's)
        raise RuntimeError("secret internals")

    async def busy(exchange: Exchange) -> None:
        raise OverloadedError("busy", retry_after_s=3)

    async def upstream(exchange: Exchange) -> None:
        raise UpstreamError("the GEN step failed: no luck")

    async def hang(exchange: Exchange) -> None:
        await exchange.read_body(LIMIT)
        probe.add(probe.waiting, exchange.request_id)
        try:
            await asyncio.Event().wait()
        except asyncio.CancelledError:
            probe.add(probe.cancelled, exchange.request_id)
            raise

    async def stream(exchange: Exchange) -> None:
        await exchange.read_body(LIMIT)
        await exchange.stream(_frames(), SSE_RAW_HEADERS)

    async def stream_then_hang(exchange: Exchange) -> None:
        await exchange.read_body(LIMIT)
        await exchange.stream(_first_then_hang(probe, exchange.request_id), SSE_RAW_HEADERS)

    async def stream_forever(exchange: Exchange) -> None:
        await exchange.read_body(LIMIT)
        await exchange.stream(_forever(probe, exchange.request_id), SSE_RAW_HEADERS)

    async def silent(exchange: Exchange) -> None:
        await exchange.read_body(LIMIT)  # and answers nothing: a bug the server must still answer for

    async def breaks_mid_stream(exchange: Exchange) -> None:
        await exchange.read_body(LIMIT)
        await exchange.stream(_first_then_fail(), SSE_RAW_HEADERS)

    async def stream_then_clean_up(exchange: Exchange) -> None:
        await exchange.read_body(LIMIT)
        await exchange.stream(_frames(), SSE_RAW_HEADERS)
        try:  # the clean-up after the answer, as the orchestrator's close_upstream
            await asyncio.to_thread(probe.clean_up.wait, 60)
        except asyncio.CancelledError:
            probe.add(probe.cancelled, exchange.request_id)
            raise
        probe.add(probe.survived, exchange.request_id)

    async def pushed(exchange: Exchange) -> None:
        await exchange.read_body(LIMIT)
        mode = exchange.scope["path"].removeprefix("/pushed").removeprefix("-")
        await exchange.push(_Pushed(probe, exchange.request_id, mode), SSE_RAW_HEADERS)

    async def kind(exchange: Exchange) -> None:
        await exchange.answer(orjson.dumps(type(exchange).__name__))

    for path, handler in (("/kind", kind), ("/silent", silent), ("/stream-then-clean-up", stream_then_clean_up),
                          ("/breaks-mid-stream", breaks_mid_stream),
                          ("/echo", echo), ("/fail", fail), ("/busy", busy), ("/upstream", upstream),
                          ("/hang", hang), ("/stream", stream), ("/stream-then-hang", stream_then_hang),
                          ("/stream-forever", stream_forever), ("/pushed", pushed), ("/pushed-late", pushed),
                          ("/pushed-then-fails", pushed)):
        app.fast_post(path, handler)

    # The same answers served by FastAPI's own stack, to compare with byte for byte.
    @app.post("/slow/echo")
    async def slow_echo(request: Request) -> Response:
        return Response(await read_body(request, LIMIT), media_type="application/json")

    @app.post("/slow/busy")
    async def slow_busy() -> Response:
        return error_response(OverloadedError("busy", retry_after_s=3))

    @app.post("/slow/stream")
    async def slow_stream() -> Response:
        return StreamingResponse(_frames(), media_type=SSE_MEDIA_TYPE, headers=SSE_HEADERS)

    @app.get("/plain")
    async def plain() -> Response:
        return json_response({"served": "by FastAPI"})

    return app


async def _frames() -> AsyncIterator[bytes]:
    for frame in FRAMES:
        yield frame


class _Pushed:
    """``FRAMES`` pushed as the orchestrator's relay pushes GEN's stream (``frontend.asgi_fast_path.PushedStream``):
    the first piece at once (as one that came with GEN's head), or once the test lets it come (``late``); each
    next one after the loop has turned (another read of GEN's); the last one ending the answer; and, ``then-fails``,
    a piece after it and a failure once the test says so, as a GEN stream that breaks after its end marker."""

    def __init__(self, probe: Probe, request_id: str, mode: str) -> None:
        self.probe = probe
        self.request_id = request_id
        self.mode = mode

    async def frames(self) -> AsyncIterator[bytes]:
        await self._first_piece()
        for frame in FRAMES:
            yield frame

    async def push(self, write: ChunkWriter, drained: Drained, finish: LastChunkWriter) -> None:
        await self._first_piece()
        for frame in FRAMES[:-1]:
            if not write(frame):
                await drained()
            await asyncio.sleep(0)
        finish(FRAMES[-1])
        if self.mode == "then-fails":
            write(b"data: after the end\n\n")
            self.probe.add(self.probe.waiting, self.request_id)
            assert await asyncio.to_thread(self.probe.fail_after_end.wait, 60)
            self.probe.add(self.probe.failed, self.request_id)  # the exchange's handling of it runs in this step
            raise RuntimeError("the upstream broke after its end marker")

    async def _first_piece(self) -> None:
        if self.mode == "late":
            self.probe.add(self.probe.waiting, self.request_id)
            assert await asyncio.to_thread(self.probe.first_piece.wait, 60)


async def _first_then_fail() -> AsyncIterator[bytes]:
    yield FRAMES[0]
    raise RuntimeError("the upstream broke")


async def _first_then_hang(probe: Probe, request_id: str) -> AsyncIterator[bytes]:
    yield FRAMES[0]
    probe.add(probe.waiting, request_id)
    try:
        await asyncio.Event().wait()
    finally:
        probe.add(probe.cancelled, request_id)  # closed by the exchange: the upstream would be aborted here
    yield FRAMES[1]


async def _forever(probe: Probe, request_id: str) -> AsyncIterator[bytes]:
    try:
        while True:
            with probe.lock:
                probe.streamed[request_id] = probe.streamed.get(request_id, 0) + 1
            yield BIG_FRAME
    finally:
        probe.add(probe.cancelled, request_id)


@dataclass
class Served:
    address: tuple[str, int]
    url: str
    probe: Probe
    protocol: str
    thread: ServerThread


@pytest.fixture(scope="module", params=["uvicorn", "project", "direct"])
def served(request: pytest.FixtureRequest) -> Iterator[Served]:
    """The app on uvicorn's own httptools protocol, on the project's (``entrypoints/http/protocol.py``) through
    ASGI, or on the project's serving the fast routes itself, as ``disagg-serve`` runs it
    (``entrypoints/http/exchange.py``)."""
    probe = Probe()
    app = make_app(probe)
    options: dict[str, Any] = {}
    if request.param != "uvicorn":
        options["http"] = guarded_protocol(ClientLimits(), app if request.param == "direct" else None)
    server = ServerThread(with_send_timeout(app, SEND_TIMEOUT_S), **options)
    url = server.start()
    try:
        host, _, port = url.removeprefix("http://").partition(":")
        yield Served((host, int(port)), url, probe, request.param, server)
    finally:
        server.stop()


@pytest.fixture
def server(served: Served) -> tuple[str, int]:
    return served.address


@pytest.fixture
def url(served: Served) -> str:
    return served.url


@pytest.fixture
def probe(served: Served) -> Probe:
    return served.probe


def _raw_request(path: str, body: bytes = b"{}", request_id: str | None = None, method: str = "POST") -> bytes:
    head = f"{method} {path} HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
    if request_id is not None:
        head += f"X-Request-Id: {request_id}\r\n"
    return head.encode() + b"Content-Length: " + str(len(body)).encode() + b"\r\n\r\n" + body


def _exchange(server: tuple[str, int], path: str, body: bytes = b"{}") -> tuple[list[tuple[str, str]], bytes]:
    """One request on a fresh connection: the answer's headers (date aside) and its raw bytes after them."""
    with socket.create_connection(server, timeout=30) as sock:
        sock.sendall(_raw_request(path, body, request_id="same-id"))
        received = b""
        while not (received.endswith(b"0\r\n\r\n") or _whole(received)):
            chunk = sock.recv(65536)
            assert chunk, f"connection closed after {received!r}"
            received += chunk
    head, _, rest = received.partition(b"\r\n\r\n")
    lines = head.decode("latin-1").split("\r\n")[1:]
    headers = [(k.lower(), v) for k, _, v in (line.partition(": ") for line in lines) if k.lower() != "date"]
    return [(f"status {head.split()[1].decode()}", ""), *headers], rest


def _whole(received: bytes) -> bool:
    head, found, rest = received.partition(b"\r\n\r\n")
    if not found or b"content-length:" not in head.lower():
        return False
    lines = head.lower().split(b"\r\n")
    return len(rest) >= int(next(line.split(b":")[1] for line in lines if line.startswith(b"content-length")))


# -- answers identical to FastAPI's ---------------------------------------------------------------------------------
@pytest.mark.parametrize("name", ["echo", "busy", "stream"])
def test_answers_are_byte_identical_to_the_fastapi_stacks(server: tuple[str, int], name: str) -> None:
    body = b'{"a": [1, 2, {"b": null}]}'
    assert _exchange(server, f"/{name}", body) == _exchange(server, f"/slow/{name}", body)


def test_a_pushed_answer_is_byte_identical_to_the_streamed_one(server: tuple[str, int]) -> None:
    assert _exchange(server, "/pushed") == _exchange(server, "/slow/stream")


class RecordedSends:
    """A connection's transport that records each send before it makes it (everything else is the transport's)."""

    def __init__(self, transport: Any) -> None:
        self._transport = transport
        self.sends: list[bytes] = []

    def write(self, data: bytes) -> None:
        self.sends.append(bytes(data))
        self._transport.write(data)

    def writelines(self, pieces: Any) -> None:
        pieces = list(pieces)
        self.sends.append(b"".join(pieces))
        self._transport.writelines(pieces)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._transport, name)


def test_a_pushed_answer_sends_its_head_with_its_first_piece_and_its_end_with_its_last(served: Served) -> None:
    """One send per piece and none more (issue 31): the head goes with a first piece that is already there, the end
    of the chunked body with the piece that ends the stream."""
    if served.protocol != "direct":
        pytest.skip("through ASGI, the sends are the server's own")
    connections = served.thread.server.server_state.connections
    with socket.create_connection(served.address, timeout=30) as sock:
        client = sock.getsockname()
        assert eventually(lambda: any(getattr(c, "client", None) == client for c in list(connections)))
        (connection,) = [c for c in list(connections) if getattr(c, "client", None) == client]
        recorded = RecordedSends(connection.transport)
        connection.transport = recorded  # type: ignore[assignment]  # the next request's cycle takes it
        sock.sendall(_raw_request("/pushed", request_id="counted"))
        (answer,) = _read_answers(sock, 1)
    head, _, _ = answer.partition(b"\r\n\r\n")
    assert recorded.sends == [head + b"\r\n\r\n" + CHUNKS[0], *CHUNKS[1:-1], CHUNKS[-1] + b"0\r\n\r\n"]


def test_a_pushed_answer_ended_at_its_end_marker_leaves_its_connection_to_the_next_request(served: Served) -> None:
    """Ended whole with its last piece, the answer frees the connection while its handler still reads: what the
    handler writes or raises after that touches neither the next answer nor the connection."""
    if served.protocol != "direct":
        pytest.skip("through ASGI, an answer ends with its handler")
    with socket.create_connection(served.address, timeout=30) as sock:
        sock.sendall(_raw_request("/pushed-then-fails", request_id="ends-early"))
        (first,) = _read_answers(sock, 1)
        assert eventually(lambda: "ends-early" in served.probe.waiting)  # its handler runs on
        assert first.partition(b"\r\n\r\n")[2] == b"".join(CHUNKS) + b"0\r\n\r\n"
        sock.sendall(_raw_request("/echo", b'{"next": 1}', "next"))
        (second,) = _read_answers(sock, 1)
        served.probe.fail_after_end.set()
        assert eventually(lambda: "ends-early" in served.probe.failed)  # the next request is read after it
        sock.sendall(_raw_request("/echo", b'{"then": 2}', "then"))
        (third,) = _read_answers(sock, 1)
    assert second.endswith(b'{"next": 1}') and third.endswith(b'{"then": 2}')


def test_a_pushed_answer_whose_first_piece_is_late_sends_its_head_at_once(server: tuple[str, int],
                                                                        probe: Probe) -> None:
    with socket.create_connection(server, timeout=30) as sock:
        sock.sendall(_raw_request("/pushed-late", request_id="late"))
        assert eventually(lambda: "late" in probe.waiting)
        received = b""
        while b"\r\n\r\n" not in received:  # the head, while the stream has nothing yet
            chunk = sock.recv(65536)
            assert chunk, f"connection closed after {received!r}"
            received += chunk
        assert received.startswith(b"HTTP/1.1 200") and received.endswith(b"\r\n\r\n")
        probe.first_piece.set()
        (answer,) = _read_answers(sock, 1, received)
    assert answer.partition(b"\r\n\r\n")[2] == b"".join(CHUNKS) + b"0\r\n\r\n"


def test_a_stream_is_framed_as_it_was_yielded(url: str) -> None:
    with httpx.Client(timeout=30) as http, http.stream("POST", url + "/stream", content=b"{}") as reply:
        assert reply.headers["content-type"] == "text/event-stream; charset=utf-8"
        assert b"".join(reply.iter_raw()) == b"".join(FRAMES)


def test_the_projects_protocol_serves_the_fast_routes_itself_once_it_is_given_the_app(served: Served) -> None:
    expected = "CycleExchange" if served.protocol == "direct" else "AsgiExchange"
    assert httpx.post(served.url + "/kind", content=b"{}", timeout=30).json() == expected


def _read_answers(sock: socket.socket, count: int, received: bytes = b"") -> list[bytes]:
    """``count`` answers read off ``sock`` (after the ``received`` start), each its head and body (a stream's
    chunks still framed)."""
    answers = list[bytes]()
    while len(answers) < count:
        head, found, rest = received.partition(b"\r\n\r\n")
        if found and b"transfer-encoding: chunked" in head.lower() and b"0\r\n\r\n" in rest:
            end = rest.index(b"0\r\n\r\n") + 5
            answers.append(received[:len(head) + 4 + end])
            received = rest[end:]
            continue
        if found and _whole(received):
            length = int(next(line.split(b":")[1] for line in head.lower().split(b"\r\n")
                              if line.startswith(b"content-length")))
            answers.append(received[:len(head) + 4 + length])
            received = rest[length:]
            continue
        chunk = sock.recv(65536)
        assert chunk, f"connection closed after {answers!r} and {received!r}"
        received += chunk
    return answers


def test_pipelined_requests_are_answered_in_order_on_one_connection(server: tuple[str, int]) -> None:
    with socket.create_connection(server, timeout=30) as sock:
        sock.sendall(_raw_request("/stream", request_id="first") + _raw_request("/echo", b'{"n": 2}', "second")
                     + _raw_request("/busy", request_id="third"))
        first, second, third = _read_answers(sock, 3)
    assert b"x-request-id: first" in first and first.endswith(b"0\r\n\r\n")
    assert b"x-request-id: second" in second and second.endswith(b'{"n": 2}')
    assert third.startswith(b"HTTP/1.1 429") and b"x-request-id: third" in third


def test_a_request_saying_connection_close_is_answered_then_closed(server: tuple[str, int]) -> None:
    with socket.create_connection(server, timeout=30) as sock:
        sock.sendall(_raw_request("/echo", b'{"bye": 1}').replace(b"Host: x\r\n", b"Host: x\r\nConnection: close\r\n"))
        received = b""
        while chunk := sock.recv(65536):
            received += chunk
    assert received.startswith(b"HTTP/1.1 200") and b"connection: close\r\n" in received
    assert received.endswith(b'{"bye": 1}')


def test_a_client_expecting_100_continue_gets_it_before_sending_the_body(server: tuple[str, int]) -> None:
    with socket.create_connection(server, timeout=30) as sock:
        head, _, body = _raw_request("/echo", b'{"later": true}').partition(b"\r\n\r\n")
        sock.sendall(head + b"\r\nExpect: 100-continue\r\n\r\n")
        received = b""
        while b"\r\n\r\n" not in received:
            chunk = sock.recv(65536)
            assert chunk
            received += chunk
        assert received == b"HTTP/1.1 100 Continue\r\n\r\n"
        sock.sendall(body)
        (answer,) = _read_answers(sock, 1)
    assert answer.startswith(b"HTTP/1.1 200") and answer.endswith(b'{"later": true}')


@pytest.mark.parametrize(("size", "status"), [(LIMIT, 200), (LIMIT + 1, 413)])
def test_a_chunked_body_is_read_whole_and_judged_by_its_size(server: tuple[str, int], size: int,
                                                             status: int) -> None:
    body = b'"' + b"x" * (size - 2) + b'"'
    pieces = [body[i:i + 100] for i in range(0, len(body), 100)]
    with socket.create_connection(server, timeout=30) as sock:
        sock.sendall(b"POST /echo HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: chunked\r\n\r\n")
        for piece in pieces:  # each its own send: the server may read them together or apart
            sock.sendall(b"%x\r\n%b\r\n" % (len(piece), piece))
        sock.sendall(b"0\r\n\r\n")
        (answer,) = _read_answers(sock, 1)
    assert answer.startswith(b"HTTP/1.1 %d" % status)
    if status == 200:
        assert answer.endswith(body)


# -- request ids ----------------------------------------------------------------------------------------------------
@pytest.mark.parametrize(("path", "status"), [("/echo", 200), ("/busy", 429), ("/fail", 500), ("/upstream", 502)])
def test_every_answer_carries_the_clients_request_id(url: str, path: str, status: int) -> None:
    reply = httpx.post(url + path, content=b"{}", headers={"X-Request-Id": "client-7"}, timeout=30)
    assert reply.status_code == status
    assert reply.headers["x-request-id"] == "client-7"


def test_a_413_carries_a_new_request_id_when_the_clients_is_not_sane(url: str) -> None:
    reply = httpx.post(url + "/echo", content=b"x" * (LIMIT + 1), headers={"X-Request-Id": "bad id\twith tab"},
                       timeout=30)
    assert reply.status_code == 413
    assert reply.json()["error"]["code"] == "payload_too_large"
    assert len(reply.headers["x-request-id"]) == 32 and reply.headers["x-request-id"] != "bad id\twith tab"


# -- errors ---------------------------------------------------------------------------------------------------------
def test_an_unexpected_error_is_a_500_in_openai_shape_and_the_connection_stays_open(server: tuple[str, int]) -> None:
    connection = http.client.HTTPConnection(*server, timeout=30)
    try:
        for _ in range(3):
            connection.request("POST", "/fail", body=b"{}")
            failed = connection.getresponse()
            assert failed.status == 500
            assert orjson.loads(failed.read())["error"] == {"message": "internal server error", "type": "server_error",
                                                            "param": None, "code": None}
            sock = connection.sock
            connection.request("POST", "/echo", body=b'{"still": "serving"}')
            served = connection.getresponse()
            assert served.status == 200 and served.read() == b'{"still": "serving"}'
            assert connection.sock is sock  # the same keep-alive connection
    finally:
        connection.close()


def test_a_handler_that_answers_nothing_gets_a_500_and_a_closed_connection(server: tuple[str, int],
                                                                           served: Served) -> None:
    with socket.create_connection(server, timeout=30) as sock:
        sock.sendall(_raw_request("/silent", request_id="silent"))
        received = b""
        while chunk := sock.recv(65536):
            received += chunk
    assert received.startswith(b"HTTP/1.1 500") and b"connection: close\r\n" in received.lower()
    if served.protocol == "direct":
        assert b"x-request-id: silent\r\n" in received
        assert received.endswith(b'"server_error","param":null,"code":null}}')


def test_a_stream_that_breaks_after_its_start_closes_the_connection(server: tuple[str, int], served: Served,
                                                                     caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.ERROR)
    with socket.create_connection(server, timeout=30) as sock:
        sock.sendall(_raw_request("/breaks-mid-stream", request_id="breaks"))
        received = b""
        while chunk := sock.recv(65536):
            received += chunk
    assert received.startswith(b"HTTP/1.1 200") and FRAMES[0] in received
    assert not received.endswith(b"0\r\n\r\n")  # cut short: no last chunk, the client can tell
    assert any("the upstream broke" in (r.getMessage() + str(r.exc_info)) for r in caplog.records)
    if served.protocol == "direct":  # the project's own log line names the request
        assert any("breaks" in r.getMessage() and "the upstream broke" in r.getMessage() for r in caplog.records)


def test_a_5xx_is_logged_with_its_request_id_and_cause(url: str, caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.ERROR, logger="frontend.http")
    httpx.post(url + "/upstream", content=b"{}", headers={"X-Request-Id": "req-502"}, timeout=30)
    assert any("req-502" in r.getMessage() and "no luck" in r.getMessage() and "POST /upstream" in r.getMessage()
               for r in caplog.records)


def test_other_methods_and_paths_are_fastapis(url: str) -> None:
    for method in ("GET", "HEAD", "OPTIONS", "PUT"):
        reply = httpx.request(method, url + "/echo", timeout=30)
        assert reply.status_code == 405, method
        assert reply.headers["allow"] == "POST"
        assert "x-request-id" in reply.headers
        if method != "HEAD":
            assert reply.json()["error"]["code"] == "method_not_allowed"
    assert httpx.get(url + "/plain", timeout=30).json() == {"served": "by FastAPI"}
    assert httpx.post(url + "/nowhere", timeout=30).json()["error"]["code"] == "not_found"


# -- a client that leaves or stalls ---------------------------------------------------------------------------------
def test_a_client_leaving_while_the_handler_waits_cancels_it(server: tuple[str, int], url: str, probe: Probe) -> None:
    with socket.create_connection(server, timeout=30) as sock:
        sock.sendall(_raw_request("/hang", request_id="leaves-waiting"))
        assert eventually(lambda: "leaves-waiting" in probe.waiting)
    assert eventually(lambda: "leaves-waiting" in probe.cancelled)
    assert httpx.post(url + "/echo", content=b"{}", timeout=30).status_code == 200


def test_a_client_leaving_mid_stream_closes_the_stream(server: tuple[str, int], probe: Probe) -> None:
    with socket.create_connection(server, timeout=30) as sock:
        sock.sendall(_raw_request("/stream-then-hang", request_id="leaves-streaming"))
        assert eventually(lambda: "leaves-streaming" in probe.waiting)
    assert eventually(lambda: "leaves-streaming" in probe.cancelled)


def test_a_client_that_closes_after_the_whole_answer_does_not_cut_the_handlers_clean_up(served: Served) -> None:
    connections = served.thread.server.server_state.connections
    with socket.create_connection(served.address, timeout=30) as sock:
        client = sock.getsockname()
        sock.sendall(_raw_request("/stream-then-clean-up", request_id="reads-all-then-closes"))
        (answer,) = _read_answers(sock, 1)
        assert answer.endswith(b"0\r\n\r\n")
    assert eventually(lambda: all(getattr(c, "client", None) != client for c in list(connections)))
    # The server has seen the connection go (a cancellation, had it been asked for, is pending by now).
    served.probe.clean_up.set()
    assert eventually(lambda: "reads-all-then-closes" in served.probe.survived | served.probe.cancelled)
    assert "reads-all-then-closes" in served.probe.survived


def test_a_client_that_stops_reading_is_cut_off(server: tuple[str, int], url: str, probe: Probe) -> None:
    with socket.socket() as sock:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)  # before connecting: no autotuning
        sock.settimeout(30)
        sock.connect(server)
        sock.sendall(_raw_request("/stream-forever", request_id="stalls"))
        # It reads nothing: the server fills what buffers there are, then its send waits; after SEND_TIMEOUT_S
        # the stream is closed (the upstream would be aborted) and the connection dropped.
        assert eventually(lambda: "stalls" in probe.cancelled)
        sent = probe.streamed["stalls"]
        with contextlib.suppress(ConnectionResetError):
            while sock.recv(1 << 20):
                pass
    assert probe.streamed["stalls"] == sent  # nothing more was produced for it
    assert httpx.post(url + "/echo", content=b"{}", timeout=30).status_code == 200

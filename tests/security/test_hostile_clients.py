"""A front end against clients that mean harm or break the rules: raw sockets against a real orchestrator served as
``disagg-serve`` serves it (the project's protocol, uvloop, the direct exchange for its fast routes, FastAPI for the
rest), in front of synthetic workers. Each case failed on the protocol before heads were capped, bodies timed,
``Host`` checked, early answers closed, HTTP/1.0 answered unchunked and trailers kept out of the headers; the
smuggling vectors were already refused, and stay so. The cases of declared bodies (heads that declare what never
comes, per-address caps, a body trickled under its minimum rate, an upgrade offer with a body, a kept connection's
next body clock) failed on bb7e60b, where a declaration was budgeted and timed before a byte of it arrived."""

from __future__ import annotations

import contextlib
import json
import logging
import select
import socket
import time
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import httpx
import pytest
import uvloop

from entrypoints.http.limits import ClientLimits
from entrypoints.http.protocol import guarded_protocol
from frontend.config import parse_config
from frontend.metrics import Metrics
from orchestrator.server import create_orchestrator_app
from tests.cluster import MODEL, sample, start_worker
from tests.servers import ServerThread

BODY_TIMEOUT_S = 0.5  # the server's setting under test, not a wait of the test's
CHAT = json.dumps({"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}).encode()


@dataclass
class Front:
    port: int
    metrics: Metrics

    def cuts(self, reason: str) -> float:
        return sample(self.metrics, "disagg_http_connections_cut_total", reason=reason)


@contextlib.contextmanager
def front_running(body_timeout_s: float, limits: dict[str, Any] | None = None, **settings: Any) -> Iterator[Front]:
    """An orchestrator admitting one request at a time, in front of synthetic workers (``limits``: more of the
    front end's ``ClientLimits``; ``settings``: more of its configuration)."""
    with contextlib.ExitStack() as stack:
        ctx = start_worker(stack, "context")
        gen = start_worker(stack, "generation")
        config = parse_config({"context_servers": {"urls": [ctx.url]}, "generation_servers": {"urls": [gen.url]},
                               "max_concurrent_requests": 1, "max_body_bytes": 64 * 1024, **settings})
        app = create_orchestrator_app(config)
        metrics: Metrics = app.state.metrics
        client_limits = ClientLimits(header_timeout_s=30.0, body_timeout_s=body_timeout_s, **(limits or {}))
        server = ServerThread(app, event_loop=uvloop.new_event_loop,
                              http=guarded_protocol(client_limits, app,
                                                    lambda r: metrics.connections_cut.labels(r).inc()))
        url = server.start()
        stack.callback(server.stop)
        yield Front(int(url.rsplit(":", 1)[1]), metrics)


@pytest.fixture(scope="module")
def front() -> Iterator[Front]:
    """With a short body clock."""
    with front_running(BODY_TIMEOUT_S) as running:
        yield running


@contextlib.contextmanager
def connected(port: int, source: str | None = None) -> Iterator[socket.socket]:
    """A connection from loopback address ``source`` (any of 127.0.0.0/8: a client address of its own), or from
    127.0.0.1."""
    with socket.create_connection(("127.0.0.1", port), timeout=60,
                                  source_address=(source, 0) if source else None) as sock:
        yield sock


def request(path: bytes = b"/v1/chat/completions", body: bytes = CHAT, extra: bytes = b"",
            version: bytes = b"1.1", host: bytes = b"Host: t\r\n") -> bytes:
    return (b"POST %b HTTP/%b\r\n%bContent-Type: application/json\r\nContent-Length: %d\r\n%b\r\n%b"
            % (path, version, host, len(body), extra, body))


def read_until_closed(sock: socket.socket) -> bytes:
    """Everything the server sends until it closes the connection (a reset after its answer counts as a close)."""
    received = b""
    with contextlib.suppress(ConnectionResetError):
        while chunk := sock.recv(65536):
            received += chunk
    return received


def read_one(sock: socket.socket) -> tuple[bytes, bytes]:
    """One answer with a Content-Length: its head and its body."""
    received = b""
    while b"\r\n\r\n" not in received:
        chunk = sock.recv(65536)
        assert chunk, f"closed before an answer: {received!r}"
        received += chunk
    head, _, body = received.partition(b"\r\n\r\n")
    length = int(header(head, b"content-length") or b"0")
    while len(body) < length:
        body += sock.recv(65536)
    return head, body


def header(head: bytes, name: bytes) -> bytes | None:
    for line in head.split(b"\r\n")[1:]:
        key, _, value = line.partition(b":")
        if key.strip().lower() == name:
            return value.strip()
    return None


def status_of(head: bytes) -> int:
    return int(head.split(b" ", 2)[1])


def refused(answer: bytes, status: int, code: str) -> bytes:
    """The head of ``answer``, checked to be a ``status`` refusal that closes the connection, with an OpenAI-shaped
    error of ``code``."""
    head, _, body = answer.partition(b"\r\n\r\n")
    assert status_of(head) == status, answer[:300]
    assert header(head, b"connection") == b"close"
    assert error_of(body)["code"] == code
    return head


def error_of(body: bytes) -> dict[str, Any]:
    error: dict[str, Any] = json.loads(body)["error"]
    assert set(error) == {"message", "type", "param", "code"}
    return error


def still_serving(front: Front) -> None:
    reply = httpx.post(f"http://127.0.0.1:{front.port}/v1/chat/completions", content=CHAT,
                       headers={"content-type": "application/json"}, timeout=60)
    assert reply.status_code == 200, reply.text


# -- heads ----------------------------------------------------------------------------------------------------
def test_a_huge_header_is_refused_with_431_before_it_ends(front: Front) -> None:
    """A header value four times the limit, never finished: the refusal comes from its size, while the client is
    still sending it (before, only the 30 s header clock ended it, and a 48 MiB one cost 27 s of CPU)."""
    before = front.cuts("head_too_large")
    with connected(front.port) as sock:
        sock.sendall(b"POST /v1/chat/completions HTTP/1.1\r\nHost: t\r\nX-Big: " + b"a" * 256 * 1024)
        refused(read_until_closed(sock), 431, "request_header_fields_too_large")
    assert front.cuts("head_too_large") == before + 1
    still_serving(front)


def test_a_head_just_under_the_limit_is_served(front: Front) -> None:
    with connected(front.port) as sock:
        sock.sendall(request(extra=b"X-Big: " + b"a" * 60_000 + b"\r\n"))
        head, _ = read_one(sock)
    assert status_of(head) == 200


@pytest.mark.parametrize("hosts", [b"", b"Host: a\r\nHost: b\r\n"], ids=["no Host", "two Hosts"])
def test_an_http11_request_without_exactly_one_host_is_400(front: Front, hosts: bytes) -> None:
    with connected(front.port) as sock:
        sock.sendall(request(host=hosts))
        answer = read_until_closed(sock)
    head, _, body = answer.partition(b"\r\n\r\n")
    assert status_of(head) == 400
    error = error_of(body)
    assert (error["param"], error["type"]) == ("host", "invalid_request_error")


# Each a way to make a front end and a server behind it disagree on where a request ends; llhttp refuses them all.
SMUGGLING = {
    "CL.TE": b"POST /v1/chat/completions HTTP/1.1\r\nHost: t\r\nContent-Length: 6\r\nTransfer-Encoding: chunked\r\n"
             b"\r\n0\r\n\r\nG",
    "TE.CL": b"POST /v1/chat/completions HTTP/1.1\r\nHost: t\r\nTransfer-Encoding: chunked\r\nContent-Length: 3\r\n"
             b"\r\n8\r\nSMUGGLED\r\n0\r\n\r\n",
    "two lengths": b"POST /v1/chat/completions HTTP/1.1\r\nHost: t\r\nContent-Length: 2\r\nContent-Length: 3\r\n"
                   b"\r\nabc",
    "odd length": b"POST /v1/chat/completions HTTP/1.1\r\nHost: t\r\nContent-Length: +2\r\n\r\nab",
    "obs-fold": b"POST /v1/chat/completions HTTP/1.1\r\nHost: t\r\nX-A: a\r\n b\r\nContent-Length: 0\r\n\r\n",
    "bad chunk size": b"POST /v1/chat/completions HTTP/1.1\r\nHost: t\r\nTransfer-Encoding: chunked\r\n\r\n"
                      b"zz\r\nab\r\n0\r\n\r\n",
    "bare LF": b"POST /v1/chat/completions HTTP/1.1\nHost: t\nContent-Length: 0\n\n",
    "NUL in a header": b"POST /v1/chat/completions HTTP/1.1\r\nHost: t\r\nX-A: a\x00b\r\nContent-Length: 0\r\n\r\n",
}


@pytest.mark.parametrize("raw", SMUGGLING.values(), ids=SMUGGLING.keys())
def test_a_smuggling_vector_is_400_and_a_close(front: Front, raw: bytes) -> None:
    with connected(front.port) as sock:
        sock.sendall(raw)
        answer = read_until_closed(sock)
    assert answer.startswith(b"HTTP/1.1 400 "), answer[:200]
    assert answer.count(b"HTTP/1.1 ") == 1  # nothing after it was taken for a second request
    still_serving(front)


# -- bodies ---------------------------------------------------------------------------------------------------
def test_a_slow_body_holds_no_admission_slot() -> None:
    """With the only slot of ``max_concurrent_requests: 1`` free, a client that sent a head and one byte of its
    body does not keep a fast client at 429 (before, its request was admitted before its body was read)."""
    with front_running(body_timeout_s=600.0) as patient, connected(patient.port) as slow:
        slow.sendall(request(body=b"{" + b" " * 999)[:-999])
        still_serving(patient)
        slow.setblocking(False)
        with pytest.raises(BlockingIOError):
            slow.recv(1)  # the slow client is still waited for, not answered or cut off


def head_only(framing: bytes, extra: bytes = b"") -> bytes:
    """A chat request's head whose body is framed by ``framing`` (a Content-Length or a Transfer-Encoding line),
    asking for ``100 Continue``: that answer says the handler is waiting for the body, past every check before it."""
    return (b"POST /v1/chat/completions HTTP/1.1\r\nHost: t\r\nContent-Type: application/json\r\n%b\r\n"
            b"Expect: 100-continue\r\n%b\r\n" % (framing, extra))


def continued(sock: socket.socket) -> None:
    """Wait for the ``100 Continue`` of a request sent with ``head_only``."""
    received = b""
    while b"\r\n\r\n" not in received:
        chunk = sock.recv(1)  # one byte at a time: nothing of a later answer is taken with it
        assert chunk, "closed before 100 Continue"
        received += chunk
    assert received == b"HTTP/1.1 100 Continue\r\n\r\n", received


def waiting(sock: socket.socket) -> bool:
    """Whether the server has answered nothing on ``sock`` and not closed it."""
    sock.setblocking(False)
    try:
        sock.recv(1, socket.MSG_PEEK)
    except BlockingIOError:
        return True
    finally:
        sock.setblocking(True)
    return False


HOLDERS = {"Content-Length: 64 MiB": b"Content-Length: 67108864", "chunked, no chunk": b"Transfer-Encoding: chunked"}


@pytest.mark.parametrize("framing", HOLDERS.values(), ids=HOLDERS.keys())
def test_heads_that_declare_bodies_never_sent_cost_the_server_nothing(framing: bytes) -> None:
    """Issue 44's outage: 16 connections, from 16 addresses, each send a head declaring a 64 MiB body (or a chunked
    one) and not a byte of it. On bb7e60b each declaration was budgeted at its size (a chunked one at the body
    limit) before a byte came, the 1 GiB of bodies being read was full, and every other client got 429 for as long
    as the holders held: up to 32 minutes. Now a declaration costs nothing: a fast client is served while they hold,
    and the holders are still waited for."""
    with front_running(600.0, max_body_bytes=64 * 1024 * 1024) as patient, contextlib.ExitStack() as holders:
        held = [holders.enter_context(connected(patient.port, f"127.0.0.{2 + i}")) for i in range(16)]
        for sock in held:
            sock.sendall(head_only(framing))
            continued(sock)  # its handler waits for its body
        still_serving(patient)
        assert all(waiting(sock) for sock in held)


def test_body_reads_are_capped_per_client_address(caplog: pytest.LogCaptureFixture) -> None:
    """Past ``max_body_reads_per_client`` bodies being read from one address, the next is refused with a 429 and a
    close, logged with its request id and cause; another address is served meanwhile."""
    with front_running(600.0, limits={"max_body_reads_per_client": 2}) as capped, contextlib.ExitStack() as stack:
        before = capped.cuts("body_overload")
        for _ in range(2):
            sock = stack.enter_context(connected(capped.port, "127.0.0.7"))
            sock.sendall(head_only(b"Content-Length: 1000"))
            continued(sock)
        with caplog.at_level(logging.WARNING, logger="disagg_serve.http"), \
                connected(capped.port, "127.0.0.7") as third:
            third.sendall(head_only(b"Content-Length: 1000", b"X-Request-Id: third-body-1\r\n"))
            head = refused(read_until_closed(third), 429, "overloaded")
        assert header(head, b"x-request-id") == b"third-body-1"
        assert header(head, b"retry-after") == b"1"
        assert capped.cuts("body_overload") == before + 1
        assert any("third-body-1" in r.getMessage() and "bodies being read" in r.getMessage()
                   for r in caplog.records)
        still_serving(capped)  # from 127.0.0.1: its own count


def test_bodies_being_read_are_capped_in_bytes_received() -> None:
    """Admission comes after the body, so what bodies being read make the server hold is capped on its own, in
    bytes received: a body whose bytes take the server past ``max_body_bytes_reading`` is refused with 429, while
    what a body only declares counts for nothing."""
    with front_running(600.0, max_body_bytes_reading=2048) as capped, contextlib.ExitStack() as stack:
        first = stack.enter_context(connected(capped.port))
        first.sendall(head_only(b"Content-Length: 1600"))
        continued(first)
        first.sendall(b"{" + b" " * 1499)  # 1,500 bytes held
        declared = stack.enter_context(connected(capped.port))
        declared.sendall(head_only(b"Content-Length: 60000"))  # declared only: not refused
        continued(declared)
        still_serving(capped)  # (its few hundred bytes fit beside them)
        with connected(capped.port) as over:
            over.sendall(head_only(b"Content-Length: 1000"))
            continued(over)
            over.sendall(b" " * 600)  # 1,500 + 600 > 2,048
            head, body = read_one(over)
        assert status_of(head) == 429
        assert "bytes of request bodies" in error_of(body)["message"]
        assert waiting(first) and waiting(declared)


def test_a_body_trickled_under_the_minimum_rate_is_cut_off(caplog: pytest.LogCaptureFixture) -> None:
    """A byte every tenth of a second keeps clear of the idle timeout, but not of the minimum average rate: the
    body is cut off with 408 once past its first ``body_timeout_s`` (on bb7e60b a 64 MiB declaration bought it
    64 times the body timeout, whatever came)."""
    # (An idle timeout far above the client's pace, so that only a client paused for 1.5 s could meet it first.)
    with front_running(1.5, {"body_min_rate": 1000}, max_body_bytes=64 * 1024 * 1024) as front, \
            caplog.at_level(logging.WARNING, logger="disagg_serve.http"), connected(front.port) as slow:
        before = front.cuts("body_timeout")
        slow.sendall(request(body=b" ", extra=b"X-Request-Id: trickle-1\r\n").replace(
            b"Content-Length: 1\r\n", b"Content-Length: 67108864\r\n"))  # the head and a first byte
        answered = False
        for _ in range(600):  # the client's pace, not a wait for the server: a byte, then a look for an answer
            with contextlib.suppress(ConnectionError):
                slow.sendall(b" ")
            readable, _, _ = select.select([slow], [], [], 0.1)
            if readable:
                answered = True
                break
        assert answered, "the trickled body was never cut off"
        head = refused(read_until_closed(slow), 408, "request_timeout")
    assert header(head, b"x-request-id") == b"trickle-1"
    assert front.cuts("body_timeout") == before + 1
    assert any("trickle-1" in r.getMessage() and "bytes/s" in r.getMessage() for r in caplog.records)


def test_a_body_not_in_by_its_clock_is_cut_off_with_408(front: Front, caplog: pytest.LogCaptureFixture) -> None:
    before = front.cuts("body_timeout")
    with caplog.at_level(logging.WARNING, logger="disagg_serve.http"), connected(front.port) as slow:
        slow.sendall(request(body=b"{" + b" " * 999, extra=b"X-Request-Id: slow-body-1\r\n")[:-999])
        head = refused(read_until_closed(slow), 408, "request_timeout")
    assert header(head, b"x-request-id") == b"slow-body-1"
    assert front.cuts("body_timeout") == before + 1
    assert any("slow-body-1" in r.getMessage() and "body did not arrive" in r.getMessage() for r in caplog.records)
    still_serving(front)


def test_a_body_sent_apart_from_its_head_is_served_on_a_kept_connection(front: Front) -> None:
    """Head and body in two writes, as httpx sends them: served, and the connection serves on."""
    with connected(front.port) as sock:
        raw = request()
        for _ in range(2):
            sock.sendall(raw[:-len(CHAT)])
            sock.sendall(raw[-len(CHAT):])
            assert status_of(read_one(sock)[0]) == 200


def test_chunk_framing_and_trailers_count_against_the_head_limit(front: Front) -> None:
    with connected(front.port) as sock:
        sock.sendall(b"POST /v1/chat/completions HTTP/1.1\r\nHost: t\r\nTransfer-Encoding: chunked\r\n\r\n"
                     b"2\r\n{}\r\n0\r\nX-Trailer: " + b"a" * 256 * 1024)
        answer = read_until_closed(sock)
    assert status_of(answer.partition(b"\r\n\r\n")[0]) == 431


def test_an_answer_before_the_body_closes_the_connection(front: Front) -> None:
    """A 413 for a declared length over the limit comes before the body: the connection says close and closes,
    so a client that abandons the body cannot have its next request read as that body."""
    with connected(front.port) as sock:
        sock.sendall(request(body=b"x" * 100_000)[:-100_000])  # the head only
        head, body = read_one(sock)
        assert status_of(head) == 413
        assert error_of(body)["code"] == "payload_too_large"
        assert header(head, b"connection") == b"close"
        with contextlib.suppress(ConnectionError):
            sock.sendall(request())  # the client's next request on the same connection ...
        assert b"HTTP/1.1 200" not in read_until_closed(sock)  # ... is not answered as if the body had ended


def test_a_chunked_bodys_trailers_do_not_join_its_headers() -> None:
    seen: list[list[tuple[bytes, bytes]]] = []

    async def app(scope: dict[str, Any], receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            return
        while (await receive()).get("more_body", False):
            pass
        seen.append(list(scope["headers"]))
        await send({"type": "http.response.start", "status": 204, "headers": []})
        await send({"type": "http.response.body", "body": b""})

    server = ServerThread(app, event_loop=uvloop.new_event_loop, http=guarded_protocol(), lifespan="off")
    port = int(server.start().rsplit(":", 1)[1])
    try:
        with connected(port) as sock:
            sock.sendall(b"POST /x HTTP/1.1\r\nHost: t\r\nTransfer-Encoding: chunked\r\n\r\n"
                         b"2\r\nab\r\n0\r\nX-Injected: 1\r\n\r\n")
            assert sock.recv(65536).startswith(b"HTTP/1.1 204")
    finally:
        server.stop()
    assert [name for name, _ in seen[0]] == [b"host", b"transfer-encoding"]


# -- HTTP/1.0 -------------------------------------------------------------------------------------------------
def test_an_http10_client_gets_no_100_continue_and_no_chunks(front: Front) -> None:
    streamed = json.dumps({**json.loads(CHAT), "stream": True}).encode()
    with connected(front.port) as sock:
        sock.sendall(request(body=streamed, version=b"1.0", extra=b"Expect: 100-continue\r\n"))
        answer = read_until_closed(sock)
    head, _, body = answer.partition(b"\r\n\r\n")
    assert head.startswith(b"HTTP/1.1 200 ")
    assert b"100 Continue" not in answer
    assert header(head, b"transfer-encoding") is None
    assert body.startswith(b"data: ") and body.endswith(b"data: [DONE]\n\n")  # no chunk sizes around it


def test_an_http10_client_of_an_asgi_stream_gets_no_chunks() -> None:
    async def app(scope: dict[str, Any], receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            return
        await send({"type": "http.response.start", "status": 200, "headers": [(b"content-type", b"text/plain")]})
        await send({"type": "http.response.body", "body": b"one ", "more_body": True})
        await send({"type": "http.response.body", "body": b"two"})

    server = ServerThread(app, event_loop=uvloop.new_event_loop, http=guarded_protocol(), lifespan="off")
    port = int(server.start().rsplit(":", 1)[1])
    try:
        with connected(port) as sock:
            sock.sendall(b"GET /x HTTP/1.0\r\n\r\n")
            answer = read_until_closed(sock)
    finally:
        server.stop()
    head, _, body = answer.partition(b"\r\n\r\n")
    assert header(head, b"transfer-encoding") is None
    assert body == b"one two"


def test_a_tenants_body_reads_are_capped(monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture) -> None:
    """The tenant is known from the head: past ``max_body_reads_per_tenant`` of its bodies being read, the next is
    refused with 429 before its body is waited for (logged with its request id), and another tenant is served."""
    monkeypatch.setenv("HOSTILE_KEY_A", "key-of-a")
    monkeypatch.setenv("HOSTILE_KEY_B", "key-of-b")
    tenants = [{"name": "a", "api_key_env": "HOSTILE_KEY_A"}, {"name": "b", "api_key_env": "HOSTILE_KEY_B"}]
    with front_running(600.0, tenants=tenants, max_body_reads_per_tenant=2) as capped, \
            contextlib.ExitStack() as stack:
        for i in range(2):  # (from addresses of their own: the address cap is not what refuses the third)
            sock = stack.enter_context(connected(capped.port, f"127.0.0.{20 + i}"))
            sock.sendall(head_only(b"Content-Length: 1000", b"Authorization: Bearer key-of-a\r\n"))
            continued(sock)
        with caplog.at_level(logging.WARNING, logger="frontend.http"), connected(capped.port, "127.0.0.22") as third:
            third.sendall(head_only(b"Content-Length: 1000",
                                    b"Authorization: Bearer key-of-a\r\nX-Request-Id: tenant-body-3\r\n"))
            head, body = read_one(third)
        assert status_of(head) == 429
        assert "tenant 'a'" in error_of(body)["message"]
        assert any("tenant-body-3" in r.getMessage() for r in caplog.records)
        reply = httpx.post(f"http://127.0.0.1:{capped.port}/v1/chat/completions", content=CHAT, timeout=60,
                           headers={"content-type": "application/json", "authorization": "Bearer key-of-b"})
        assert reply.status_code == 200, reply.text


def chat_of(size: int) -> bytes:
    """A chat request of exactly ``size`` bytes (JSON's whitespace makes up the rest)."""
    return CHAT[:-1] + b" " * (size - len(CHAT)) + b"}"


def test_the_next_request_on_a_kept_connection_gets_its_own_body_clock() -> None:
    """Issue 44, item 6: on bb7e60b a 32 MiB body's clock (30 s per declared MiB) stayed armed after the body came,
    and the next request on the connection, whose body never came, was cut off when that one ran out (here 16 s)
    instead of after its own ``body_timeout_s`` (0.5 s)."""
    with front_running(0.5, max_body_bytes=32 * 1024 * 1024) as front, connected(front.port) as sock:
        sock.sendall(request(body=chat_of(32 * 1024 * 1024)))
        assert status_of(read_one(sock)[0]) == 200
        sock.sendall(request(body=b"{" + b" " * 999)[:-999])  # a head and one byte, on the kept connection
        started = time.monotonic()
        refused(read_until_closed(sock), 408, "request_timeout")
        # A bound that only a clock inherited from the first body (16 s) can break; the body's own is 0.5 s.
        assert time.monotonic() - started < 6.0


UPGRADES = {
    "h2c (curl --http2)": b"Connection: Upgrade, HTTP2-Settings\r\nUpgrade: h2c\r\n"
                          b"HTTP2-Settings: AAMAAABkAAQCAAAA\r\n",
    "websocket": b"Connection: Upgrade\r\nUpgrade: websocket\r\nSec-WebSocket-Key: dGhlIHNhbXBsZSBub25jZQ==\r\n"
                 b"Sec-WebSocket-Version: 13\r\n",
}


@pytest.mark.parametrize("chunked", [False, True], ids=["Content-Length", "chunked"])
@pytest.mark.parametrize("offer", UPGRADES.values(), ids=UPGRADES.keys())
def test_a_post_that_offers_an_upgrade_has_its_body_read(front: Front, offer: bytes, chunked: bool) -> None:
    """The upgrade offer is ignored, as RFC 9110 7.8 allows, and the body read as HTTP/1.1 frames it (on bb7e60b
    llhttp stopped at the offer and the request was answered as if it had no body: a 400); the connection closes
    after the answer, and nothing after the request is parsed."""
    if chunked:
        raw = (b"POST /v1/chat/completions HTTP/1.1\r\nHost: t\r\nContent-Type: application/json\r\n%b"
               b"Transfer-Encoding: chunked\r\n\r\n%x\r\n%b\r\n0\r\n\r\n" % (offer, len(CHAT), CHAT))
    else:
        raw = request(extra=offer)
    with connected(front.port) as sock:
        sock.sendall(raw + request())  # and a request after it, never taken
        answer = read_until_closed(sock)
    head, _, body = answer.partition(b"\r\n\r\n")
    assert status_of(head) == 200, answer[:400]
    assert header(head, b"connection") == b"close"
    assert json.loads(body)["object"] == "chat.completion"
    assert answer.count(b"HTTP/1.1 ") == 1


def test_answers_name_no_server_implementation(front: Front) -> None:
    """No ``server`` header (on bb7e60b every answer said ``server: uvicorn``): not on a fast route's answer, an
    ASGI route's, or a refusal the protocol answers itself."""
    with connected(front.port) as sock:
        sock.sendall(request())
        fast, _ = read_one(sock)
        sock.sendall(b"GET /v1/models HTTP/1.1\r\nHost: t\r\n\r\n")
        routed, _ = read_one(sock)
    with connected(front.port) as sock:
        sock.sendall(request(host=b""))
        refusal = read_until_closed(sock).partition(b"\r\n\r\n")[0]
    for head in (fast, routed, refusal):
        assert header(head, b"date") is not None  # the server's default headers are there ...
        assert header(head, b"server") is None  # ... but this one

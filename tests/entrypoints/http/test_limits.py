"""Slow and hostile clients against a real ``disagg-serve worker`` process (raw sockets, no client library).

What uvicorn already bounds, and what ``entrypoints.http.serve`` adds (docs/reliability.md, "Slow and hostile
clients"): a client that stops reading is cut off after ``--client-send-timeout-s`` with the server's memory
bounded by flow control; a client that sends its headers a byte at a time is cut off after ``--header-timeout-s``;
1,000 idle keep-alive connections do not stop another client from being served.

Then the clocks of ``entrypoints/http/limits.py`` on the guarded protocol alone (a real uvicorn server in a
thread, raw client sockets): each request's own header clock, and one keep-alive timer per connection.
"""

from __future__ import annotations

import asyncio
import contextlib
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
import uvloop

from entrypoints.http.limits import ClientClocks, ClientLimits
from entrypoints.http.protocol import guarded_protocol
from frontend.http import BodyBudget, BodyReads
from tests.entrypoints.http.test_protocol import Recorder, connected, head, read_answer
from tests.servers import ServerThread
from tests.waiting import eventually, eventually_async

SEND_TIMEOUT_S = 2.0
HEADER_TIMEOUT_S = 1.0
# A streamed answer far bigger than any buffer on the way: ~60 B per token frame, 200,000 tokens, ~12 MB.
LONG_ANSWER = (b'{"model":"synthetic","prompt":"hi","max_tokens":200000,"stream":true,"ignore_eos":true}')


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def _rss_bytes(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024
    raise AssertionError("no VmRSS")


@pytest.fixture(scope="module")
def worker() -> Iterator[tuple[str, int, subprocess.Popen[bytes]]]:
    port = _free_port()
    process = subprocess.Popen(
        [sys.executable, "-m", "entrypoints.cli", "--log-level", "warning", "worker", "--engine", "synthetic",
         "--role", "both", "--port", str(port), "--client-send-timeout-s", str(SEND_TIMEOUT_S),
         "--header-timeout-s", str(HEADER_TIMEOUT_S), "--synthetic-output-tokens", "1000000"])
    try:
        def healthy() -> bool:
            try:
                return httpx.get(f"http://127.0.0.1:{port}/health", timeout=2).status_code == 200
            except httpx.HTTPError:
                return False
        assert eventually(healthy, every_s=0.1), "the worker did not start"
        yield "127.0.0.1", port, process
    finally:
        process.terminate()
        process.wait(timeout=30)


def _post(body: bytes, port: int) -> bytes:
    return (b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
            b"Content-Length: " + str(len(body)).encode() + b"\r\n\r\n" + body)


def _read_to_close(sock: socket.socket) -> bytes:
    sock.settimeout(60)
    received = bytearray()
    with contextlib.suppress(ConnectionResetError):  # a stalled client is reset: what it held may be lost
        while chunk := sock.recv(1 << 16):
            received += chunk
    return bytes(received)


def _served(port: int) -> bool:
    reply = httpx.post(f"http://127.0.0.1:{port}/v1/completions", timeout=30,
                       json={"model": "synthetic", "prompt": "hi", "max_tokens": 4})
    return reply.status_code == 200 and reply.json()["choices"][0]["text"] != ""


def test_a_client_that_stops_reading_is_cut_off_with_memory_bounded(
        worker: tuple[str, int, subprocess.Popen[bytes]]) -> None:
    host, port, process = worker
    rss_before = _rss_bytes(process.pid)
    cuts_before = stalled_cuts(port)
    with socket.create_connection((host, port)) as sock:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 16384)
        sock.sendall(_post(LONG_ANSWER, port))
        # Read nothing until the server gives up on us: its send stalls once the buffers on the way are full.
        # Its reset may never reach our socket's state (``_server_side_closed``): its count does, and then our
        # read either meets the reset or, draining our buffer, opens our window, and the closed port resets us.
        assert eventually(lambda: stalled_cuts(port) > cuts_before, every_s=0.2), "the stalled client was not cut"
        rss_stalled = _rss_bytes(process.pid)
        received = _read_to_close(sock)
    assert b"data: [DONE]" not in received  # cut off, not finished
    assert len(received) < 4 * 2**20  # what the buffers on the way held, not the 12 MB answer
    assert rss_stalled - rss_before < 64 * 2**20
    assert _served(port)


def stalled_cuts(port: int) -> float:
    """How many connections the front end on ``port`` has reset for a client that stopped reading (its metric,
    counted as the reset is made)."""
    text = httpx.get(f"http://127.0.0.1:{port}/metrics", timeout=30).text
    for line in text.splitlines():
        if line.startswith('disagg_http_connections_cut_total{reason="send_stalled"}'):
            return float(line.split()[-1])
    return 0.0


def _server_side_closed(sock: socket.socket) -> bool:
    """The server closed its end: our kernel reports the FIN through the TCP state (we have not read a byte). Not
    for a reset sent to a client that keeps its window shut: one whose sequence number is not the very one our kernel
    expects next is dropped, and the state never changes (wait on ``stalled_cuts``, then read)."""
    state = sock.getsockopt(socket.IPPROTO_TCP, socket.TCP_INFO, 1)[0]
    return state in (7, 8)  # TCP_CLOSE (the peer reset) or TCP_CLOSE_WAIT (the peer closed, we did not yet)


def test_a_slowloris_client_is_cut_off(worker: tuple[str, int, subprocess.Popen[bytes]]) -> None:
    host, port, _ = worker
    request = _post(b'{"model":"synthetic","prompt":"hi","max_tokens":4}', port)
    with socket.create_connection((host, port)) as sock:
        sent = 0
        with contextlib.suppress(OSError):
            for byte in request:
                sock.sendall(bytes([byte]))
                sent += 1
                if _server_side_closed(sock):
                    break
                time.sleep(0.1)  # the slowloris pace, not a synchronisation
        assert eventually(lambda: _server_side_closed(sock))
        assert _read_to_close(sock) == b""  # closed without an answer
    assert sent < len(request)
    assert _served(port)


def test_a_silent_connection_is_closed(worker: tuple[str, int, subprocess.Popen[bytes]]) -> None:
    host, port, _ = worker
    with socket.create_connection((host, port)) as sock:
        assert eventually(lambda: _server_side_closed(sock))


def test_a_thousand_idle_keep_alive_connections_do_not_stop_others(
        worker: tuple[str, int, subprocess.Popen[bytes]]) -> None:
    host, port, _ = worker
    idle: list[socket.socket] = []
    try:
        for _ in range(1000):
            sock = socket.create_connection((host, port))
            sock.sendall(b"GET /health HTTP/1.1\r\nHost: x\r\n\r\n")  # one answered request, then idle
            idle.append(sock)
        for sock in idle:
            sock.settimeout(30)
            assert sock.recv(4096).startswith(b"HTTP/1.1 200")
        assert _served(port)
        assert not any(_server_side_closed(sock) for sock in idle)  # kept alive (75 s), not dropped
    finally:
        for sock in idle:
            sock.close()


# -- the guarded protocol's clocks ------------------------------------------------------------------------------


@pytest.mark.parametrize("event_loop", [asyncio.new_event_loop, uvloop.new_event_loop], ids=["asyncio", "uvloop"])
def test_the_next_request_on_a_kept_connection_gets_its_own_header_clock(event_loop: Any) -> None:
    thread = ServerThread(Recorder(), event_loop=event_loop, http=guarded_protocol(ClientLimits(header_timeout_s=0.5)),
                          lifespan="off")
    port = int(thread.start().rsplit(":", 1)[1])
    try:
        with connected(port) as sock:
            sock.sendall(head(3) + b"abc")  # a whole head in one read: served, no clock left running
            assert read_answer(sock) == b"3"
            sock.sendall(b"P")  # the next request's first byte, and nothing more: its clock runs out
            assert sock.recv(1) == b""  # closed by the server, without an answer
    finally:
        thread.stop()


def test_an_upgrade_on_a_kept_connection_is_answered_over_http_and_the_connection_closes_after_it() -> None:
    # No upgrade is offered (entrypoints/http/protocol.py): the request is answered as HTTP/1.1, and what the
    # client sends after its head (here a WebSocket frame, and then what would be a request) is never parsed.
    thread = ServerThread(Recorder(), http=guarded_protocol(ClientLimits(header_timeout_s=0.3)), lifespan="off")
    port = int(thread.start().rsplit(":", 1)[1])
    upgrade = (b"GET /ws HTTP/1.1\r\nHost: t\r\nUpgrade: websocket\r\nConnection: Upgrade\r\n"
               b"Sec-WebSocket-Key: dGhlIHNhbXBsZSBub25jZQ==\r\nSec-WebSocket-Version: 13\r\n\r\n")
    try:
        with connected(port) as sock:
            sock.sendall(head(3) + b"abc")
            assert read_answer(sock) == b"3"
            sock.sendall(upgrade + b"\x81\x02hi" + head(3) + b"abc")
            answer = b""
            while chunk := sock.recv(4096):
                answer += chunk
    finally:
        thread.stop()
    status, _, rest = answer.partition(b"\r\n")
    assert status == b"HTTP/1.1 200 OK"
    assert b"connection: close" in rest.lower()
    assert rest.endswith(b"\r\n\r\n0")  # the upgrade's GET, answered with the length of its (empty) body
    assert answer.count(b"HTTP/1.1") == 1  # and nothing after it


@contextlib.contextmanager
def kept_connection(timeout_keep_alive_s: float) -> Iterator[socket.socket]:
    """A connection to a server closing idle keep-alive connections after ``timeout_keep_alive_s``, one request
    already answered on it (its keep-alive timer is running)."""
    thread = ServerThread(Recorder(), http=guarded_protocol(), timeout_keep_alive=timeout_keep_alive_s,
                          lifespan="off")
    port = int(thread.start().rsplit(":", 1)[1])
    try:
        with connected(port) as sock:
            sock.sendall(head(3) + b"abc")
            assert read_answer(sock) == b"3"
            yield sock
    finally:
        thread.stop()


def read_until(sock: socket.socket, end: bytes, closed: str) -> None:
    """Read until what came ends with ``end``; a connection closed before that fails the test with ``closed``."""
    received = b""
    while not received.endswith(end):
        chunk = sock.recv(65536)
        assert chunk, closed
        received += chunk


def test_an_idle_kept_connection_is_closed_once_the_keep_alive_timeout_passes() -> None:
    with kept_connection(0.3) as sock:
        assert sock.recv(1) == b""  # closed by the server, idle


def test_a_connection_in_use_outlives_the_keep_alive_timeout_of_its_first_answer() -> None:
    """One keep-alive timer per connection, moved on when it fires: requests that keep coming within the timeout
    keep the connection however long they go on."""
    with kept_connection(1.0) as sock:
        started = time.monotonic()
        while time.monotonic() - started < 2.5:  # the first answer's timeout two and a half times over
            sock.sendall(head(3) + b"abc")
            read_until(sock, b"\r\n\r\n3", f"closed a connection in use, {time.monotonic() - started:.2f} s in")
            time.sleep(0.02)  # the client's pace: 50 times inside the timeout, so a busy machine's pauses fit
        assert sock.recv(1) == b""  # then idle: closed


def test_a_request_in_progress_longer_than_the_keep_alive_timeout_is_not_cut_off() -> None:
    """The keep-alive timer armed by the first answer fires while the second request's body is still coming: the
    connection is busy, not idle, and must not be closed."""
    with kept_connection(0.3) as sock:
        sock.sendall(head(6) + b"abc")  # half a body: a request in progress
        # Past the keep-alive timeout three times over; waiting is the only way to see that it does not fire.
        time.sleep(1.0)
        sock.sendall(b"def")
        read_until(sock, b"\r\n\r\n6", "the server closed a connection with a request in progress")


def test_a_workers_answers_name_no_server_implementation(worker: tuple[str, int, subprocess.Popen[bytes]]) -> None:
    _, port, _ = worker
    for reply in (httpx.get(f"http://127.0.0.1:{port}/health", timeout=30),
                  httpx.post(f"http://127.0.0.1:{port}/v1/completions", timeout=30,
                             json={"model": "synthetic", "prompt": "hi", "max_tokens": 4})):
        assert "date" in reply.headers
        assert "server" not in reply.headers  # bb7e60b: server: uvicorn


def test_heads_declaring_bodies_never_sent_do_not_shut_a_workers_routes(
        worker: tuple[str, int, subprocess.Popen[bytes]]) -> None:
    """A worker runs the same protocol as the orchestrator: 16 heads declaring 64 MiB bodies that never come (each
    past its handler's checks: it asked for and got ``100 Continue``) cost it nothing, and a fast client is served
    (on bb7e60b they held its 1 GiB of bodies being read, and every other client got 429)."""
    host, port, _ = worker
    with contextlib.ExitStack() as stack:
        for i in range(16):
            sock = stack.enter_context(socket.create_connection((host, port), source_address=(f"127.0.0.{2 + i}", 0)))
            sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                         b"Content-Length: 67108864\r\nExpect: 100-continue\r\n\r\n")
            received = b""
            while not received.endswith(b"\r\n\r\n"):
                chunk = sock.recv(1)
                assert chunk, "closed before 100 Continue"
                received += chunk
            assert received == b"HTTP/1.1 100 Continue\r\n\r\n", received
        assert _served(port)


# -- ClientClocks alone: a connection's clocks on an event loop, with a recorder for what they tell it --------------
class Told:
    """A connection's ``Cutoffs``, recording what its clocks tell it."""

    def __init__(self) -> None:
        self.told: list[str] = []

    def head_too_slow(self) -> None:
        self.told.append("head")

    def body_too_slow(self, cause: str) -> None:
        self.told.append(f"body: {cause}")

    def body_over_budget(self) -> None:
        self.told.append("budget")

    def idle_too_long(self) -> None:
        self.told.append("idle")


def clocks(told: Told, bodies: BodyBudget | None = None, readers: BodyReads | None = None,
           **limits: Any) -> ClientClocks:
    return ClientClocks(told, asyncio.get_running_loop(), ClientLimits(**limits), bodies or BodyBudget(1 << 30),
                        readers or BodyReads(0), keep_alive_s=0.05)


async def test_a_body_that_brings_no_byte_is_too_slow_and_one_that_averages_too_little_is_too() -> None:
    idle, slow = Told(), Told()
    idle_clocks, slow_clocks = clocks(idle, body_timeout_s=0.5), clocks(slow, body_timeout_s=0.5, body_min_rate=1000)
    assert idle_clocks.start_body("a") and slow_clocks.start_body("a")
    for _ in range(8):  # a byte every 20 ms: never idle for 0.5 s, and far under 1,000 bytes/s
        await asyncio.sleep(0.02)
        slow_clocks.body_received(1)
    assert await eventually_async(lambda: idle.told != [] and slow.told != [])
    assert idle.told == ["body: no byte of it came for 0.5 s"]
    assert len(slow.told) == 1 and "under the minimum of 1000 bytes/s after the first 0.5 s" in slow.told[0]


async def test_a_body_done_stops_its_clock_and_gives_back_its_bytes_and_its_addresss_count() -> None:
    told = Told()
    bodies, readers = BodyBudget(1 << 30), BodyReads(1)
    first = clocks(told, bodies, readers, body_timeout_s=0.05)
    assert first.start_body("a") and first.body_timed
    first.body_received(100)
    assert (bodies.reading, clocks(told, bodies, readers).start_body("a")) == (100, False)  # the address's cap
    first.body_done()
    assert (bodies.reading, first.body_timed, clocks(told, bodies, readers).start_body("a")) == (0, False, True)
    await asyncio.sleep(0.1)
    assert told.told == []  # its timer fired, found no body, and stopped


async def test_bytes_past_the_servers_budget_are_told_once_after_the_read() -> None:
    told = Told()
    bodies = BodyBudget(10)
    holder, over = clocks(Told(), bodies), clocks(told, bodies)
    holder.body_received(8)  # (a body alone is always let in)
    over.body_received(8)
    over.body_received(8)
    assert told.told == []  # not inside the parser's callback
    await asyncio.sleep(0)
    assert told.told == ["budget"] and bodies.reading == 8


async def test_a_head_clock_and_a_keep_alive_clock_tell_once_each_and_busy_keeps_a_connection() -> None:
    told = Told()
    connection = clocks(told, header_timeout_s=0.05)
    connection.start_head()
    assert connection.head_timed
    assert await eventually_async(lambda: told.told == ["head"])
    assert not connection.head_timed
    connection.idle()
    connection.busy()  # a request came: its answer's end starts the idle time again
    await asyncio.sleep(0.1)  # (the timer fired, found the connection busy, and stopped)
    assert told.told == ["head"]
    connection.idle()
    assert await eventually_async(lambda: told.told == ["head", "idle"])
    connection.stop()

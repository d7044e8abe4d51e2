"""``frontend/send_timeout.py``'s send timer on a route served through ASGI, on the project's own protocol (a
real server in a thread, a raw client socket that stops reading)."""

from __future__ import annotations

import logging
import socket

import pytest
import uvloop
from starlette.types import Receive, Scope, Send

from entrypoints.http.protocol import guarded_protocol
from frontend.send_timeout import with_send_timeout
from tests.servers import ServerThread
from tests.waiting import eventually

BIG = b"x" * (8 * 1024 * 1024)  # far more than the socket buffers on the way hold


async def answers(scope: Scope, receive: Receive, send: Send) -> None:
    if scope["type"] != "http":
        return
    body = BIG if scope["path"] == "/big" else b"small"
    await send({"type": "http.response.start", "status": 200,
                "headers": [(b"content-length", b"%d" % len(body))]})
    await send({"type": "http.response.body", "body": body})


def test_a_pipelined_answers_head_behind_a_client_that_stopped_reading_is_timed(
        caplog: pytest.LogCaptureFixture) -> None:
    """The first answer goes to the transport whole (its one send did not wait), and the client reads none of it;
    the pipelined second answer's head then waits for the client. On bb7e60b only body sends were timed, and that
    head waited for ever; now it is cut off after the send timeout, as a body's send is."""
    server = ServerThread(with_send_timeout(answers, 0.5), event_loop=uvloop.new_event_loop, http=guarded_protocol(),
                          lifespan="off")
    port = int(server.start().rsplit(":", 1)[1])
    try:
        with caplog.at_level(logging.WARNING, logger="disagg_serve.http"), socket.socket() as sock:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
            sock.connect(("127.0.0.1", port))
            sock.sendall(b"GET /big HTTP/1.1\r\nHost: t\r\n\r\nGET /small HTTP/1.1\r\nHost: t\r\n\r\n")
            assert eventually(lambda: any("stopped reading /small" in r.getMessage() for r in caplog.records)), \
                "the second answer's head waited for ever"
    finally:
        server.stop()

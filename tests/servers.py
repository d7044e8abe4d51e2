"""Real uvicorn servers on loopback for tests: each runs in its own thread and event loop, on a free port."""

from __future__ import annotations

import asyncio
import contextlib
import socket
import threading
import time
import urllib.parse
from collections.abc import Callable, Iterator
from typing import Any

import httpx
import uvicorn

EventLoopFactory = Callable[[], asyncio.AbstractEventLoop]


class ServerThread:
    def __init__(self, app: Any, port: int = 0, event_loop: EventLoopFactory = asyncio.new_event_loop,
                 **options: Any) -> None:
        # port 0: any free port; a fixed port lets a test bring a "restarted" worker back at the same address.
        # ``event_loop``: asyncio's by default (uvicorn's ``loop`` applies only to ``run``, not ``serve``);
        # ``uvloop.new_event_loop`` for what production runs. ``options``: more of uvicorn's settings, or other
        # values for these (e.g. ``http``: a protocol class).
        config = uvicorn.Config(app, **{"host": "127.0.0.1", "port": port, "log_level": "warning", "lifespan": "on",
                                        "loop": "uvloop", "http": "httptools", "ws": "none",
                                        "timeout_graceful_shutdown": 5,
                                        **options})
        self.server = uvicorn.Server(config)
        self.thread = threading.Thread(target=self._run, daemon=True)
        self.loop: asyncio.AbstractEventLoop | None = None
        self._new_loop = event_loop

    def _run(self) -> None:
        self.loop = self._new_loop()
        asyncio.set_event_loop(self.loop)
        self.loop.run_until_complete(self.server.serve())
        self.loop.close()

    def start(self, timeout_s: float = 180.0) -> str:
        self.thread.start()
        deadline = time.monotonic() + timeout_s
        while not self.server.started:
            if not self.thread.is_alive() or time.monotonic() > deadline:
                raise RuntimeError("test server did not start")
            time.sleep(0.01)
        port = self.server.servers[0].sockets[0].getsockname()[1]
        return f"http://127.0.0.1:{port}"

    def stop(self) -> None:
        self.server.should_exit = True
        self.thread.join(timeout=15)


@contextlib.contextmanager
def running(app: Any) -> Iterator[str]:
    server = ServerThread(app)
    url = server.start()
    try:
        yield url
    finally:
        server.stop()


@contextlib.contextmanager
def open_post(url: str, path: str, body: bytes) -> Iterator[socket.socket]:
    """A POST of a JSON ``body`` sent on a raw connection and left unanswered until the block ends, when the
    connection is closed: the client that hangs up mid-request, which httpx cannot play."""
    parts = urllib.parse.urlsplit(url)
    assert parts.hostname is not None and parts.port is not None
    sock = socket.create_connection((parts.hostname, parts.port), timeout=60)
    try:
        sock.sendall(f"POST {path} HTTP/1.1\r\nHost: {parts.netloc}\r\nContent-Type: application/json\r\n"
                     f"Content-Length: {len(body)}\r\nConnection: close\r\n\r\n".encode() + body)
        yield sock
    finally:
        sock.close()


def answers_healthy(url: str) -> bool:
    """Whether the server at ``url`` answers its ``/health`` with a 200 now (one that is not up yet: False)."""
    try:
        return httpx.get(url + "/health", timeout=2).status_code == 200
    except httpx.HTTPError:
        return False

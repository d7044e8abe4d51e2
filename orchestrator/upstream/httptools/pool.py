"""The default client's ``Transport``: a pool of keep-alive connections to one worker.

Why a client of our own: the orchestrator makes one kind of request (a POST of JSON bytes to a worker it knows, over
a keep-alive connection), and a general client pays per request for what it does not need here (aiohttp's Python
takes ~20 % of the orchestrator's samples: docs/benchmarks.md, orchestrator cost). A request here is one
``writelines`` of its head and its body's chunks, CTX's b64 span never joined.

What it keeps of a general client, because production needs it: LIFO reuse (the warm connections first), idle ones
closed after ``_IDLE_S`` by one timer per worker (before the worker's own timeout, so the orchestrator closes them),
at most ``_MAX_CONNECTIONS`` at once (the rest wait their turn, up to the connect timeout), a pooled connection the
worker closed while idle never handed out, connect timeouts, TLS for ``https://`` workers, and a connection closed,
never pooled, when its answer was abandoned half read (that tells GEN to stop) or did not end cleanly. A refused
or failed connect is ``UpstreamUnavailableError``, a timeout ``UpstreamTimeoutError``, anything else
``UpstreamError``, each naming the worker.
"""

from __future__ import annotations

import asyncio
import ssl
import time
from collections import deque
from collections.abc import Mapping
from urllib.parse import urlsplit

from frontend.errors import UpstreamError, UpstreamTimeoutError, UpstreamUnavailableError
from orchestrator.upstream.base import Body, Reply, WorkerTimeouts, body_length
from orchestrator.upstream.httptools.connection import WorkerConnection
from orchestrator.upstream.httptools.stream import HttptoolsStream

_MAX_CONNECTIONS = 1024  # per worker, as the aiohttp transport
_IDLE_S = 30.0  # a worker (uvicorn) closes an idle keep-alive connection after 75 s; we close ours first


class HttptoolsTransport:
    def __init__(self, url: str, timeouts: WorkerTimeouts, headers: Mapping[str, str] | None = None) -> None:
        self.url = url
        self._timeouts = timeouts
        parts = urlsplit(url)
        if parts.scheme not in ("http", "https") or not parts.hostname:
            raise ValueError(f"worker URL {url!r} must be http:// or https:// with a host")
        self._host = parts.hostname
        scheme_port = 443 if parts.scheme == "https" else 80
        self._port = parts.port or scheme_port
        self._ssl: ssl.SSLContext | None = ssl.create_default_context() if parts.scheme == "https" else None
        self._prefix = parts.path.rstrip("/")  # a worker URL with a path: requests go under it
        default_port = self._port == scheme_port
        host_header = self._host if default_port else f"{self._host}:{self._port}"
        if ":" in self._host:  # an IPv6 literal goes in brackets in the Host header
            host_header = f"[{self._host}]" + ("" if default_port else f":{self._port}")
        # Every request's fixed headers after the Host line (the deployment secret's): formatted once, here.
        self._host_line = f"Host: {host_header}\r\n" + "".join(_header_lines(url, headers or {}))
        self._idle: list[WorkerConnection] = []  # LIFO: the last one given back is the warmest
        self._open: set[WorkerConnection] = set()
        self._connecting = 0  # connections being opened: they count against the limit already
        self._waiters: deque[asyncio.Future[None]] = deque()
        self._reaper: asyncio.TimerHandle | None = None  # closes connections idle for _IDLE_S
        self._closed = False

    # -- Transport --------------------------------------------------------------------------------------------
    async def post(self, path: str, body: Body, headers: dict[str, str] | None = None) -> Reply:
        return await self._reply(await self._send(self._head("POST", path, body_length(body), headers), body, None,
                                                  stream=False))

    async def open_stream(self, path: str, body: Body, headers: dict[str, str] | None = None) -> HttptoolsStream:
        connection = await self._send(self._head("POST", path, body_length(body), headers), body, None, stream=True)
        connection.flow_controlled = True  # read as it comes: the socket pauses if the reader falls behind
        return HttptoolsStream(connection, self._give_back, self._forget)

    async def get(self, path: str, timeout_s: float) -> Reply:
        try:
            async with asyncio.timeout(timeout_s):
                return await self._reply(await self._send(self._head("GET", path, None, None), b"", timeout_s,
                                                          stream=False))
        except TimeoutError:
            raise UpstreamTimeoutError(f"worker {self.url} timed out (GET {path} took over {timeout_s} s)") from None

    async def aclose(self) -> None:
        self._closed = True
        if self._reaper is not None:
            self._reaper.cancel()
            self._reaper = None
        for connection in list(self._open):
            connection.close()
        self._idle.clear()
        while self._waiters:
            waiter = self._waiters.popleft()
            if not waiter.done():
                waiter.set_result(None)

    def __repr__(self) -> str:
        return f"HttptoolsTransport({self.url!r})"

    # -- one exchange -----------------------------------------------------------------------------------------
    def _head(self, method: str, path: str, length: int | None, headers: dict[str, str] | None) -> bytes:
        lines = [f"{method} {self._prefix}{path} HTTP/1.1\r\n", self._host_line]
        if length is not None:
            lines.append(f"Content-Type: application/json\r\nContent-Length: {length}\r\n")
        if headers:
            lines.extend(_header_lines(self.url, headers))
        lines.append("\r\n")
        try:
            return "".join(lines).encode("latin-1")
        except UnicodeEncodeError as exc:
            raise UpstreamError(f"a header for worker {self.url} is not latin-1: {exc}") from None

    async def _send(self, head: bytes, body: Body, read_timeout_s: float | None, stream: bool) -> WorkerConnection:
        """A connection on which the answer's status and headers have arrived; ``stream``: its body will be read
        as it comes, else whole."""
        timeout_s = read_timeout_s or self._timeouts.request_s
        # (A pooled connection the worker closed while it was idle is never handed out: ``_pooled`` checks.)
        return await self._attempt(await self._acquire(), head, body, timeout_s, stream)

    async def _reply(self, connection: WorkerConnection) -> Reply:
        """The whole answer; the connection back to the pool, or closed if it was not read to its end."""
        try:
            return Reply(connection.status, await connection.whole_body(), connection.prompt_report)
        finally:
            self._give_back(connection)

    async def _attempt(self, connection: WorkerConnection, head: bytes, body: Body, timeout_s: float,
                       stream: bool) -> WorkerConnection:
        try:
            connection.send(head, body, timeout_s, stream)
            await connection.headers_arrived()
            return connection
        except BaseException:
            self._forget(connection)
            raise

    # -- the pool ---------------------------------------------------------------------------------------------
    async def _acquire(self) -> WorkerConnection:
        if self._closed:
            raise UpstreamError(f"the transport to worker {self.url} is closed")
        while (connection := self._pooled()) is None:
            if len(self._open) + self._connecting < _MAX_CONNECTIONS:
                return await self._connect()
            await self._wait_for_a_slot()
        return connection

    def _pooled(self) -> WorkerConnection | None:
        """The warmest idle connection still fit for a request, or None; the others found on the way are closed."""
        now = time.monotonic()
        while self._idle:
            connection = self._idle.pop()
            if connection.reusable and now - connection.idle_since < _IDLE_S:
                return connection
            self._forget(connection)
        return None

    async def _wait_for_a_slot(self) -> None:
        """Until a connection is given back or closed, at most ``connect_s`` (as a connect, then the caller's retry
        policy moves on), so a pool full of long streams is a timeout, not a hang."""
        waiter = asyncio.get_running_loop().create_future()
        self._waiters.append(waiter)
        try:
            async with asyncio.timeout(self._timeouts.connect_s):
                await waiter
        except BaseException as exc:
            if waiter.done() and not waiter.cancelled():
                self._wake_a_waiter()  # it was this one's turn (woken as it timed out or was cancelled): pass it on
            else:
                waiter.cancel()
            if isinstance(exc, TimeoutError):
                raise UpstreamTimeoutError(f"worker {self.url} timed out (all {_MAX_CONNECTIONS} connections busy "
                                           f"for {self._timeouts.connect_s} s)") from None
            raise
        if self._closed:
            raise UpstreamError(f"the transport to worker {self.url} is closed")

    async def _connect(self) -> WorkerConnection:
        loop = asyncio.get_running_loop()
        self._connecting += 1
        connection: WorkerConnection | None = None
        try:
            async with asyncio.timeout(self._timeouts.connect_s):
                _, connection = await loop.create_connection(
                    lambda: WorkerConnection(self.url), self._host, self._port, ssl=self._ssl,
                    server_hostname=self._host if self._ssl is not None else None)
        except TimeoutError:
            raise UpstreamTimeoutError(f"worker {self.url} timed out (connect took over "
                                       f"{self._timeouts.connect_s} s)") from None
        except OSError as exc:  # refused, unreachable, a name that does not resolve, a failed TLS handshake
            raise UpstreamUnavailableError(f"worker {self.url} is unreachable ({type(exc).__name__}: {exc})") from exc
        finally:
            self._connecting -= 1
            if connection is None:
                self._wake_a_waiter()  # the slot it held is free again
        self._open.add(connection)
        if self._closed:  # closed while it connected
            self._forget(connection)
            raise UpstreamError(f"the transport to worker {self.url} is closed")
        return connection

    def _give_back(self, connection: WorkerConnection) -> None:
        """After an answer read to its end: back to the pool if the worker keeps it alive, else closed."""
        if connection.reusable and not self._closed:
            connection.idle_since = time.monotonic()
            self._idle.append(connection)
            if self._reaper is None:
                self._reaper = asyncio.get_running_loop().call_later(_IDLE_S, self._reap)
        else:
            self._forget(connection)
            return
        self._wake_a_waiter()

    def _reap(self) -> None:
        """Close the pooled connections idle for ``_IDLE_S`` or closed by the worker meanwhile, so that idle ones
        do not hold a socket each on both sides for ever; again when the oldest left is due. One timer per worker,
        not one per connection or per request."""
        self._reaper = None
        now = time.monotonic()
        kept = [c for c in self._idle if c.reusable and now - c.idle_since < _IDLE_S]
        for connection in self._idle:
            if connection not in kept:
                self._forget(connection)
        self._idle = kept
        if kept:
            due = min(c.idle_since for c in kept) + _IDLE_S - now
            self._reaper = asyncio.get_running_loop().call_later(max(due, 0.0), self._reap)

    def _forget(self, connection: WorkerConnection) -> None:
        connection.close()
        if connection in self._open:
            self._open.discard(connection)
            self._wake_a_waiter()

    def _wake_a_waiter(self) -> None:
        while self._waiters:
            waiter = self._waiters.popleft()
            if not waiter.done():
                waiter.set_result(None)
                return


def _header_lines(url: str, headers: Mapping[str, str]) -> list[str]:
    lines = []
    for name, value in headers.items():
        if "\r" in value or "\n" in value or "\r" in name or "\n" in name or ":" in name:
            raise UpstreamError(f"a header for worker {url} is not a valid HTTP header: {name!r}")
        lines.append(f"{name}: {value}\r\n")
    return lines

"""``Transport`` on asyncio protocols and httptools: the orchestrator's default client for its two hot calls.

Why a client of our own: the orchestrator makes exactly one kind of request (a POST of JSON bytes to a worker it
knows, over a keep-alive connection), and every general client pays per request for what it does not need here.
Against mock workers (docs/benchmarks.md, orchestrator cost) aiohttp's Python was ~20 % of the orchestrator's
samples after its own hot path was bare ASGI: a ``ClientRequest`` and a ``ClientResponse`` with their URL, header
multidicts, cookie jar, tracing hooks and timer handles per call, a ``StreamReader`` whose ``read`` joins the
chunks it was fed, and one ``send()`` per chunk of a body. Here a request is one ``writelines`` of the head and
the body's chunks (CTX's b64 span goes out as the view it is, never joined), and the answer is parsed by
httptools' C parser (llhttp, the one uvicorn and aiohttp use) as it is read. The socket is read as a
``BufferedProtocol`` (``frontend/read_buffers.py``): a whole answer of declared length, such as CTX's 700 KB with
the b64 prompt at 131k tokens, goes past the parser straight into the ``bytes`` its reader gets, never copied.

What it keeps of a general client, because production needs it: a pool of keep-alive connections per worker
(LIFO, so the warm ones are reused; idle ones closed after ``_IDLE_S`` by one timer per worker, before the
worker's own timeout, so the orchestrator is the side that closes them), at most ``_MAX_CONNECTIONS`` at once (the
rest wait their turn), a pooled connection the worker closed while it was idle never handed out (a request
written and then met by a close is never sent again here, since the worker may have run it), connect and
between-reads timeouts, TLS for ``https://`` workers, flow control on a stream the consumer reads slower than the
worker writes, and the connection closed, never pooled, when an answer is abandoned half read (that is what tells
GEN to stop) or did not end cleanly.

What it takes from a worker, or a proxy in front of one: interim ``1xx`` answers (``100 Continue``, ``103 Early
Hints``) are skipped, and the final answer is the request's; a ``101`` (no upgrade was asked for) is an error; a
head (interim ones included) over ``_MAX_HEAD_BYTES`` is an error. Anything that goes wrong is the project's own error
(``frontend.errors``), naming the worker: a refused or failed connect is ``UpstreamUnavailableError``, a timeout
``UpstreamTimeoutError``, anything else ``UpstreamError``.
"""

from __future__ import annotations

import asyncio
import contextlib
import ssl
import time
from collections import deque
from collections.abc import AsyncGenerator, Awaitable, Callable
from typing import cast
from urllib.parse import urlsplit

import httptools

from frontend.errors import UpstreamError, UpstreamTimeoutError, UpstreamUnavailableError
from frontend.read_buffers import DeclaredBody, DeclaredBodyReads
from orchestrator.transport import Body, Reply, WorkerTimeouts, body_length

_MAX_CONNECTIONS = 1024  # per worker, as the aiohttp transport
_IDLE_S = 30.0  # a worker (uvicorn) closes an idle keep-alive connection after 75 s; we close ours first
# A stream the consumer has not read yet: past this many bytes the socket is paused until it catches up.
_PAUSE_AT = 4 * 1024 * 1024
_BODY_FRAMING = (b"content-length", b"transfer-encoding")
# A whole answer declared longer than this is read straight into its own bytes (shorter ones come with their head).
_READ_PAST_THE_PARSER_FROM = 64 * 1024
# An answer's head (with any interim 1xx heads before it) may be at most this long.
_MAX_HEAD_BYTES = 64 * 1024


class HttptoolsTransport:
    def __init__(self, url: str, timeouts: WorkerTimeouts) -> None:
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
        self._host_line = f"Host: {host_header}\r\n"
        self._idle: list[_Connection] = []  # LIFO: the last one given back is the warmest
        self._open: set[_Connection] = set()
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
        return HttptoolsStream(self, connection)

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
            for name, value in headers.items():
                if "\r" in value or "\n" in value or "\r" in name or "\n" in name or ":" in name:
                    raise UpstreamError(f"a header for worker {self.url} is not a valid HTTP header: {name!r}")
                lines.append(f"{name}: {value}\r\n")
        lines.append("\r\n")
        try:
            return "".join(lines).encode("latin-1")
        except UnicodeEncodeError as exc:
            raise UpstreamError(f"a header for worker {self.url} is not latin-1: {exc}") from None

    async def _send(self, head: bytes, body: Body, read_timeout_s: float | None, stream: bool) -> _Connection:
        """A connection on which the answer's status and headers have arrived; ``stream``: its body will be read
        as it comes, else whole."""
        timeout_s = read_timeout_s or self._timeouts.request_s
        # (A pooled connection the worker closed while it was idle is never handed out: ``_pooled`` checks.)
        return await self._attempt(await self._acquire(), head, body, timeout_s, stream)

    async def _reply(self, connection: _Connection) -> Reply:
        """The whole answer; the connection back to the pool, or closed if it was not read to its end."""
        try:
            return Reply(connection.status, await connection.whole_body())
        finally:
            self._give_back(connection)

    async def _attempt(self, connection: _Connection, head: bytes, body: Body, timeout_s: float,
                       stream: bool) -> _Connection:
        try:
            connection.send(head, body, timeout_s, stream)
            await connection.headers_arrived()
            return connection
        except BaseException:
            self._forget(connection)
            raise

    # -- the pool ---------------------------------------------------------------------------------------------
    async def _acquire(self) -> _Connection:
        if self._closed:
            raise UpstreamError(f"the transport to worker {self.url} is closed")
        while (connection := self._pooled()) is None:
            if len(self._open) + self._connecting < _MAX_CONNECTIONS:
                return await self._connect()
            await self._wait_for_a_slot()
        return connection

    def _pooled(self) -> _Connection | None:
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

    async def _connect(self) -> _Connection:
        loop = asyncio.get_running_loop()
        self._connecting += 1
        connection: _Connection | None = None
        try:
            async with asyncio.timeout(self._timeouts.connect_s):
                _, connection = await loop.create_connection(
                    lambda: _Connection(self.url), self._host, self._port, ssl=self._ssl,
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

    def _give_back(self, connection: _Connection) -> None:
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

    def _forget(self, connection: _Connection) -> None:
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


class HttptoolsStream:
    """``OpenStream`` over a connection whose answer's headers have arrived."""

    def __init__(self, transport: HttptoolsTransport, connection: _Connection) -> None:
        self._transport = transport
        self._connection: _Connection | None = connection
        self._status = connection.status

    @property
    def status_code(self) -> int:
        return self._status

    async def chunks(self) -> AsyncGenerator[bytes, None]:
        try:
            connection = self._connection
            if connection is None:
                return
            while True:
                chunk = await connection.next_chunk()
                if chunk is None:
                    return
                yield chunk
        finally:
            await self.aclose()

    async def pipe(self, take: Callable[[bytes], bool], drained: Callable[[], Awaitable[object]]) -> None:
        try:
            if self._connection is not None:
                await self._connection.pipe(take, drained)
        finally:
            await self.aclose()

    async def read(self) -> bytes:
        try:
            if self._connection is None:
                return b""
            return await self._connection.whole_body()
        finally:
            await self.aclose()

    def __del__(self) -> None:
        # A stream dropped without ``aclose`` (its relay generator never started, say, because the client left
        # while the answer's first line was being sent) closes its connection when it is collected, as aiohttp's
        # responses do: the worker then stops, and the pool slot is free again. (``__del__``, not a
        # ``weakref.finalize``: that costs a registration and a detach on every stream.)
        connection, self._connection = self._connection, None
        if connection is not None:
            with contextlib.suppress(RuntimeError):  # collected after its event loop closed: nothing left to tell
                self._transport._forget(connection)

    async def aclose(self) -> None:
        connection, self._connection = self._connection, None
        if connection is None:
            return
        if connection.complete:
            self._transport._give_back(connection)
        else:
            # Cut short (the client left, or a failure): closing the connection is what tells the worker to stop.
            self._transport._forget(connection)


class _Connection(DeclaredBodyReads, asyncio.BufferedProtocol):
    """One HTTP/1.1 connection to a worker: one request at a time, its answer parsed as it arrives."""

    def __init__(self, url: str) -> None:
        self.url = url
        self.idle_since = 0.0
        self.status = 0
        self.complete = False  # the current answer has arrived whole
        self.flow_controlled = False  # a stream: pause the socket while the reader is far behind
        self._transport: asyncio.Transport | None = None
        self._parser = httptools.HttpResponseParser(self)
        self._loop = asyncio.get_running_loop()
        self._used = False  # a request has gone out on it
        self._received_any = False
        self._keep_alive = False
        self._headers_done = False
        self._delimited = False  # the answer says where its body ends (Content-Length or chunked)
        self._interim = False  # the head being parsed is a 1xx, after which the final answer comes
        self._head_bytes = 0  # bytes read while the answer's head was awaited
        self._failure: Exception | None = None  # an UpstreamError
        self._body: list[bytes] = []
        self._buffered = 0
        self._paused = False
        self._stream = False  # the answer's body is read as it comes (else whole)
        self._declared = b""  # its Content-Length
        self.start_reads()  # a whole answer read past the parser is ``declared_body``
        self._waiter: asyncio.Future[None] | None = None
        self._sink: Callable[[bytes], bool] | None = None  # while piped: takes each piece of the body (``pipe``)
        self._timer: asyncio.TimerHandle | None = None
        self._timer_due = 0.0  # loop time the armed timer fires at
        self._read_timeout_s = 0.0
        self._last_read = 0.0

    @property
    def reusable(self) -> bool:
        """The last exchange ended cleanly: its whole answer read, the worker keeping the connection, and the whole
        request written (a worker that answered before reading all of it may take the rest for a next request)."""
        transport = self._transport
        return transport is not None and self.complete and self._keep_alive and self._failure is None \
            and not transport.is_closing() and transport.get_write_buffer_size() == 0

    # -- the request ------------------------------------------------------------------------------------------
    def send(self, head: bytes, body: Body, read_timeout_s: float, stream: bool) -> None:
        if self._transport is None or self._transport.is_closing():
            raise UpstreamError(f"worker {self.url} failed: it closed the connection before the request")
        if self._used:
            self._parser = httptools.HttpResponseParser(self)
        self._resume()
        self._used = True
        self.status = 0
        self.complete = self._headers_done = self._received_any = self._keep_alive = False
        self.flow_controlled = self._delimited = self._interim = False
        self._head_bytes = 0
        self._stream = stream
        self._declared = b""
        self.declared_body = None
        self._body = []
        self._buffered = 0
        self._read_timeout_s = read_timeout_s
        self._last_read = self._loop.time()
        due = self._last_read + read_timeout_s
        if self._timer is None or self._timer_due > due:  # else the armed one fires in time, and moves on
            self._stop_timer()
            self._arm_timer(due)
        if isinstance(body, bytes):
            if len(body) <= 65536:
                self._transport.write(head + body if body else head)  # one send for a small request
            else:
                self._transport.writelines((head, body))
        else:
            self._transport.writelines((head, *body))

    async def headers_arrived(self) -> None:
        while not self._headers_done:
            await self._wait()

    async def whole_body(self) -> bytes:
        self.flow_controlled = False
        self._resume()
        while not self.complete:
            await self._wait()
        body = self._body
        self._body = []
        return body[0] if len(body) == 1 else b"".join(body)

    async def next_chunk(self) -> bytes | None:
        """The next piece of the body as it arrived (pieces that arrived together come joined), or None at its
        end."""
        while not self._body:
            if self.complete:
                return None
            await self._wait()
        body = self._body
        self._body = []
        self._buffered = 0
        self._resume()
        return body[0] if len(body) == 1 else b"".join(body)

    async def pipe(self, take: Callable[[bytes], bool], drained: Callable[[], Awaitable[object]]) -> None:
        """The rest of the body handed to ``take`` from ``on_body`` as it is parsed: a piece wakes no coroutine.
        When ``take`` says its client is behind, reading pauses until ``drained`` returns."""
        self._hand_on(take)  # what came with the head, before the pipe was laid
        self._sink = take
        try:
            while not self.complete:
                if self._paused and self._transport is not None and self._failure is None:
                    await drained()
                    self._resume()
                else:
                    await self._wait()
        finally:
            self._sink = None
        self._hand_on(take)

    def _hand_on(self, take: Callable[[bytes], bool]) -> None:
        """The pieces parsed from one read, to ``take`` in one piece; reading pauses if its client is behind."""
        body = self._body
        if not body:
            return
        self._body = []
        self._buffered = 0
        if not take(body[0] if len(body) == 1 else b"".join(body)) and not self._paused and \
                self._transport is not None and not self.complete:
            self._paused = True  # the client is behind: ``pipe`` waits for it, then reads on
            self._transport.pause_reading()
            self._wake()

    async def _wait(self) -> None:
        if self._failure is not None:
            raise self._failure
        waiter = self._waiter = self._loop.create_future()
        try:
            await waiter
        finally:
            self._waiter = None
        if self._failure is not None:
            raise self._failure

    def close(self) -> None:
        self._stop_timer()
        transport, self._transport = self._transport, None
        if transport is None:
            return
        if (self.complete or not self._used) and not transport.get_write_buffer_size():
            transport.close()
        else:
            # Cut mid-request, or with some of it unsent: a close would first wait for the kernel to take the rest
            # of our request, which a worker that stopped reading never does; an abort tells it at once.
            transport.abort()

    def _resume(self) -> None:
        if self._paused and self._transport is not None:
            self._paused = False
            self._last_read = self._loop.time()  # the wait was ours, not the worker's
            self._transport.resume_reading()

    # -- what the worker sends --------------------------------------------------------------------------------
    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self._transport = cast(asyncio.Transport, transport)  # uvloop's transports do not subclass asyncio's

    def buffer_updated(self, nbytes: int) -> None:
        self._last_read = self._loop.time()  # for the read timeout, whichever buffer the read went into
        super().buffer_updated(nbytes)

    def awaiting_head(self) -> bool:
        return not self._headers_done or self.complete

    def declared_body_read(self) -> None:
        self._body_complete()  # keep-alive as the head said; the next send replaces the waiting parser

    def data_received(self, data: bytes) -> None:
        if self.complete or not self._used:
            # Bytes with no request in flight (an unasked answer, a 408 before an idle close): whatever they are,
            # they would be taken for the next request's answer.
            self.close()
            return
        self._received_any = True
        try:
            self._parser.feed_data(data)
        except httptools.HttpParserError as exc:
            self._fail(UpstreamError(f"worker {self.url} sent an answer that is not valid HTTP: {exc}"))
            self.close()
            return
        except httptools.HttpParserUpgrade:  # a 101: ``on_headers_complete`` has failed the request
            self.close()
            return
        if self._sink is not None and self._body:
            self._hand_on(self._sink)
        if not self._headers_done and not self.complete:
            self._head_bytes += len(data)  # per read: at most one read (16 KiB) is parsed past the limit
            if self._head_bytes > _MAX_HEAD_BYTES:
                self._fail(UpstreamError(f"worker {self.url} sent an answer whose head is over {_MAX_HEAD_BYTES} "
                                         "bytes"))
                self.close()

    def connection_lost(self, exc: Exception | None) -> None:
        self._transport = None
        self._stop_timer()
        if self.complete or self._failure is not None:
            return
        if not self._used:
            return  # an idle connection the worker closed: the pool finds it unusable
        if not self._received_any:
            # Written, then met by a close with not a byte back. On a reused connection this may be the worker's
            # idle close crossing the request; it may as well be a worker that took the request and died: it may
            # have run, so it is not sent again here (the caller's retry policy decides, on another worker).
            cause = f"{type(exc).__name__}: {exc}" if exc is not None else "the worker closed the connection"
            self._fail(UpstreamError(f"worker {self.url} failed: the connection was lost before the answer began "
                                     f"({cause})"))
            return
        if self._headers_done and not self._delimited and exc is None:
            self.complete = True  # a body that ends where the connection does (no length, not chunked)
            self._wake()
            return
        cause = f"{type(exc).__name__}: {exc}" if exc is not None else "the worker closed the connection"
        self._fail(UpstreamError(f"worker {self.url} failed: the connection was lost before the answer ended "
                                 f"({cause})"))

    # -- httptools' callbacks ---------------------------------------------------------------------------------
    # After the answer's end, bytes in the same read are a second, unasked answer: ignored, and the connection is
    # not kept (``_keep_alive`` off), so they are never taken for the next request's.
    def on_header(self, name: bytes, value: bytes) -> None:
        if self.complete:
            self._keep_alive = False
            return
        name = name.lower()
        if name in _BODY_FRAMING:
            self._delimited = True
            self._declared = value if name == b"content-length" and not self._declared else b"-"

    def on_headers_complete(self) -> None:
        if self.complete:
            self._keep_alive = False
            return
        status = self._parser.get_status_code()
        if 100 <= status < 200:
            self._declared, self._delimited = b"", False  # an interim head's framing is not the answer's
            if status == 101:
                self._fail(UpstreamError(f"worker {self.url} answered 101 Switching Protocols to a request that "
                                         "asked for no upgrade"))
                return
            self._interim = True  # skipped: the final answer follows on the same connection
            return
        self.status = status
        self._keep_alive = self._parser.should_keep_alive()
        self._headers_done = True
        declared = self._declared
        if not self._stream and declared.isdigit() and int(declared) > _READ_PAST_THE_PARSER_FROM \
                and self.status >= 200 and self.status not in (204, 304):
            self.declared_body = DeclaredBody(int(declared))
        self._wake()

    def on_body(self, body: bytes) -> None:
        if self.complete:
            self._keep_alive = False
            return
        if self.declared_body is not None:
            self.declared_body.take(body)  # what came with the head; the rest is read into the same bytes
            return
        if self._sink is not None:
            self._body.append(body)  # handed on once the read is parsed (``data_received``): one write for it
            return
        self._body.append(body)
        self._buffered += len(body)
        if self._buffered > _PAUSE_AT and self.flow_controlled and not self._paused and self._transport is not None:
            self._paused = True
            self._transport.pause_reading()
        self._wake()

    def on_message_complete(self) -> None:
        if self._interim:
            self._interim = False
            return
        if self._failure is not None:
            return
        if self.complete:
            self._keep_alive = False
            return
        self._keep_alive = self._parser.should_keep_alive()
        self._body_complete()

    def _body_complete(self) -> None:
        whole, self.declared_body = self.declared_body, None
        if whole is not None:
            self._body = [whole.whole()]
        self.complete = True
        self._resume()  # nothing more is coming for this answer; a paused socket would not even see the worker close
        self._wake()

    # -- helpers ----------------------------------------------------------------------------------------------
    def _wake(self) -> None:
        waiter = self._waiter
        if waiter is not None and not waiter.done():
            waiter.set_result(None)

    def _fail(self, failure: Exception) -> None:
        if self._failure is None:
            self._failure = failure
        waiter = self._waiter
        if waiter is not None and not waiter.done():
            waiter.set_exception(failure)

    def _check_read_timeout(self) -> None:
        """Between two reads at most ``read_timeout_s`` (a stream may run long; a stalled one fails). One timer per
        connection, moved on only when it fires, not on every read, nor made and cancelled per request: it stops
        when it finds no answer awaited, and the next request arms it again."""
        self._timer = None
        if self.complete or self._failure is not None:
            return
        if self._paused:  # waiting on our own consumer, not on the worker
            self._arm_timer(self._loop.time() + self._read_timeout_s)
            return
        due = self._last_read + self._read_timeout_s
        if self._loop.time() < due:
            self._arm_timer(due)
            return
        self._fail(UpstreamTimeoutError(f"worker {self.url} timed out (nothing read for {self._read_timeout_s} s)"))
        self.close()

    def _arm_timer(self, due: float) -> None:
        self._timer = self._loop.call_at(due, self._check_read_timeout)
        self._timer_due = due

    def _stop_timer(self) -> None:
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None



"""One HTTP/1.1 connection of the default client to a worker, as an asyncio ``BufferedProtocol``.

The request goes out in one ``writelines``; the answer is parsed by httptools' C parser (llhttp, as uvicorn's and
aiohttp's) as it is read, and a whole answer of declared length (CTX's 700 KB at 131k tokens) is read past the
parser straight into its ``bytes`` (``frontend/read_buffers.py``), never copied. What it takes from a worker or a
proxy: interim ``1xx`` heads are skipped; a ``101`` or a head over ``_MAX_HEAD_BYTES`` is an error. Every failure
is the project's own error, naming the worker."""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from typing import cast

import httptools

from frontend.errors import UpstreamError, UpstreamTimeoutError
from frontend.prompt_report import PROMPT_TOKENS_HEADER_BYTES
from frontend.read_buffers import DeclaredBody, DeclaredBodyReads
from orchestrator.upstream.base import Body

# A stream the consumer has not read yet: past this many bytes the socket is paused until it catches up.
_PAUSE_AT = 4 * 1024 * 1024
_BODY_FRAMING = (b"content-length", b"transfer-encoding")
# A whole answer declared longer than this is read straight into its own bytes (shorter ones come with their head).
_READ_PAST_THE_PARSER_FROM = 64 * 1024
# An answer's head (with any interim 1xx heads before it) may be at most this long.
_MAX_HEAD_BYTES = 64 * 1024


class WorkerConnection(DeclaredBodyReads, asyncio.BufferedProtocol):
    """One HTTP/1.1 connection to a worker: one request at a time, its answer parsed as it arrives."""

    def __init__(self, url: str) -> None:
        self.url = url
        self.idle_since = 0.0
        self.status = 0
        self.prompt_report: bytes | None = None  # the answer's x-disagg-prompt-tokens header (upstream/base.py)
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
        self._sink: Callable[[bytes], bool] | None = None  # while pushed: takes each piece of the body (``push``)
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
        self.prompt_report = None
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

    async def push(self, take: Callable[[bytes], bool], drained: Callable[[], Awaitable[object]]) -> None:
        """The rest of the body handed to ``take`` from ``on_body`` as it is parsed: a piece wakes no coroutine.
        When ``take`` says its client is behind, reading pauses until ``drained`` returns."""
        self._hand_on(take)  # what came with the head, before pushing began
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
            self._paused = True  # the client is behind: ``push`` waits for it, then reads on
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
        elif name == PROMPT_TOKENS_HEADER_BYTES:
            self.prompt_report = value

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

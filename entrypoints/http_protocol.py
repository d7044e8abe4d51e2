"""uvicorn's httptools protocol with a header-read timeout (a slowloris client is cut off), and a request body of
declared length read straight into its own buffer and handed to the app whole.

uvicorn (0.54) starts no timer while a request's headers arrive: a client that opens a connection and sends
nothing, or its headers a byte at a time, holds the connection (and a file descriptor) for ever; on a keep-alive
connection the first byte of the next request even cancels the idle timer. Here each request's headers must be
complete within ``header_timeout_s`` of the connection opening or of its first byte, or the connection is closed.
A request whose headers arrived is no longer timed here (its body and answer have their own limits). Given the
``FastPathApp`` it serves, the protocol starts a POST to a fast route on its cycle itself
(``entrypoints/direct_exchange.py``); a request served through ASGI gets in its scope the ``ABORT_CONNECTION``
extension that ``frontend/client_timeouts.py`` uses, and the ``CLIENT_GONE`` one through which
``frontend/asgi_fast_path.py`` learns that the client left without a task waiting on ``receive``. The keep-alive
timer is one per connection, not one per request.

The socket is read as a ``BufferedProtocol`` (``BufferedReads``), into buffers ``frontend/read_buffers.py``
gives: between requests a small one shared by the thread's connections, copied out as the ``bytes`` uvicorn
parses; once the headers of a body of declared length (64 KiB to ``WHOLE_BODY_UP_TO``) are parsed, the rest of
the body straight into the ``bytes`` the app gets, never through the parser.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import socket
import struct
from collections.abc import Callable
from typing import Any

import httptools
from uvicorn.protocols.http.flow_control import HIGH_WATER_LIMIT
from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol, RequestResponseCycle

from entrypoints.direct_exchange import CycleExchange
from frontend.asgi_fast_path import CLIENT_GONE, FastPathApp
from frontend.client_timeouts import ABORT_CONNECTION, DEFAULT_HEADER_TIMEOUT_S, TIMER_SLACK_S
from frontend.read_buffers import DeclaredBody, DeclaredBodyReads

logger = logging.getLogger(__name__)

# A request body of a declared length up to this is read whole before the app is woken (below).
WHOLE_BODY_UP_TO = 16 * 1024 * 1024


def protocol_with_header_timeout(header_timeout_s: float, app: Any = None) -> type[BufferedReads]:
    """A protocol class for uvicorn's ``http=`` (a factory called with uvicorn's options): an ``HttpToolsProtocol``
    closing slow-header connections, its socket read by ``BufferedReads``. ``app``: the ``FastPathApp`` served,
    whose fast routes the protocol then serves itself (``entrypoints/direct_exchange.py``)."""

    class HeaderTimeoutProtocol(_HeaderTimeoutProtocol):
        timeout_s = header_timeout_s
        direct_app = app if isinstance(app, FastPathApp) else None

    class HeaderTimeoutReads(BufferedReads):
        http_protocol = HeaderTimeoutProtocol

    return HeaderTimeoutReads


class BufferedReads(asyncio.BufferedProtocol):
    """The transport's protocol: reads into the buffers the HTTP protocol it holds chooses, and hands it everything
    else. (uvloop reads into a protocol's own buffer only if the protocol is not an ``asyncio.Protocol``, which
    uvicorn's is: hence a wrapper and not a subclass.)"""

    # The read callbacks are the HTTP protocol's own bound methods, so that a read costs no call more than before.
    __slots__ = ("buffer_updated", "get_buffer", "http")
    http_protocol: type[_HeaderTimeoutProtocol]

    def __init__(self, **options: Any) -> None:
        self.http = self.http_protocol(**options)
        self.get_buffer = self.http.get_buffer  # type: ignore[method-assign]
        self.buffer_updated = self.http.buffer_updated  # type: ignore[method-assign]

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.http.connection_made(transport)  # type: ignore[arg-type]

    def eof_received(self) -> bool | None:
        self.http.eof_received()
        return None  # the transport closes itself, as it does for uvicorn's protocol

    def connection_lost(self, exc: Exception | None) -> None:
        self.http.connection_lost(exc)

    def pause_writing(self) -> None:
        self.http.pause_writing()

    def resume_writing(self) -> None:
        self.http.resume_writing()


class _HeaderTimeoutProtocol(HttpToolsProtocol, DeclaredBodyReads):
    timeout_s = DEFAULT_HEADER_TIMEOUT_S
    direct_app: FastPathApp | None = None

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._header_timer: asyncio.TimerHandle | None = None
        # Called once when the connection is lost: a set, so that a pipelined request's callback is not the
        # running one's; each request takes its own out when it is done.
        self._client_gone: set[Callable[[], None]] = set()
        self._heads = 0  # request heads parsed on this connection
        self._idle_since: float | None = None  # loop time of the last answer, while no bytes came after it
        self.start_reads()  # a body read whole is ``declared_body`` (else read uvicorn's way)

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        super().connection_made(transport)
        self._start_header_timer()

    # -- reads (``BufferedReads``, ``DeclaredBodyReads``) -------------------------------------------------------
    def get_buffer(self, sizehint: int) -> memoryview:
        body = self.declared_body
        if body is not None and self.cycle.response_complete:
            body.drop()  # answered without it (a 413): read to its end, kept nowhere
        return super().get_buffer(sizehint)

    def awaiting_head(self) -> bool:
        return self.cycle is None or not self.cycle.more_body

    def declared_body_read(self) -> None:
        self._replace_parser()  # the old one still waits for the bytes that went past it
        self.on_message_complete()

    # -- the request --------------------------------------------------------------------------------------------
    def data_received(self, data: bytes) -> None:
        # Between requests on a keep-alive connection the idle timer runs; the next request's first byte starts
        # its header clock, unless the same read brought its whole head: nearly always, and then a timer would
        # only be made and cancelled. (A head, not a new cycle: an upgrade's head makes none, and its connection is
        # no longer this protocol's to time.)
        awaiting_head = self._header_timer is None and self.cycle is not None and self.cycle.response_complete
        heads = self._heads
        super().data_received(data)
        if awaiting_head and self._heads == heads and not self.transport.is_closing():
            self._start_header_timer()

    def on_headers_complete(self) -> None:
        self._heads += 1
        self._stop_header_timer()
        super().on_headers_complete()
        declared = b""
        for name, value in self.headers:
            if name == b"content-length" and not declared:
                declared = value
            elif name == b"transfer-encoding":
                return  # framed by chunks, whatever it also declares: the parser's way
        if declared.isdigit() and HIGH_WATER_LIMIT < int(declared) <= WHOLE_BODY_UP_TO \
                and not self.parser.should_upgrade():
            self.declared_body = DeclaredBody(int(declared))

    def _start_asgi_task(self, cycle: RequestResponseCycle, app: Any) -> None:
        """A POST to one of ``direct_app``'s fast routes is served on its cycle directly; anything else, and any
        request uvicorn answers with an app of its own (a 503 past ``limit_concurrency``), through ASGI."""
        direct = self.direct_app
        if direct is not None and app is self.app and cycle.scope["method"] == "POST" \
                and not getattr(self.config, "reset_contextvars", False):
            handler = direct.fast_routes.get(cycle.scope["path"])
            if handler is not None:
                exchange = CycleExchange(cycle, self._client_gone, self._reset_connection, direct.send_timeout_s)
                task = self.loop.create_task(exchange.run(handler))
                task.add_done_callback(self.tasks.discard)
                self.tasks.add(task)
                return
        # For an app served through ASGI: how frontend/client_timeouts.py drops a stalled client at once (close()
        # would first wait for the client to read what is still buffered, which it will not), and how the fast
        # path's exchange learns that the client left. (A direct exchange is given both itself.)
        extensions = cycle.scope.setdefault("extensions", {})
        extensions[ABORT_CONNECTION] = {"abort": self._reset_connection}
        extensions[CLIENT_GONE] = {"callbacks": self._client_gone}
        super()._start_asgi_task(cycle, app)

    def on_body(self, body: bytes) -> None:
        """A body of declared length is read whole, then handed over as one piece.

        uvicorn appends every piece to a bytearray, pauses the socket past 64 KiB and wakes the app for each piece;
        the app copies the bytearray out each time and joins the copies. For a 524 KB prompt that was ten
        pause/resume rounds, as many wake-ups of the request's task and three copies of the body. Read whole, it is
        one wake-up and no copy but of what came in the read of its head (through the parser, here): the rest is
        read into the body's own ``bytes`` (``get_buffer``). The app reads every body whole anyway
        (``frontend/asgi_fast_path.py``), and what it may hold is capped twice: a declared length above
        ``max_body_bytes`` is refused before a byte is read, and this applies only up to ``WHOLE_BODY_UP_TO``."""
        whole = self.declared_body
        if whole is None:
            super().on_body(body)
            return
        if self.cycle.response_complete:
            whole.drop()  # answered without it (a 413): counted to its end, kept nowhere
        whole.take(body)

    def on_message_complete(self) -> None:
        whole, self.declared_body = self.declared_body, None
        if whole is not None and not self.cycle.response_complete:
            self.cycle.body = whole.whole()  # type: ignore[assignment]
        super().on_message_complete()

    # -- keep-alive: one timer per connection, moved on when it fires ------------------------------------------
    # uvicorn makes a keep-alive timer as each answer completes and cancels it at the next request's first byte:
    # a timer made and cancelled per request. Here the connection keeps one while it is idle, which finds out when
    # it fires whether the connection was idle for ``timeout_keep_alive`` since its last answer.
    def on_response_complete(self) -> None:
        # uvicorn's, but for the timer.
        self.server_state.total_requests += 1
        if self.transport.is_closing():
            return
        self.flow.resume_reading()
        if self.pipeline:
            cycle, app = self.pipeline.pop()
            self._start_asgi_task(cycle, app)
            return
        self._idle_since = self.loop.time()
        if self.timeout_keep_alive_task is None:
            self.timeout_keep_alive_task = self.loop.call_later(self.timeout_keep_alive, self._keep_alive_due)

    def _unset_keepalive_if_required(self) -> None:
        self._idle_since = None  # bytes came: busy (an armed timer finds it so, and stops)

    def _keep_alive_due(self) -> None:
        self.timeout_keep_alive_task = None
        if self._idle_since is None:
            return  # armed again when the request in progress is answered
        due = self._idle_since + self.timeout_keep_alive
        if self.loop.time() < due - TIMER_SLACK_S:
            self.timeout_keep_alive_task = self.loop.call_at(due, self._keep_alive_due)
            return
        self.timeout_keep_alive_handler()

    def _replace_parser(self) -> None:
        """A parser made as uvicorn makes its own (its leniency too: it answers the first of pipelined requests
        whose first says ``Connection: close``), for the bytes after a body the old one never saw."""
        parser = httptools.HttpRequestParser(self)
        with contextlib.suppress(AttributeError):  # httptools < 0.6.3, as in uvicorn
            parser.set_dangerous_leniencies(lenient_data_after_close=True)
        self.parser = parser

    def connection_lost(self, exc: Exception | None) -> None:
        self._stop_header_timer()
        if self.timeout_keep_alive_task is not None:
            self.timeout_keep_alive_task.cancel()
            self.timeout_keep_alive_task = None
        self.declared_body = None  # what it held of a body is no one's now
        super().connection_lost(exc)
        callbacks = list(self._client_gone)
        self._client_gone.clear()
        for callback in callbacks:
            callback()

    def _reset_connection(self) -> None:
        """Close with a reset (SO_LINGER 0): a plain close leaves the unsent answer with the kernel, which keeps
        the connection half-open for as long as the client keeps its window shut."""
        sock = self.transport.get_extra_info("socket")
        if sock is not None:
            with contextlib.suppress(OSError):
                sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
        self.transport.abort()

    def _start_header_timer(self) -> None:
        self._stop_header_timer()
        self._header_timer = self.loop.call_later(self.timeout_s, self._headers_too_slow)

    def _stop_header_timer(self) -> None:
        if self._header_timer is not None:
            self._header_timer.cancel()
            self._header_timer = None

    def _headers_too_slow(self) -> None:
        self._header_timer = None
        if not self.transport.is_closing():
            logger.info("closed a connection from %s: no complete request headers within %s s",
                        self.client, self.timeout_s)
            self.transport.close()

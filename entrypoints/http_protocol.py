"""uvicorn's httptools protocol, guarded against hostile clients, with a request body of declared length read
straight into its own buffer and handed to the app whole.

What uvicorn (0.54) leaves unbounded, and this protocol bounds, each cut-off logged and counted
(``disagg_http_connections_cut{reason}``):

- a request's head must be complete within ``header_timeout_s`` of the connection opening or of its first byte
  (uvicorn starts no timer while headers arrive: a slowloris client holds the connection for ever), and be at most
  ``max_head_bytes`` long (httptools grows a header value without limit, at a cost that grows with its square: one
  48 MiB header cost 27 s of CPU): a 431 and a close, refused before more than one read past the limit is parsed;
- a request's body must be complete within ``body_timeout_s`` of its head, and as long again for each MiB it
  declares past the first (a head and one byte of its body held a connection, and in the orchestrator an
  admission slot, for ever): a 408 and a close; chunk framing and trailers that bring no body bytes count against
  the head limit;
- an HTTP/1.1 request has exactly one ``Host``, an HTTP/1.0 one at most one (RFC 9112 3.2), else a 400; malformed
  requests get an OpenAI-shaped 400, not uvicorn's plain text;
- an answer sent before its request's body arrived (a 401, 413 or 429) says ``connection: close``, and the
  connection is closed once the client has seen it (our side shut, what the client still sends read and dropped
  for a few seconds): reading on would take the client's next request for the rest of the body, and a plain close
  with unread bytes resets the connection, answer and all;
- an HTTP/1.0 client gets no ``100 Continue`` and no chunked encoding (its answer's end is the connection's);
- trailers of a chunked request body never join the request's headers.

Given the ``FastPathApp`` it serves, the protocol starts a POST to a fast route on its cycle itself
(``entrypoints/direct_exchange.py``); a request served through ASGI gets in its scope the ``ABORT_CONNECTION``
extension that ``frontend/client_timeouts.py`` uses, and the ``CLIENT_GONE`` one through which
``frontend/asgi_fast_path.py`` learns that the client left without a task waiting on ``receive``. The keep-alive
timer is one per connection, not one per request.

The socket is read as a ``BufferedProtocol`` (``BufferedReads``), into buffers ``frontend/read_buffers.py``
gives: between requests a small one shared by the thread's connections, copied out as the ``bytes`` uvicorn
parses; once the headers of a body of declared length (64 KiB to ``WHOLE_BODY_UP_TO``) are parsed, the rest of
the body straight into the ``bytes`` the app gets, never through the parser.

This drives uvicorn's private protocol and cycle classes, so it is written for one uvicorn release
(``MIRRORED_UVICORN``; pyproject.toml pins it): ``check_uvicorn_version`` refuses to start on any other, by name,
rather than serve with a hook that a newer release no longer calls.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import socket
import struct
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import httptools
import uvicorn
from uvicorn.protocols.http.flow_control import HIGH_WATER_LIMIT
from uvicorn.protocols.http.httptools_impl import STATUS_LINE, HttpToolsProtocol, RequestResponseCycle

from entrypoints.direct_exchange import CycleExchange, default_header_lines
from frontend.asgi_fast_path import CLIENT_GONE, FastPathApp
from frontend.client_timeouts import (
    ABORT_CONNECTION,
    DEFAULT_BODY_TIMEOUT_S,
    DEFAULT_HEADER_TIMEOUT_S,
    DEFAULT_MAX_HEAD_BYTES,
    TIMER_SLACK_S,
)
from frontend.errors import HeadTooLargeError, InvalidRequestError, RequestTimeoutError, ServingError, error_body
from frontend.http import request_id_of
from frontend.read_buffers import DeclaredBody, DeclaredBodyReads

logger = logging.getLogger(__name__)

# The uvicorn releases whose protocol and cycle internals this module (and ``direct_exchange``) mirror: each was
# read, and the suite passed on it. Another release may have renamed a field or stopped calling a hook, which would
# not fail loudly: the server would serve with a limit silently off.
MIRRORED_UVICORN = ("0.54.0",)

# A request body of a declared length up to this is read whole before the app is woken (below).
WHOLE_BODY_UP_TO = 16 * 1024 * 1024
# How long a connection closed before its request's body was read keeps reading (and dropping) what the client
# still sends, so that its close does not reset the connection before the client has read the answer.
LINGER_S = 5.0
# ... and only while the client keeps sending: a pause this long means it has nothing more (or has read the answer
# and stopped), so the close loses nothing.
LINGER_PAUSE_S = 0.5


def check_uvicorn_version(version: str = uvicorn.__version__) -> None:
    """Refuse, by name, a uvicorn release this module was not written for."""
    if version not in MIRRORED_UVICORN:
        raise RuntimeError(
            f"disagg-serve's HTTP layer is written for uvicorn {' or '.join(MIRRORED_UVICORN)}, and uvicorn "
            f"{version} is installed: its private protocol internals may differ, which would leave limits on "
            f"hostile clients silently off. Install the release it was written for: "
            f"pip install 'uvicorn[standard]=={MIRRORED_UVICORN[-1]}'")


@dataclass(frozen=True, slots=True)
class ClientLimits:
    """What one client may make a front end wait for or hold (docs/reliability.md)."""

    header_timeout_s: float = DEFAULT_HEADER_TIMEOUT_S
    body_timeout_s: float = DEFAULT_BODY_TIMEOUT_S
    max_head_bytes: int = DEFAULT_MAX_HEAD_BYTES


def guarded_protocol(limits: ClientLimits = ClientLimits(), app: Any = None,
                     count_cut: Callable[[str], None] | None = None) -> type[BufferedReads]:
    """A protocol class for uvicorn's ``http=`` (a factory called with uvicorn's options): an ``HttpToolsProtocol``
    holding clients to ``limits``, its socket read by ``BufferedReads``. ``app``: the ``FastPathApp`` served, whose
    fast routes the protocol then serves itself (``entrypoints/direct_exchange.py``); ``count_cut``: called with
    the reason (``frontend.metrics.CONNECTION_CUT_REASONS``) of each connection cut on a limit."""
    check_uvicorn_version()

    class Protocol(_GuardedProtocol):
        pass

    Protocol.limits = limits
    Protocol.direct_app = app if isinstance(app, FastPathApp) else None
    if count_cut is not None:
        Protocol.count_cut = staticmethod(count_cut)  # type: ignore[method-assign, assignment]

    class Reads(BufferedReads):
        http_protocol = Protocol

    return Reads


class BufferedReads(asyncio.BufferedProtocol):
    """The transport's protocol: reads into the buffers the HTTP protocol it holds chooses, and hands it everything
    else. (uvloop reads into a protocol's own buffer only if the protocol is not an ``asyncio.Protocol``, which
    uvicorn's is: hence a wrapper and not a subclass.)"""

    # The read callbacks are the HTTP protocol's own bound methods, so that a read costs no call more than before.
    __slots__ = ("buffer_updated", "get_buffer", "http")
    http_protocol: type[_GuardedProtocol]

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


class _Refused(Exception):
    """Raised from a parser callback to stop parsing a request the protocol refuses (``_refusal`` says why)."""


class _GuardedProtocol(HttpToolsProtocol, DeclaredBodyReads):
    limits = ClientLimits()
    direct_app: FastPathApp | None = None

    @staticmethod
    def count_cut(reason: str) -> None:
        """Counts a connection cut on a limit (``guarded_protocol`` gives the server's metric)."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._header_timer: asyncio.TimerHandle | None = None
        # One body timer per connection, moved on when it fires (as the keep-alive timer): a client that sends a
        # head and its body in two writes (httpx, the openai SDK) would otherwise make and cancel one per request.
        self._body_timer: asyncio.TimerHandle | None = None
        self._body_due: float | None = None  # loop time the body being read must be in by
        self._stalled_bytes = 0  # bytes read since the body last moved (chunk framing, trailers)
        self._body_moved = False  # a read gave the body bytes
        self._linger: asyncio.TimerHandle | None = None
        self._linger_until = 0.0  # loop time a lingering connection closes by, whatever the client sends
        self._dropped_at = 0.0  # loop time of the last read dropped while lingering
        # Called once when the connection is lost: a set, so that a pipelined request's callback is not the
        # running one's; each request takes its own out when it is done.
        self._client_gone: set[Callable[[], None]] = set()
        self._heads = 0  # request heads parsed on this connection
        self._in_head = False  # a request's head has begun and is not complete
        self._head_bytes = 0  # bytes read of that head in earlier reads
        self._refusal: tuple[ServingError, str] | None = None  # why a parser callback stopped the parse
        self._dropping = False  # closing: what the client still sends is read and dropped, never parsed
        self._idle_since: float | None = None  # loop time of the last answer, while no bytes came after it
        self.start_reads()  # a body read whole is ``declared_body`` (else read uvicorn's way)

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        super().connection_made(transport)
        self._start_header_timer()

    # -- reads (``BufferedReads``, ``DeclaredBodyReads``) -------------------------------------------------------
    def awaiting_head(self) -> bool:
        return self.cycle is None or not self.cycle.more_body

    def declared_body_read(self) -> None:
        self._replace_parser()  # the old one still waits for the bytes that went past it
        self.on_message_complete()

    # -- the request --------------------------------------------------------------------------------------------
    def data_received(self, data: bytes) -> None:
        """uvicorn's, with the head's clock and size checked after each read, the body's clock started, and
        refusals answered in OpenAI's error shape."""
        if self._dropping:
            self._dropped_at = self.loop.time()
            return
        # Between requests on a keep-alive connection the idle timer runs; the next request's first byte starts
        # its header clock, unless the same read brought its whole head: nearly always, and then a timer would
        # only be made and cancelled. (A head, not a new cycle: an upgrade's head makes none, and its connection is
        # no longer this protocol's to time.)
        awaiting_head = self._header_timer is None and self.cycle is not None and self.cycle.response_complete
        heads = self._heads
        was_in_head = self._in_head
        self._idle_since = None  # bytes came: busy (an armed keep-alive timer finds it so, and stops)
        self._body_moved = False
        try:
            self.parser.feed_data(data)
        except httptools.HttpParserUpgrade:
            if self._should_upgrade():
                self.handle_websocket_upgrade()
            else:
                self._unsupported_upgrade_warning()
            return
        except httptools.HttpParserError as exc:
            refusal, self._refusal = self._refusal, None
            self._refuse(*(refusal or (InvalidRequestError(f"invalid HTTP request: {exc}"), "bad_request")))
            return
        if self._heads == heads:
            if self._in_head and was_in_head:
                # Counted per read, not per byte: what is parsed past the limit is at most one read (16 KiB). (A
                # head begun in this read is measured whole when complete, or from the next read.)
                self._head_bytes += len(data)
                if self._head_bytes > self.limits.max_head_bytes:
                    self._refuse(HeadTooLargeError(f"the request's head is over {self.limits.max_head_bytes} "
                                                   "bytes"), "head_too_large")
                    return
            if awaiting_head and not self.transport.is_closing():
                self._start_header_timer()
        else:
            self._head_bytes = 0  # (a next head begun in the same read counts from the next read)
        cycle = self.cycle
        if cycle is None or not cycle.more_body or self._in_head or self.transport.is_closing():
            return
        # A body still to come after this read (a short one came with its head: no clock started). Only for the
        # request being served: a pipelined one's body is not read (uvicorn pauses reading) until its turn.
        if self._body_due is None and not self.pipeline:
            self._start_body_clock(cycle)
        # Bytes that moved no body (chunk framing, a trailer: httptools grows a trailer as it grows a header)
        # count against the head limit, so that a chunked body cannot carry what a head may not.
        self._stalled_bytes = 0 if self._body_moved else self._stalled_bytes + len(data)
        if self._stalled_bytes > self.limits.max_head_bytes:
            self._refuse(HeadTooLargeError(f"the request's chunk framing or trailers are over "
                                           f"{self.limits.max_head_bytes} bytes"), "head_too_large")

    def on_message_begin(self) -> None:
        self._in_head = True
        super().on_message_begin()

    def on_header(self, name: bytes, value: bytes) -> None:
        if not self._in_head:
            return  # a trailer of a chunked body: not one of the request's headers
        name = name.lower()
        if name == b"expect" and value.lower() == b"100-continue":
            self.expect_100_continue = True
        self.headers.append((name, value))

    def on_headers_complete(self) -> None:
        self._heads += 1
        self._in_head = False
        self._stop_header_timer()
        declared = b""
        chunked = False
        hosts = 0
        size = len(self.url)
        for name, value in self.headers:
            size += len(name) + len(value)
            if name == b"content-length" and not declared:
                declared = value
            elif name == b"transfer-encoding":
                chunked = True  # framed by chunks, whatever it also declares: the parser's way
            elif name == b"host":
                hosts += 1
        if size > self.limits.max_head_bytes:  # a head that came in one read: measured whole
            self._refusal = (HeadTooLargeError(f"the request's head is over {self.limits.max_head_bytes} bytes"),
                             "head_too_large")
            raise _Refused()
        self._stalled_bytes = 0
        version = self.parser.get_http_version()
        if hosts > 1 or (hosts == 0 and version != "1.0"):
            self._refusal = (InvalidRequestError("an HTTP/1.1 request needs exactly one Host header (RFC 9112 3.2)",
                                                 param="host"), "bad_request")
            raise _Refused()
        if version == "1.0":
            self.expect_100_continue = False  # no 1xx for an HTTP/1.0 client (RFC 9110 15.2)
        super().on_headers_complete()
        if not chunked and declared.isdigit() and HIGH_WATER_LIMIT < int(declared) <= WHOLE_BODY_UP_TO \
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
                exchange = CycleExchange(cycle, self, direct.send_timeout_s)
                task = self.loop.create_task(exchange.run(handler))
                task.add_done_callback(self.tasks.discard)
                self.tasks.add(task)
                return
        # For an app served through ASGI: how frontend/client_timeouts.py drops a stalled client at once (close()
        # would first wait for the client to read what is still buffered, which it will not), and how the fast
        # path's exchange learns that the client left. (A direct exchange is given both itself.)
        extensions = cycle.scope.setdefault("extensions", {})
        extensions[ABORT_CONNECTION] = {"abort": self.reset}
        extensions[CLIENT_GONE] = {"callbacks": self._client_gone}
        cycle.__class__ = _GuardedCycle  # its send, for early answers and HTTP/1.0 (no field to initialise)
        cycle.connection = self  # type: ignore[attr-defined]
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
        self._body_moved = True
        whole = self.declared_body
        if whole is None:
            super().on_body(body)
            return
        whole.take(body)

    def on_message_complete(self) -> None:
        self._body_due = None  # (an armed body timer finds it so, and stops)
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
        if self.transport.is_closing() or self._dropping:
            return
        self.flow.resume_reading()
        if self.pipeline:
            cycle, app = self.pipeline.pop()
            if cycle.more_body and self._body_due is None:
                self._start_body_clock(cycle)  # its body is read from now on
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
        self._stop_body_timer()
        if self._linger is not None:
            self._linger.cancel()
        if self.timeout_keep_alive_task is not None:
            self.timeout_keep_alive_task.cancel()
            self.timeout_keep_alive_task = None
        self.declared_body = None  # what it held of a body is no one's now
        super().connection_lost(exc)
        callbacks = list(self._client_gone)
        self._client_gone.clear()
        for callback in callbacks:
            callback()

    # -- what an exchange may do with its connection (``direct_exchange.Connection``) ---------------------------
    @property
    def client_gone(self) -> set[Callable[[], None]]:
        return self._client_gone

    def reset(self) -> None:
        """Close with a reset (SO_LINGER 0): a plain close leaves the unsent answer with the kernel, which keeps
        the connection half-open for as long as the client keeps its window shut. (Only ever for a client that
        stopped reading an answer.)"""
        if not self.transport.is_closing():
            logger.warning("reset the connection of %s: it stopped reading its answer", _peer(self.client))
            self.count_cut("send_stalled")
        sock = self.transport.get_extra_info("socket")
        if sock is not None:
            with contextlib.suppress(OSError):
                sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
        self.transport.abort()

    def close_unread(self) -> None:
        """Close a connection whose client may still be sending a body no one will read. A plain close with
        unread bytes in the socket resets the connection, and the client may lose the answer it was sent: so our
        side is shut first (the client reads the answer, then its end), and what still comes is read and dropped
        until the client closes or pauses for ``LINGER_PAUSE_S``, or for ``LINGER_S`` at most."""
        transport = self.transport
        if transport.is_closing() or self._dropping:
            return
        self._dropping = True
        self.declared_body = None
        self._stop_header_timer()
        self._stop_body_timer()
        if not transport.can_write_eof():  # (TLS): no half-close to offer
            transport.close()
            return
        transport.write_eof()
        now = self.loop.time()
        self._linger_until, self._dropped_at = now + LINGER_S, now
        self._linger = self.loop.call_at(now + LINGER_PAUSE_S, self._linger_due)

    def _linger_due(self) -> None:
        """Close a lingering connection once the client paused ``LINGER_PAUSE_S``, or at ``LINGER_S``."""
        due = min(self._linger_until, self._dropped_at + LINGER_PAUSE_S)
        if self.loop.time() < due - TIMER_SLACK_S:
            self._linger = self.loop.call_at(due, self._linger_due)
            return
        self._linger = None
        self.transport.close()

    # -- refusals and timers ------------------------------------------------------------------------------------
    def _refuse(self, error: ServingError, reason: str) -> None:
        """Answer ``error`` to a request the protocol will not parse further, and close."""
        self.count_cut(reason)
        logger.warning("refused a request from %s (%s): %s", _peer(self.client), error.status_code, error.message)
        self._end_with(error, None)

    def _end_with(self, error: ServingError, request_id: str | None) -> None:
        """Answer ``error`` in place of the request in progress, unless its answer has started; tell its handler,
        as for a client that left; close."""
        cycle = self.cycle
        if self.pipeline:
            # ``cycle`` waits behind an earlier request whose answer is in progress: an answer now would be read
            # as that one's. Nothing can be answered in order: the connection is dropped.
            self.transport.abort()
            return
        if cycle is None or cycle.response_complete or not cycle.response_started:
            self.transport.write(self._error_answer(error, request_id))
        if cycle is not None and not cycle.response_complete:
            cycle.response_started = cycle.response_complete = True
            cycle.disconnected = True  # the handler waiting on the body stops
            cycle.message_event.set()
        self.close_unread()

    def _error_answer(self, error: ServingError, request_id: str | None) -> bytes:
        body = error_body(error)
        lines = [STATUS_LINE[error.status_code]]
        lines.append(default_header_lines(self.server_state.default_headers))
        lines.append(b"content-type: application/json\r\ncontent-length: %d\r\nconnection: close\r\n" % len(body))
        if request_id is not None:
            lines.append(b"x-request-id: %b\r\n" % request_id.encode())
        lines += (b"\r\n", body)
        return b"".join(lines)

    def _start_body_clock(self, cycle: RequestResponseCycle) -> None:
        """The body must be in within ``body_timeout_s`` of now, and as long again for each MiB it declares past
        the first (at least 32 KiB/s, so that a long upload that keeps coming is not cut off)."""
        declared = 0
        for name, value in cycle.scope["headers"]:
            if name == b"content-length":
                declared = int(value) if value.isdigit() else 0
                break
        timeout_s = self.limits.body_timeout_s * max(1.0, declared / (1024 * 1024))
        self._body_due = self.loop.time() + timeout_s
        if self._body_timer is None:
            self._body_timer = self.loop.call_at(self._body_due, self._body_timer_fired)

    def _body_timer_fired(self) -> None:
        self._body_timer = None
        due = self._body_due
        if due is None:
            return  # the body came: armed again for the next one that does not come with its head
        if self.loop.time() < due - TIMER_SLACK_S:
            self._body_timer = self.loop.call_at(due, self._body_timer_fired)
            return
        self._body_due = None
        self._body_too_slow()

    def _body_too_slow(self) -> None:
        """The request's body is not in by its clock's due time. The client gets a 408 (if nothing was answered
        yet), the handler is told as of a client that left, and the connection closes."""
        cycle = self.cycle
        if cycle is None or not cycle.more_body or self.transport.is_closing():
            return
        request_id = request_id_of(list(cycle.scope["headers"]))
        logger.warning("request %s on %s %s from %s: its body did not arrive in time; connection closed",
                       request_id, cycle.scope["method"], cycle.scope["path"], _peer(self.client))
        self.count_cut("body_timeout")
        self._end_with(RequestTimeoutError("the request's body did not arrive in time"), request_id)

    def _stop_body_timer(self) -> None:
        self._body_due = None
        if self._body_timer is not None:
            self._body_timer.cancel()
            self._body_timer = None

    def _start_header_timer(self) -> None:
        self._stop_header_timer()
        self._header_timer = self.loop.call_later(self.limits.header_timeout_s, self._headers_too_slow)

    def _stop_header_timer(self) -> None:
        if self._header_timer is not None:
            self._header_timer.cancel()
            self._header_timer = None

    def _headers_too_slow(self) -> None:
        self._header_timer = None
        if not self.transport.is_closing():
            logger.warning("closed a connection from %s: no complete request headers within %s s",
                           _peer(self.client), self.limits.header_timeout_s)
            self.count_cut("head_timeout")
            self.transport.close()


class _GuardedCycle(RequestResponseCycle):
    """uvicorn's cycle for a request served through ASGI, with ``send`` made to keep two rules: an answer that
    starts before the request's body is in closes the connection after it (``close_unread``), and an answer to an
    HTTP/1.0 client of no declared length is its body up to the connection's end, not chunks."""

    connection: _GuardedProtocol
    unframed = False  # an HTTP/1.0 answer of no declared length: sent as it is, the connection's end its end

    async def send(self, message: Any) -> None:
        if not self.response_started and message["type"] == "http.response.start":
            if self.more_body:
                self.keep_alive = False  # uvicorn writes ``connection: close``, then closes: through close_unread
                self.transport = _ClosingUnread(self.transport, self.connection)  # type: ignore[assignment]
            if self.scope["http_version"] == "1.0" and not any(
                    name.lower() in _FRAMING for name, _ in message.get("headers", ())):
                self.chunked_encoding = False
                self.unframed = True
        elif self.unframed and message["type"] == "http.response.body":
            self.expected_content_length = len(message.get("body", b""))  # what uvicorn counts down to 0
        await super().send(message)


_FRAMING = (b"content-length", b"transfer-encoding")


class _ClosingUnread:
    """A cycle's transport whose ``close`` is the protocol's ``close_unread``."""

    __slots__ = ("_connection", "_transport")

    def __init__(self, transport: asyncio.Transport, connection: _GuardedProtocol) -> None:
        self._transport = transport
        self._connection = connection

    def close(self) -> None:
        self._connection.close_unread()

    def __getattr__(self, name: str) -> Any:
        return getattr(self._transport, name)


def _peer(client: tuple[str, int] | None) -> str:
    return f"{client[0]}:{client[1]}" if client else "a client"

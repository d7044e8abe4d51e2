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

The clocks, and the ways a connection is ended, are the protocol's base class (``entrypoints/client_limits.py``);
the rules of an answer sent through ASGI are its cycle's (``entrypoints/guarded_cycle.py``).

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
from collections.abc import Callable
from typing import Any

import httptools
import uvicorn
from uvicorn.protocols.http.flow_control import HIGH_WATER_LIMIT
from uvicorn.protocols.http.httptools_impl import RequestResponseCycle

from entrypoints.client_limits import ClientCutoffs, ClientLimits
from entrypoints.direct_exchange import CycleExchange
from entrypoints.guarded_cycle import GuardedCycle
from frontend.asgi_fast_path import CLIENT_GONE, FastPathApp
from frontend.client_timeouts import ABORT_CONNECTION
from frontend.errors import HeadTooLargeError, InvalidRequestError, ServingError
from frontend.read_buffers import DeclaredBody, DeclaredBodyReads

# The uvicorn releases whose protocol and cycle internals this module (and ``direct_exchange``) mirror: each was
# read, and the suite passed on it. Another release may have renamed a field or stopped calling a hook, which would
# not fail loudly: the server would serve with a limit silently off.
MIRRORED_UVICORN = ("0.54.0",)

# A request body of a declared length up to this is read whole before the app is woken (below).
WHOLE_BODY_UP_TO = 16 * 1024 * 1024


def check_uvicorn_version(version: str = uvicorn.__version__) -> None:
    """Refuse, by name, a uvicorn release this module was not written for."""
    if version not in MIRRORED_UVICORN:
        raise RuntimeError(
            f"disagg-serve's HTTP layer is written for uvicorn {' or '.join(MIRRORED_UVICORN)}, and uvicorn "
            f"{version} is installed: its private protocol internals may differ, which would leave limits on "
            f"hostile clients silently off. Install the release it was written for: "
            f"pip install 'uvicorn[standard]=={MIRRORED_UVICORN[-1]}'")


def guarded_protocol(limits: ClientLimits = ClientLimits(), app: Any = None,  # noqa: B008 (frozen: shared safely)
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


class _GuardedProtocol(ClientCutoffs, DeclaredBodyReads):
    direct_app: FastPathApp | None = None

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
        cycle.__class__ = GuardedCycle  # its send, for early answers and HTTP/1.0 (no field to initialise)
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

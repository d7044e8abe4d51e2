"""The front ends' HTTP/1.1 server protocol: httptools' parser (llhttp) under the package's own connection and
request handling, so that every limit a client is held to (docs/http.md) is this package's code. A request body of
declared length (64 KiB to ``WHOLE_BODY_UP_TO``) is read past the parser straight into the ``bytes`` the app gets,
and handed over whole. The clocks and what bodies being read hold are the connection's ``ClientClocks``
(``limits.py``); how a connection ends when one runs out is here; the rules of an answer are its ``RequestCycle``'s
(``cycle.py``); a POST to a ``FastPathApp``'s fast route is served on its cycle directly (``exchange.py``).
"""

from __future__ import annotations

import asyncio
import contextlib
import contextvars
import logging
import socket
import struct
import urllib.parse
from collections import deque
from collections.abc import Callable
from typing import Any

import httptools

from entrypoints.http.cycle import HIGH_WATER_LIMIT, FlowControl, RequestCycle, head
from entrypoints.http.exchange import CycleExchange
from entrypoints.http.limits import ClientClocks, ClientLimits
from frontend.asgi_fast_path import CLIENT_GONE, FastPathApp
from frontend.errors import (
    HeadTooLargeError,
    InvalidRequestError,
    OverloadedError,
    RequestTimeoutError,
    ServingError,
    error_body,
)
from frontend.http import DEFAULT_MAX_BODY_BYTES_READING, BodyBudget, BodyReads, request_id_of
from frontend.read_buffers import DeclaredBody, DeclaredBodyReads
from frontend.send_timeout import ABORT_CONNECTION, TIMER_SLACK_S

# The HTTP server's logger: what an operator's filters name.
logger = logging.getLogger("disagg_serve.http")

# A request body of a declared length up to this is read whole before the app is woken (below).
WHOLE_BODY_UP_TO = 16 * 1024 * 1024

# How long a connection closed before its request's body was read keeps reading (and dropping) what the client
# still sends, so that its close does not reset the connection before the client has read the answer.
LINGER_S = 5.0
# ... and only while the client keeps sending: a pause this long means it has nothing more (or has read the answer
# and stopped), so the close loses nothing.
LINGER_PAUSE_S = 0.5


_ASGI = {"version": "3.0", "spec_version": "2.3"}


def guarded_protocol(limits: ClientLimits = ClientLimits(), app: Any = None,  # noqa: B008 (frozen: shared safely)
                     count_cut: Callable[[str], None] | None = None) -> type[GuardedProtocol]:
    """A protocol class for uvicorn's ``http=`` (a factory called with the server's ``config``, ``server_state``
    and ``app_state``), holding clients to ``limits``. ``app``: the app served: a ``FastPathApp``'s fast routes the
    protocol then serves itself (``entrypoints/http/exchange.py``), and an app's ``state.body_budget`` (a
    ``BodyBudget``, from its configuration) is what its bodies being read may hold; ``count_cut``: called with the
    reason (``frontend.metrics.CONNECTION_CUT_REASONS``) of each connection cut on a limit."""

    class Protocol(GuardedProtocol):
        pass

    Protocol.limits = limits
    budget = getattr(getattr(app, "state", None), "body_budget", None)
    Protocol.bodies = budget if isinstance(budget, BodyBudget) else BodyBudget(DEFAULT_MAX_BODY_BYTES_READING)
    Protocol.readers = BodyReads(limits.max_body_reads_per_client)  # this server's own
    Protocol.direct_app = app if isinstance(app, FastPathApp) else None
    if count_cut is not None:
        Protocol.count_cut = staticmethod(count_cut)  # type: ignore[method-assign, assignment]
    return Protocol


class _Refused(Exception):
    """Raised from a parser callback to stop parsing a request the protocol refuses (``_refusal`` says why)."""


class _BodyOnly:
    """The parser callbacks for the body of a request that offered an upgrade (``GuardedProtocol._ignore_upgrade``):
    its body is the protocol's; at its end, nothing after it is parsed."""

    def __init__(self, protocol: GuardedProtocol) -> None:
        self._protocol = protocol
        self.on_body = protocol.on_body

    def on_message_complete(self) -> None:
        self._protocol.on_message_complete()
        self._protocol._upgrade_ignored = True
        raise _Refused()  # stops the parse here (``data_received`` drops the rest)


class GuardedProtocol(DeclaredBodyReads, asyncio.BufferedProtocol):
    """One connection: its parser, its requests in order, its clocks (``clocks``), and how it ends."""

    limits = ClientLimits()
    # The server's, shared by its connections (``guarded_protocol`` gives each server its own): bytes of bodies
    # received and not yet whole, and bodies being read per client address.
    bodies = BodyBudget(DEFAULT_MAX_BODY_BYTES_READING)
    readers = BodyReads(limits.max_body_reads_per_client)
    direct_app: FastPathApp | None = None

    @staticmethod
    def count_cut(reason: str) -> None:
        """Counts a connection cut on a limit (``guarded_protocol`` gives the server's metric)."""

    def __init__(self, config: Any, server_state: Any, app_state: dict[str, Any],
                 _loop: asyncio.AbstractEventLoop | None = None) -> None:
        if not config.loaded:
            config.load()
        self.config = config
        self.app = config.loaded_app
        self.loop = _loop or asyncio.get_running_loop()
        self.server_state = server_state
        self.connections: set[Any] = server_state.connections  # what a graceful shutdown waits for, with:
        self.tasks: set[asyncio.Task[None]] = server_state.tasks
        self.app_state = app_state
        self.root_path: str = config.root_path
        self.clocks = ClientClocks(self, self.loop, self.limits, self.bodies, self.readers, config.timeout_keep_alive)
        self._fresh_context = bool(getattr(config, "reset_contextvars", False))
        self.parser = self._new_parser()
        self.transport: asyncio.Transport = None  # type: ignore[assignment]  # from connection_made on
        self.flow: FlowControl = None  # type: ignore[assignment]
        self.server: tuple[str, int] | None = None
        self.client: tuple[str, int] | None = None
        self.scheme = "http"
        self.pipeline: deque[tuple[RequestCycle, Any]] = deque()  # requests parsed while one is answered
        self.cycle: RequestCycle | None = None  # the newest request's
        self._answering: RequestCycle | None = None  # the request being answered (the newest, unless pipelined)
        # The request whose head is being parsed.
        self.url = b""
        self.headers: list[tuple[bytes, bytes]] = []
        self.expect_100_continue = False
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
        self._upgrade_ignored = False  # the parser stopped at an upgrade: nothing after it is parsed
        self._upgrade_body: bytes | None = None  # the framing of the body of a request that offers an upgrade
        self.start_reads()  # a body read whole is ``declared_body`` (else read piece by piece)

    # -- the connection -----------------------------------------------------------------------------------------
    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        self.connections.add(self)
        self.transport = transport
        self.flow = FlowControl(transport)
        self.server = _address(transport.get_extra_info("sockname"))
        self.client = _address(transport.get_extra_info("peername"))
        self.scheme = "https" if transport.get_extra_info("sslcontext") is not None else "http"
        self.clocks.start_head()

    def eof_received(self) -> bool | None:
        return None  # the transport closes itself: a half-closed client gets its answer cut (as uvicorn's)

    def connection_lost(self, exc: Exception | None) -> None:
        self.connections.discard(self)
        self.clocks.stop()
        if self._linger is not None:
            self._linger.cancel()
        self.declared_body = None  # what it held of a body is no one's now
        # Every request still on the connection is told: the one being answered (its handler may wait for
        # ``http.disconnect`` to stop its work) as well as the newest and those queued behind it.
        for cycle in {self.cycle, self._answering, *(queued for queued, _ in self.pipeline)}:
            if cycle is not None:
                if not cycle.response_complete:
                    cycle.disconnected = True
                cycle.message_event.set()
        if self.flow is not None:
            self.flow.resume_writing()  # a send waiting for the client returns, and finds it gone
        callbacks = list(self._client_gone)
        self._client_gone.clear()
        for callback in callbacks:
            callback()

    def pause_writing(self) -> None:
        self.flow.pause_writing()

    def resume_writing(self) -> None:
        self.flow.resume_writing()

    def shutdown(self) -> None:
        """The server stops: an idle connection closes now, a busy one after the answer in progress."""
        if self.cycle is None or self.cycle.response_complete:
            self.transport.close()
        else:
            self.cycle.keep_alive = False

    def idle_too_long(self) -> None:
        """(``Cutoffs``) The keep-alive time ran out: closed."""
        if not self.transport.is_closing():
            self.transport.close()

    # -- reads (``DeclaredBodyReads``) --------------------------------------------------------------------------
    def awaiting_head(self) -> bool:
        return self.cycle is None or not self.cycle.more_body

    def declared_body_read(self) -> None:
        self.parser = self._new_parser()  # the old one still waits for the bytes that went past it
        self.on_message_complete()

    def _new_parser(self) -> httptools.HttpRequestParser:
        parser = httptools.HttpRequestParser(self)
        # Lenient on one point only: the first of pipelined requests whose first says ``Connection: close`` is
        # still parsed and answered (the connection then closes after it).
        with contextlib.suppress(AttributeError):  # httptools < 0.6.3
            parser.set_dangerous_leniencies(lenient_data_after_close=True)
        return parser

    # -- the request --------------------------------------------------------------------------------------------
    def data_received(self, data: bytes) -> None:
        """Feed the parser, with the head's clock and size checked after each read, the body's clock started, and
        refusals answered in OpenAI's error shape."""
        if self._dropping or self._upgrade_ignored:
            self._dropped_at = self.loop.time()
            return
        # Between requests on a keep-alive connection the idle timer runs; the next request's first byte starts
        # its header clock, unless the same read brought its whole head: nearly always, and then a timer would
        # only be made and cancelled.
        awaiting_head = not self.clocks.head_timed and self.cycle is not None and self.cycle.response_complete
        heads = self._heads
        was_in_head = self._in_head
        self.clocks.busy()
        self._body_moved = False
        try:
            self.parser.feed_data(data)
        except httptools.HttpParserUpgrade as upgrade:
            self._ignore_upgrade(data, upgrade.args[0])
            return
        except httptools.HttpParserError as exc:
            if self._upgrade_ignored:
                return  # the body of a request that offered an upgrade is in: nothing after it is parsed
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
                self.clocks.start_head()
        else:
            self._head_bytes = 0  # (a next head begun in the same read counts from the next read)
        cycle = self.cycle
        if cycle is None or not cycle.more_body or self._in_head or self.transport.is_closing():
            return
        # A body still to come after this read (a short one came with its head: no clock started). Only for the
        # request being served: a pipelined one's body is not read (reading is paused) until its turn.
        if not self.clocks.body_timed and not self.pipeline and not self._start_body_clock(cycle):
            return  # refused: the address has as many bodies being read as it may
        # Bytes that moved no body (chunk framing, a trailer: httptools grows a trailer as it grows a header)
        # count against the head limit, so that a chunked body cannot carry what a head may not.
        self._stalled_bytes = 0 if self._body_moved else self._stalled_bytes + len(data)
        if self._stalled_bytes > self.limits.max_head_bytes:
            self._refuse(HeadTooLargeError(f"the request's chunk framing or trailers are over "
                                           f"{self.limits.max_head_bytes} bytes"), "head_too_large")

    def _ignore_upgrade(self, data: bytes, offset: int) -> None:
        """The parser stopped at a request asking for another protocol (at ``offset`` in ``data``): llhttp takes
        what follows its head for the new protocol's. No upgrade is offered: the request is answered over HTTP/1.1,
        its body read as HTTP/1.1 frames it (RFC 9110 7.8: the offer is ignored; ``curl --http2`` sends one with
        every POST on http://), and the connection closes after it."""
        self.clocks.stop_head()
        cycle = self.cycle
        if cycle is not None:
            cycle.keep_alive = False
        framing, self._upgrade_body = self._upgrade_body, None
        if framing is None or cycle is None or cycle.response_complete:
            self._upgrade_ignored = True  # nothing after it is parsed
            self.clocks.stop_body()
            return
        # The body goes through a parser of its own, told the framing by a head of its own (its callbacks take the
        # body only), and every check of a body read piece by piece applies.
        self.parser = httptools.HttpRequestParser(_BodyOnly(self))
        self.parser.feed_data(b"POST / HTTP/1.1\r\n%b\r\n\r\n" % framing)
        self.data_received(data[offset:])

    def on_message_begin(self) -> None:
        self._in_head = True
        self.url = b""
        self.headers = []
        self.expect_100_continue = False

    def on_url(self, url: bytes) -> None:
        self.url += url

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
        self.clocks.stop_head()
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
        parser = self.parser
        version = parser.get_http_version()
        if hosts > 1 or (hosts == 0 and version != "1.0"):
            self._refusal = (InvalidRequestError("an HTTP/1.1 request needs exactly one Host header (RFC 9112 3.2)",
                                                 param="host"), "bad_request")
            raise _Refused()
        if version == "1.0":
            self.expect_100_continue = False  # no 1xx for an HTTP/1.0 client (RFC 9110 15.2)
        scope = self._scope(parser.get_method(), version)
        cycle = RequestCycle(scope, self.transport, self.flow, self.server_state.default_headers,
                             version != "1.0" and parser.should_keep_alive(), self.expect_100_continue,
                             self.on_response_complete, self.close_unread)
        earlier, self.cycle = self.cycle, cycle
        if earlier is None or earlier.response_complete:
            self._start_asgi_task(cycle, self.app)
        else:  # answered in order: this one waits for the answer in progress, and reading pauses meanwhile
            self.flow.pause_reading()
            self.pipeline.appendleft((cycle, self.app))
        if parser.should_upgrade():
            # (Its body, if any, is read once llhttp stops at the upgrade: ``_ignore_upgrade``.)
            if chunked:
                self._upgrade_body = b"transfer-encoding: chunked"
            elif declared.isdigit() and int(declared):
                self._upgrade_body = b"content-length: %d" % int(declared)
        elif not chunked and declared.isdigit() and HIGH_WATER_LIMIT < int(declared) <= WHOLE_BODY_UP_TO:
            self.declared_body = DeclaredBody(int(declared))

    def _scope(self, method: bytes, version: str) -> dict[str, Any]:
        """The ASGI scope of the request whose head was just parsed."""
        try:
            target = httptools.parse_url(self.url)
            raw_path: bytes = target.path
            path = raw_path.decode("ascii")
        except (httptools.HttpParserInvalidURLError, UnicodeDecodeError):
            self._refusal = (InvalidRequestError("the request's target is not a valid path"), "bad_request")
            raise _Refused() from None
        if "%" in path:
            path = urllib.parse.unquote(path)
        root = self.root_path
        return {"type": "http", "asgi": _ASGI, "http_version": version, "server": self.server,
                "client": self.client, "scheme": self.scheme, "method": method.decode("ascii"), "root_path": root,
                "path": root + path, "raw_path": root.encode("ascii") + raw_path if root else raw_path,
                "query_string": target.query or b"", "headers": self.headers, "state": self.app_state.copy()}

    def _start_asgi_task(self, cycle: RequestCycle, app: Any) -> None:
        """A POST to one of ``direct_app``'s fast routes is served on its cycle directly; anything else through
        ASGI."""
        self._answering = cycle
        direct = self.direct_app
        if direct is not None and cycle.scope["method"] == "POST" and not self._fresh_context:
            handler = direct.fast_routes.get(cycle.scope["path"])
            if handler is not None:
                exchange = CycleExchange(cycle, self, direct.send_timeout_s)
                self._keep(self.loop.create_task(exchange.run(handler)))
                return
        # For an app served through ASGI: how frontend/send_timeout.py drops a stalled client at once (close()
        # would first wait for the client to read what is still buffered, which it will not), and how the fast
        # path's exchange learns that the client left. (A direct exchange is given both itself.)
        cycle.scope["extensions"] = {ABORT_CONNECTION: {"abort": self.reset},
                                     CLIENT_GONE: {"callbacks": self._client_gone}}
        # ``reset_contextvars``: uvicorn's opt-in against context variables leaking from the lifespan into requests.
        context = contextvars.Context() if self._fresh_context else None
        self._keep(self.loop.create_task(cycle.run_asgi(app), context=context))

    def _keep(self, task: asyncio.Task[None]) -> None:
        """A request's task, counted among the server's until it is done (its graceful shutdown waits for them)."""
        task.add_done_callback(self.tasks.discard)
        self.tasks.add(task)

    def on_body(self, body: bytes) -> None:
        """A body of declared length is read whole, then handed over as one piece; any other, piece by piece.

        Piece by piece, each piece wakes the handler, and past ``HIGH_WATER_LIMIT`` unread the socket pauses until
        the handler takes them: for a 524 KB prompt that was ten pause/resume rounds, as many wake-ups of the
        request's task and three copies of the body. Read whole, it is one wake-up and no copy but of what came in
        the read of its head (through the parser, here): the rest is read into the body's own ``bytes``
        (``get_buffer``). The app reads every body whole anyway (``frontend/asgi_fast_path.py``), and what it may
        hold is capped twice: a declared length above ``max_body_bytes`` is refused before a byte is read, and
        this applies only up to ``WHOLE_BODY_UP_TO``."""
        self._body_moved = True
        self.clocks.body_received(len(body))
        whole = self.declared_body
        if whole is not None:
            whole.take(body)
            return
        cycle = self.cycle
        if cycle is None or cycle.response_complete:
            return  # answered already (a refusal before its body): the rest is no one's
        cycle.body += body
        if len(cycle.body) > HIGH_WATER_LIMIT:
            self.flow.pause_reading()
        cycle.message_event.set()

    def on_message_complete(self) -> None:
        if self._upgrade_body is not None:
            return  # llhttp's end of a request that offers an upgrade, before its body: not the end
        self.clocks.body_done()  # (an armed body timer finds it so, and stops)
        whole, self.declared_body = self.declared_body, None
        cycle = self.cycle
        if cycle is None or cycle.response_complete:
            return
        if whole is not None:
            cycle.body = whole.whole()
        cycle.more_body = False
        cycle.message_event.set()

    # -- the request's body and the connection's next request --------------------------------------------------
    def _start_body_clock(self, cycle: RequestCycle) -> bool:
        """``cycle``'s body is waited for from now: counted against its address's cap (refused with 429 past it;
        returns False), and timed."""
        host = self.client[0] if self.client else ""
        if self.clocks.start_body(host):
            return True
        readers = self.readers
        reading = readers.reading[host]
        self._refuse_body(cycle, OverloadedError(
            f"{reading} request bodies from {host} are being read already, at the limit of {readers.limit}"),
            "body_overload", f"its address already has {reading} request bodies being read, the limit")
        return False

    def on_response_complete(self) -> None:
        """The answer in progress is complete: the next pipelined request starts, or the connection is idle."""
        self.server_state.total_requests += 1
        if self.transport.is_closing() or self._dropping:
            return
        self.flow.resume_reading()
        if self.pipeline:
            cycle, app = self.pipeline.pop()
            if cycle.more_body and not self.clocks.body_timed and not self._start_body_clock(cycle):
                return  # its body is read from now on, unless refused
            self._start_asgi_task(cycle, app)
            return
        self.clocks.idle()

    # -- a clock ran out (``limits.Cutoffs``) ---------------------------------------------------------------------
    def head_too_slow(self) -> None:
        if not self.transport.is_closing():
            logger.warning("closed a connection from %s: no complete request headers within %s s",
                           _peer(self.client), self.limits.header_timeout_s)
            self.count_cut("head_timeout")
            self.transport.close()

    def body_too_slow(self, cause: str) -> None:
        """The client gets a 408 (if nothing was answered yet), the handler is told as of a client that left, and
        the connection closes."""
        cycle = self.cycle
        if cycle is None or not cycle.more_body or self.transport.is_closing():
            return
        self._refuse_body(cycle, RequestTimeoutError("the request's body did not arrive in time"), "body_timeout",
                          f"its body did not arrive in time ({cause})")

    def body_over_budget(self) -> None:
        cycle = self.cycle
        if cycle is None or not cycle.more_body or self.transport.is_closing() or self._dropping:
            return
        self._refuse_body(cycle, self.bodies.refusal(), "body_overload",
                          f"the server holds {self.bodies.reading} bytes of bodies being read, its limit")

    # -- how a connection ends (``reset``, ``close_unread``: what an exchange may do, ``exchange.Connection``) ---
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
        self.flow.resume_reading()  # (paused for a body read piece by piece: what is left of it must be drained)
        self.declared_body = None
        self.clocks.stop_head()
        self.clocks.stop_body()
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

    def _refuse(self, error: ServingError, reason: str) -> None:
        """Answer ``error`` to a request the protocol will not parse further, and close."""
        self.count_cut(reason)
        logger.warning("refused a request from %s (%s): %s", _peer(self.client), error.status_code, error.message)
        self._end_with(error, None)

    def _refuse_body(self, cycle: RequestCycle, error: ServingError, reason: str, cause: str) -> None:
        """Answer ``error`` to ``cycle``, whose body is being read, and close; logged with its request id."""
        request_id = request_id_of(list(cycle.scope["headers"]))
        logger.warning("request %s on %s %s from %s: %s; answered %d and closed", request_id,
                       cycle.scope["method"], cycle.scope["path"], _peer(self.client), cause, error.status_code)
        self.count_cut(reason)
        self._end_with(error, request_id)

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
            cycle.waiting_for_100_continue = False  # our side is shut: nothing more goes to the client
            cycle.disconnected = True  # the handler waiting on the body stops
            cycle.message_event.set()
        self.close_unread()

    def _error_answer(self, error: ServingError, request_id: str | None) -> bytes:
        body = error_body(error)
        lines = [b"content-type: application/json\r\ncontent-length: %d\r\nconnection: close\r\n" % len(body)]
        for name, value in error.headers.items():  # (a 429's Retry-After)
            lines.append(b"%b: %b\r\n" % (name.lower().encode("latin-1"), value.encode("latin-1")))
        if request_id is not None:
            lines.append(b"x-request-id: %b\r\n" % request_id.encode())
        return head(error.status_code, self.server_state.default_headers, lines) + body

    # -- what an exchange may do with its connection (``exchange.Connection``) -----------------------------------
    @property
    def client_gone(self) -> set[Callable[[], None]]:
        return self._client_gone


def _peer(client: tuple[str, int] | None) -> str:
    return f"{client[0]}:{client[1]}" if client else "a client"


def _address(address: Any) -> tuple[str, int] | None:
    """A socket's (host, port), as ASGI's scope gives it; None for what has none (a Unix socket)."""
    if isinstance(address, tuple) and len(address) >= 2:
        return str(address[0]), int(address[1])
    return None

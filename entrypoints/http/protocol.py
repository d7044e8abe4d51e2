"""The front ends' HTTP/1.1 server protocol: httptools' parser (llhttp) under the project's own connection and
request handling, guarded against hostile clients, with a request body of declared length read straight into its
own buffer and handed to the app whole.

uvicorn's ``Server`` runs it as its ``http=`` protocol class (``entrypoints/cli.py``): the server listens, runs the
app's lifespan, renews the ``Date`` header and shuts down gracefully; everything on a connection is this module's
and ``entrypoints/http/cycle.py``'s, so that no limit below rests on another project's private code
(DESIGN.md, HTTP). What it takes of uvicorn is the protocol factory's contract: the ``config`` (its app,
``root_path``, ``timeout_keep_alive``; not ``limit_concurrency``: admission is the orchestrator's), the
``server_state`` (the connections and tasks a graceful shutdown waits for, the default headers) and the lifespan's
``app_state``; and ``shutdown()``, which it calls on each connection when it stops.

What a client may not do, each cut-off logged and counted (``disagg_http_connections_cut{reason}``):

- a request's head must be complete within ``header_timeout_s`` of the connection opening or of its first byte (a
  slowloris client would hold the connection for ever), and be at most ``max_head_bytes`` long (httptools grows a
  header value without limit, at a cost that grows with its square: one 48 MiB header cost 27 s of CPU): a 431 and
  a close, refused before more than one read past the limit is parsed;
- a request's body may go no longer than ``body_timeout_s`` without a byte, and past that must average
  ``body_min_rate`` (a head and one byte of its body held a connection, and in the orchestrator an admission slot,
  for ever): a 408 and a close. What it declares earns it no time and costs the server nothing: its bytes count
  against the server's budget of bodies being read (a 429 past it) as they arrive, and bodies being read are
  capped per client address (``entrypoints/http/limits.py``); chunk framing and trailers that bring no body
  bytes count against the head limit;
- an HTTP/1.1 request has exactly one ``Host``, an HTTP/1.0 one at most one (RFC 9112 3.2), else a 400; malformed
  requests get an OpenAI-shaped 400;
- an answer sent before its request's body arrived (a 401, 413 or 429) says ``connection: close``, and the
  connection is closed once the client has seen it (our side shut, what the client still sends read and dropped
  for a few seconds): reading on would take the client's next request for the rest of the body, and a plain close
  with unread bytes resets the connection, answer and all;
- an HTTP/1.0 client gets no ``100 Continue`` and no chunked encoding (its answer's end is the connection's);
- trailers of a chunked request body never join the request's headers;
- a protocol upgrade (WebSocket, h2c) is not offered: the request is answered over HTTP/1.1, as RFC 9110 7.8
  allows, its body read as HTTP/1.1 frames it (llhttp stops before it), and the connection closes after it
  (nothing after the request is parsed);
- no answer carries a ``server`` header (``entrypoints/http/cycle.py``).

The clocks, and the ways a connection is ended, are the protocol's base class (``entrypoints/http/limits.py``);
the rules of an answer are its cycle's (``entrypoints/http/cycle.py``).

Given the ``FastPathApp`` it serves, the protocol starts a POST to a fast route on its cycle itself
(``entrypoints/http/exchange.py``); a request served through ASGI gets in its scope the ``ABORT_CONNECTION``
extension that ``frontend/client_timeouts.py`` uses, and the ``CLIENT_GONE`` one through which
``frontend/asgi_fast_path.py`` learns that the client left without a task waiting on ``receive``. The keep-alive
timer is one per connection, not one per request. Pipelined requests are answered in order, one at a time.

The socket is read as a ``BufferedProtocol``, into buffers ``frontend/read_buffers.py`` gives: between requests a
small one shared by the thread's connections, copied out as the ``bytes`` the parser is fed; once the headers of
a body of declared length (64 KiB to ``WHOLE_BODY_UP_TO``) are parsed, the rest of the body straight into the
``bytes`` the app gets, never through the parser.
"""

from __future__ import annotations

import asyncio
import contextlib
import contextvars
import urllib.parse
from collections import deque
from collections.abc import Callable
from typing import Any

import httptools

from entrypoints.http.cycle import HIGH_WATER_LIMIT, FlowControl, RequestCycle
from entrypoints.http.exchange import CycleExchange
from entrypoints.http.limits import ClientCutoffs, ClientLimits
from frontend.asgi_fast_path import CLIENT_GONE, FastPathApp
from frontend.client_timeouts import ABORT_CONNECTION
from frontend.errors import HeadTooLargeError, InvalidRequestError, ServingError
from frontend.http import DEFAULT_MAX_BODY_BYTES_READING, BodyBudget, BodyReads
from frontend.read_buffers import DeclaredBody, DeclaredBodyReads

# A request body of a declared length up to this is read whole before the app is woken (below).
WHOLE_BODY_UP_TO = 16 * 1024 * 1024

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


class GuardedProtocol(ClientCutoffs, DeclaredBodyReads, asyncio.BufferedProtocol):
    direct_app: FastPathApp | None = None

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
        self.timeout_keep_alive: float = config.timeout_keep_alive
        self.timeout_keep_alive_task: asyncio.TimerHandle | None = None
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
        self._header_timer: asyncio.TimerHandle | None = None
        # One body timer per connection, moved on when it fires (as the keep-alive timer): a client that sends a
        # head and its body in two writes (httpx, the openai SDK) would otherwise make and cancel one per request.
        self._body_timer: asyncio.TimerHandle | None = None
        self._body_started: float | None = None  # loop time the body being read was first waited for
        self._body_last = 0.0  # loop time its last bytes came
        self._body_bytes = 0  # its bytes received: charged to the server's ``bodies`` until it is whole
        self._reader_of: str | None = None  # the client address it counts against
        self._over_budget = False
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
        self._idle_since: float | None = None  # loop time of the last answer, while no bytes came after it
        self.start_reads()  # a body read whole is ``declared_body`` (else read piece by piece)

    # -- the connection -----------------------------------------------------------------------------------------
    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        self.connections.add(self)
        self.transport = transport
        self.flow = FlowControl(transport)
        self.server = _address(transport.get_extra_info("sockname"))
        self.client = _address(transport.get_extra_info("peername"))
        self.scheme = "https" if transport.get_extra_info("sslcontext") is not None else "http"
        self._start_header_timer()

    def eof_received(self) -> bool | None:
        return None  # the transport closes itself: a half-closed client gets its answer cut (as uvicorn's)

    def connection_lost(self, exc: Exception | None) -> None:
        self.connections.discard(self)
        self._stop_header_timer()
        self._stop_body_timer()
        if self._linger is not None:
            self._linger.cancel()
        if self.timeout_keep_alive_task is not None:
            self.timeout_keep_alive_task.cancel()
            self.timeout_keep_alive_task = None
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

    def timeout_keep_alive_handler(self) -> None:
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
        awaiting_head = self._header_timer is None and self.cycle is not None and self.cycle.response_complete
        heads = self._heads
        was_in_head = self._in_head
        self._idle_since = None  # bytes came: busy (an armed keep-alive timer finds it so, and stops)
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
                self._start_header_timer()
        else:
            self._head_bytes = 0  # (a next head begun in the same read counts from the next read)
        cycle = self.cycle
        if cycle is None or not cycle.more_body or self._in_head or self.transport.is_closing():
            return
        # A body still to come after this read (a short one came with its head: no clock started). Only for the
        # request being served: a pipelined one's body is not read (reading is paused) until its turn.
        if self._body_started is None and not self.pipeline and not self._start_body_clock(cycle):
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
        self._stop_header_timer()
        cycle = self.cycle
        if cycle is not None:
            cycle.keep_alive = False
        framing, self._upgrade_body = self._upgrade_body, None
        if framing is None or cycle is None or cycle.response_complete:
            self._upgrade_ignored = True  # nothing after it is parsed
            self._stop_body_timer()
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
        # For an app served through ASGI: how frontend/client_timeouts.py drops a stalled client at once (close()
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
        self.body_received(len(body))
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
        self._body_done()  # (an armed body timer finds it so, and stops)
        whole, self.declared_body = self.declared_body, None
        cycle = self.cycle
        if cycle is None or cycle.response_complete:
            return
        if whole is not None:
            cycle.body = whole.whole()
        cycle.more_body = False
        cycle.message_event.set()

    # -- what an exchange may do with its connection (``direct_exchange.Connection``) ---------------------------
    @property
    def client_gone(self) -> set[Callable[[], None]]:
        return self._client_gone


def _address(address: Any) -> tuple[str, int] | None:
    """A socket's (host, port), as ASGI's scope gives it; None for what has none (a Unix socket)."""
    if isinstance(address, tuple) and len(address) >= 2:
        return str(address[0]), int(address[1])
    return None

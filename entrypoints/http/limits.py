"""What one client may make a front end wait for or hold (``ClientLimits``, docs/reliability.md), and the part of
the guarded protocol (``entrypoints/http/protocol.py``) that holds it to them: the clocks of a request's head, of
its body and of an idle kept connection; what bodies being read may hold (bytes received, against the server's
``BodyBudget``; bodies per client address); and the ways a connection is ended: a refusal answered in OpenAI's
error shape, a reset, a close that first reads and drops what the client still sends. Each cut-off is logged (with
the request's id where there is a request) and counted (``disagg_http_connections_cut{reason}``).

A body's declared length costs nothing: no bytes are set aside for it and it earns no time. What a body holds is
its bytes received, and what time it has is its clock's: no more than ``body_timeout_s`` without a byte, and no
more in all than ``body_timeout_s`` plus its bytes received at ``body_min_rate`` bytes/s.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import math
import socket
import struct
from collections import deque
from dataclasses import dataclass
from typing import Any

from entrypoints.http.cycle import STATUS_LINE, FlowControl, RequestCycle, default_header_lines
from frontend.client_timeouts import TIMER_SLACK_S
from frontend.errors import OverloadedError, RequestTimeoutError, ServingError, error_body
from frontend.http import DEFAULT_MAX_BODY_BYTES_READING, BodyBudget, BodyReads, request_id_of
from frontend.read_buffers import DeclaredBody

# The HTTP server's logger: what an operator's filters name.
logger = logging.getLogger("disagg_serve.http")

# How long a request's head (request line and headers) may take to arrive, from the connection's opening or its
# first byte.
DEFAULT_HEADER_TIMEOUT_S = 30.0
# How long a request's body may go without a byte arriving, from its head on: a client that sends a head and then
# nothing holds a connection, and nothing more, for at most this long.
DEFAULT_BODY_TIMEOUT_S = 30.0
# ... and the least it must average past its first ``DEFAULT_BODY_TIMEOUT_S`` (bytes/s): a body may take that long
# plus its bytes received at this rate, so a client that trickles a byte just inside the idle timeout is cut off
# too. What a body declares changes neither: only bytes received earn time.
DEFAULT_BODY_MIN_RATE = 32 * 1024
# The most request bodies being read at once from one client address (0: no cap); past it, a 429 and a close. A
# worker's clients are its orchestrators, whose many requests come from few addresses: its cap is far above what
# their admission sends it at once (its bytes budget and body clocks hold as the orchestrator's do).
DEFAULT_MAX_BODY_READS_PER_CLIENT = 64
DEFAULT_WORKER_MAX_BODY_READS_PER_CLIENT = 1024
# The most a request's head (request line and headers) may take, in bytes; a longer one gets 431 and a close.
DEFAULT_MAX_HEAD_BYTES = 64 * 1024

# How long a connection closed before its request's body was read keeps reading (and dropping) what the client
# still sends, so that its close does not reset the connection before the client has read the answer.
LINGER_S = 5.0
# ... and only while the client keeps sending: a pause this long means it has nothing more (or has read the answer
# and stopped), so the close loses nothing.
LINGER_PAUSE_S = 0.5


@dataclass(frozen=True, slots=True)
class ClientLimits:
    """What one client may make a front end wait for or hold (docs/reliability.md)."""

    header_timeout_s: float = DEFAULT_HEADER_TIMEOUT_S
    body_timeout_s: float = DEFAULT_BODY_TIMEOUT_S  # the longest a body may go without a byte
    max_head_bytes: int = DEFAULT_MAX_HEAD_BYTES
    body_min_rate: int = DEFAULT_BODY_MIN_RATE  # bytes/s a body must average past its first body_timeout_s (0: none)
    max_body_reads_per_client: int = DEFAULT_MAX_BODY_READS_PER_CLIENT  # bodies being read per address (0: no cap)


class ClientCutoffs:
    """The guarded protocol's clocks and ends of a connection (its subclass in ``entrypoints/http/protocol.py`` is
    the protocol the server runs, and its ``__init__`` sets the state below: one per connection)."""

    limits = ClientLimits()
    # The server's, shared by its connections (``guarded_protocol`` gives each server its own): bytes of bodies
    # received and not yet whole, and bodies being read per client address.
    bodies = BodyBudget(DEFAULT_MAX_BODY_BYTES_READING)
    readers = BodyReads(limits.max_body_reads_per_client)
    loop: asyncio.AbstractEventLoop
    transport: asyncio.Transport
    flow: FlowControl
    client: tuple[str, int] | None
    server_state: Any
    cycle: RequestCycle | None
    pipeline: deque[tuple[RequestCycle, Any]]
    timeout_keep_alive: float
    timeout_keep_alive_task: asyncio.TimerHandle | None
    _header_timer: asyncio.TimerHandle | None
    _body_timer: asyncio.TimerHandle | None
    _body_started: float | None  # loop time the body being read was first waited for; None: none is
    _body_last: float  # loop time its last bytes came
    _body_bytes: int  # its bytes received, charged to ``bodies``
    _reader_of: str | None  # the address whose count of bodies being read it is in
    _over_budget: bool  # a refusal for bytes over ``bodies`` is on its way
    _linger: asyncio.TimerHandle | None
    _linger_until: float
    _dropped_at: float
    _dropping: bool
    _idle_since: float | None
    declared_body: DeclaredBody | None

    @staticmethod
    def count_cut(reason: str) -> None:
        """Counts a connection cut on a limit (``guarded_protocol`` gives the server's metric)."""

    # -- how a connection ends (``reset``, ``close_unread``: what an exchange may do, ``direct_exchange.Connection``)
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
            cycle.waiting_for_100_continue = False  # our side is shut: nothing more goes to the client
            cycle.disconnected = True  # the handler waiting on the body stops
            cycle.message_event.set()
        self.close_unread()

    def _error_answer(self, error: ServingError, request_id: str | None) -> bytes:
        body = error_body(error)
        lines = [STATUS_LINE[error.status_code]]
        lines.append(default_header_lines(self.server_state.default_headers))
        lines.append(b"content-type: application/json\r\ncontent-length: %d\r\nconnection: close\r\n" % len(body))
        for name, value in error.headers.items():  # (a 429's Retry-After)
            lines.append(b"%b: %b\r\n" % (name.lower().encode("latin-1"), value.encode("latin-1")))
        if request_id is not None:
            lines.append(b"x-request-id: %b\r\n" % request_id.encode())
        lines += (b"\r\n", body)
        return b"".join(lines)

    # -- a body being read: its clock, its bytes, its address's count -------------------------------------------
    # One body timer per connection, moved on when it fires (as the keep-alive timer): a timer per read would be
    # made and cancelled on every read of a long body. A new request's clock moves it earlier where it must, so no
    # request inherits an earlier one's time.
    def _start_body_clock(self, cycle: RequestCycle) -> bool:
        """``cycle``'s body is waited for from now: counted against its address's cap (refused with 429 past it;
        returns False), and timed."""
        readers = self.readers
        if readers.limit:
            host = self.client[0] if self.client else ""
            if not readers.try_begin(host):
                reading = readers.reading[host]
                self._refuse_body(cycle, OverloadedError(
                    f"{reading} request bodies from {host} are being read already, at the limit of {readers.limit}"),
                    "body_overload", f"its address already has {reading} request bodies being read, the limit")
                return False
            self._reader_of = host
        now = self.loop.time()
        self._body_started = self._body_last = now
        self._arm_body_timer(now + self.limits.body_timeout_s)
        return True

    def _body_dues(self, started: float) -> tuple[float, float]:
        """When the body being read is too slow: ``body_timeout_s`` after its last bytes (idle), and after its first
        ``body_timeout_s`` and its bytes received at ``body_min_rate`` (too slow on average; never without one)."""
        idle_s = self.limits.body_timeout_s
        rate = self.limits.body_min_rate
        return self._body_last + idle_s, started + idle_s + self._body_bytes / rate if rate else math.inf

    def _arm_body_timer(self, due: float) -> None:
        timer = self._body_timer
        if timer is not None:
            if timer.when() <= due:
                return  # it fires first, and moves on to ``due``
            timer.cancel()
        self._body_timer = self.loop.call_at(due, self._body_timer_fired)

    def _body_timer_fired(self) -> None:
        self._body_timer = None
        started = self._body_started
        if started is None:
            return  # the body came: armed again for the next one that does not come with its head
        idle_due, rate_due = self._body_dues(started)
        due = min(idle_due, rate_due)
        now = self.loop.time()
        if now < due - TIMER_SLACK_S:
            self._body_timer = self.loop.call_at(due, self._body_timer_fired)
            return
        idle_s = self.limits.body_timeout_s
        if idle_due <= rate_due:  # (the rule that ran out first, however late a busy loop ran this timer)
            self._body_too_slow(f"no byte of it came for {idle_s:g} s")
        else:
            self._body_too_slow(f"{self._body_bytes} bytes in {now - started:.1f} s, under the minimum of "
                                f"{self.limits.body_min_rate} bytes/s after the first {idle_s:g} s")

    def _body_too_slow(self, cause: str) -> None:
        """The request's body is not coming fast enough (``cause``). The client gets a 408 (if nothing was answered
        yet), the handler is told as of a client that left, and the connection closes."""
        cycle = self.cycle
        if cycle is None or not cycle.more_body or self.transport.is_closing():
            return
        self._refuse_body(cycle, RequestTimeoutError("the request's body did not arrive in time"), "body_timeout",
                          f"its body did not arrive in time ({cause})")

    def body_received(self, size: int) -> None:
        """``size`` more bytes of the body being parsed came: charged to the server's budget (past it, the request
        is refused with 429), and its clock told."""
        own = self._body_bytes
        if not self.bodies.take(size, own):
            if not self._over_budget:  # refused once the read in progress is done with, not inside the parser
                self._over_budget = True
                self.loop.call_soon(self._refuse_over_budget)
            return
        self._body_bytes = own + size
        if self._body_started is not None:
            self._body_last = self.loop.time()

    def _refuse_over_budget(self) -> None:
        self._over_budget = False
        cycle = self.cycle
        if cycle is None or not cycle.more_body or self.transport.is_closing() or self._dropping:
            return
        self._refuse_body(cycle, self.bodies.refusal(), "body_overload",
                          f"the server holds {self.bodies.reading} bytes of bodies being read, its limit")

    def _refuse_body(self, cycle: RequestCycle, error: ServingError, reason: str, cause: str) -> None:
        """Answer ``error`` to ``cycle``, whose body is being read, and close; logged with its request id."""
        request_id = request_id_of(list(cycle.scope["headers"]))
        logger.warning("request %s on %s %s from %s: %s; answered %d and closed", request_id,
                       cycle.scope["method"], cycle.scope["path"], _peer(self.client), cause, error.status_code)
        self.count_cut(reason)
        self._end_with(error, request_id)

    def _body_done(self) -> None:
        """The body being read is whole, or no one's: its bytes and its address's count are given back (its timer,
        if armed, finds no body when it fires, and stops)."""
        self._body_started = None
        if self._body_bytes:
            self.bodies.release(self._body_bytes)
            self._body_bytes = 0
        host = self._reader_of
        if host is not None:
            self._reader_of = None
            self.readers.end(host)

    def _stop_body_timer(self) -> None:
        self._body_done()
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

    # -- keep-alive: one timer per connection, moved on when it fires ------------------------------------------
    # A timer made as each answer completes and cancelled at the next request's first byte would be one made and
    # cancelled per request. Here the connection keeps one while it is idle, which finds out when it fires whether
    # the connection was idle for ``timeout_keep_alive`` since its last answer.
    def on_response_complete(self) -> None:
        """The answer in progress is complete: the next pipelined request starts, or the connection is idle."""
        self.server_state.total_requests += 1
        if self.transport.is_closing() or self._dropping:
            return
        self.flow.resume_reading()
        if self.pipeline:
            cycle, app = self.pipeline.pop()
            if cycle.more_body and self._body_started is None and not self._start_body_clock(cycle):
                return  # its body is read from now on, unless refused
            self._start_asgi_task(cycle, app)
            return
        self._idle_since = self.loop.time()
        if self.timeout_keep_alive_task is None:
            self.timeout_keep_alive_task = self.loop.call_later(self.timeout_keep_alive, self._keep_alive_due)

    def _keep_alive_due(self) -> None:
        self.timeout_keep_alive_task = None
        if self._idle_since is None:
            return  # armed again when the request in progress is answered
        due = self._idle_since + self.timeout_keep_alive
        if self.loop.time() < due - TIMER_SLACK_S:
            self.timeout_keep_alive_task = self.loop.call_at(due, self._keep_alive_due)
            return
        self.timeout_keep_alive_handler()

    def _start_asgi_task(self, cycle: RequestCycle, app: Any) -> None:
        raise NotImplementedError  # the protocol's

    def timeout_keep_alive_handler(self) -> None:
        raise NotImplementedError  # the protocol's


def _peer(client: tuple[str, int] | None) -> str:
    return f"{client[0]}:{client[1]}" if client else "a client"

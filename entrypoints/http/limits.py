"""What one client may make a front end wait for or hold (``ClientLimits``; docs/http.md), and the clocks that hold
one connection to them (``ClientClocks``): a request's head, its body, an idle kept connection; and what bodies
being read hold (their bytes received, against the server's ``BodyBudget``; bodies per client address). A body's
declared length costs nothing: no bytes are set aside for it and it earns no time. When a clock runs out, the
connection is told (``Cutoffs``): how it ends is the protocol's.
"""

from __future__ import annotations

import asyncio
import math
from dataclasses import dataclass
from typing import Protocol

from frontend.http import BodyBudget, BodyReads
from frontend.send_timeout import TIMER_SLACK_S

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


@dataclass(frozen=True, slots=True)
class ClientLimits:
    """What one client may make a front end wait for or hold (docs/http.md)."""

    header_timeout_s: float = DEFAULT_HEADER_TIMEOUT_S
    body_timeout_s: float = DEFAULT_BODY_TIMEOUT_S  # the longest a body may go without a byte
    max_head_bytes: int = DEFAULT_MAX_HEAD_BYTES
    body_min_rate: int = DEFAULT_BODY_MIN_RATE  # bytes/s a body must average past its first body_timeout_s (0: none)
    max_body_reads_per_client: int = DEFAULT_MAX_BODY_READS_PER_CLIENT  # bodies being read per address (0: no cap)


class Cutoffs(Protocol):
    """What a connection's clocks tell it when one runs out (the protocol answers, logs, counts and closes)."""

    def head_too_slow(self) -> None:
        """No complete request head within ``header_timeout_s``."""

    def body_too_slow(self, cause: str) -> None:
        """The body being read is not coming fast enough (``cause`` says which rule ran out)."""

    def body_over_budget(self) -> None:
        """The server's bodies being read would hold more than its budget with this one's last bytes."""

    def idle_too_long(self) -> None:
        """The kept connection was idle for its keep-alive time since its last answer."""


class ClientClocks:
    """One connection's clocks and what its body being read holds.

    Each timer is one per connection, moved on when it fires rather than made and cancelled per read or per
    request: it finds out when it fires whether its time has really run out (a new request's clock moves it
    earlier where it must, so no request inherits an earlier one's time). No more than ``body_timeout_s`` without
    a byte of the body, and no more in all than ``body_timeout_s`` plus its bytes received at ``body_min_rate``."""

    __slots__ = ("_body_bytes", "_body_last", "_body_started", "_body_timer", "_connection", "_head_timer",
                 "_idle_since", "_idle_timer", "_over_budget", "_reader_of", "bodies", "keep_alive_s", "limits",
                 "loop", "readers")

    def __init__(self, connection: Cutoffs, loop: asyncio.AbstractEventLoop, limits: ClientLimits,
                 bodies: BodyBudget, readers: BodyReads, keep_alive_s: float) -> None:
        self._connection = connection
        self.loop = loop
        self.limits = limits
        self.bodies = bodies  # the server's: bytes of bodies received and not yet whole
        self.readers = readers  # the server's: bodies being read per client address
        self.keep_alive_s = keep_alive_s
        self._head_timer: asyncio.TimerHandle | None = None
        self._body_timer: asyncio.TimerHandle | None = None
        self._body_started: float | None = None  # loop time the body being read was first waited for
        self._body_last = 0.0  # loop time its last bytes came
        self._body_bytes = 0  # its bytes received: charged to ``bodies`` until it is whole
        self._reader_of: str | None = None  # the client address whose count of bodies being read it is in
        self._over_budget = False  # a refusal for bytes over ``bodies`` is on its way
        self._idle_timer: asyncio.TimerHandle | None = None
        self._idle_since: float | None = None  # loop time of the last answer, while no bytes came after it

    def stop(self) -> None:
        """The connection is gone: every timer stops, and its body being read gives back what it held."""
        self.stop_head()
        self.stop_body()
        if self._idle_timer is not None:
            self._idle_timer.cancel()
            self._idle_timer = None

    # -- a request's head ----------------------------------------------------------------------------------------
    @property
    def head_timed(self) -> bool:
        """Whether a head's clock runs."""
        return self._head_timer is not None

    def start_head(self) -> None:
        self.stop_head()
        self._head_timer = self.loop.call_later(self.limits.header_timeout_s, self._head_due)

    def stop_head(self) -> None:
        if self._head_timer is not None:
            self._head_timer.cancel()
            self._head_timer = None

    def _head_due(self) -> None:
        self._head_timer = None
        self._connection.head_too_slow()

    # -- a body being read: its clock, its bytes, its address's count -------------------------------------------
    @property
    def body_timed(self) -> bool:
        """Whether a body is being waited for."""
        return self._body_started is not None

    def start_body(self, host: str) -> bool:
        """A body from ``host`` is waited for from now: counted against the address's cap (False past it: the
        connection refuses it), and timed."""
        readers = self.readers
        if readers.limit:
            if not readers.try_begin(host):
                return False
            self._reader_of = host
        now = self.loop.time()
        self._body_started = self._body_last = now
        self._arm_body_timer(now + self.limits.body_timeout_s)
        return True

    def body_received(self, size: int) -> None:
        """``size`` more bytes of the body being parsed came: charged to the server's budget (past it, the
        connection is told once the read in progress is done with, not inside the parser), and its clock told."""
        own = self._body_bytes
        if not self.bodies.take(size, own):
            if not self._over_budget:
                self._over_budget = True
                self.loop.call_soon(self._over_budget_due)
            return
        self._body_bytes = own + size
        if self._body_started is not None:
            self._body_last = self.loop.time()

    def _over_budget_due(self) -> None:
        self._over_budget = False
        self._connection.body_over_budget()

    def body_done(self) -> None:
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

    def stop_body(self) -> None:
        self.body_done()
        if self._body_timer is not None:
            self._body_timer.cancel()
            self._body_timer = None

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
            self._connection.body_too_slow(f"no byte of it came for {idle_s:g} s")
        else:
            self._connection.body_too_slow(f"{self._body_bytes} bytes in {now - started:.1f} s, under the minimum "
                                           f"of {self.limits.body_min_rate} bytes/s after the first {idle_s:g} s")

    # -- keep-alive ----------------------------------------------------------------------------------------------
    def idle(self) -> None:
        """The connection's answer is complete and nothing came after it: idle from now."""
        self._idle_since = self.loop.time()
        if self._idle_timer is None:
            self._idle_timer = self.loop.call_later(self.keep_alive_s, self._idle_due)

    def busy(self) -> None:
        """Bytes came: not idle (an armed keep-alive timer finds it so, and stops)."""
        self._idle_since = None

    def _idle_due(self) -> None:
        self._idle_timer = None
        if self._idle_since is None:
            return  # armed again when the request in progress is answered
        due = self._idle_since + self.keep_alive_s
        if self.loop.time() < due - TIMER_SLACK_S:
            self._idle_timer = self.loop.call_at(due, self._idle_due)
            return
        self._connection.idle_too_long()

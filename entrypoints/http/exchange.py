"""A fast route's answer written on its connection (``CycleExchange``): the handler works on the request's
``RequestCycle`` directly, with no ASGI message and no app stack in between. The body is the one the protocol
parsed, the head is written by the cycle (``RequestCycle.answer_head``) and a whole answer goes out with it in one
send; a timer runs only while a send waits for a client that does not read. It keeps the cycle's rules
(``cycle.py``), so that the connection (keep-alive, pipelining, flow control, graceful shutdown) cannot tell it from
an app's answer through ASGI.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable
from typing import Any, Protocol

from entrypoints.http.cycle import RequestCycle, last_chunk
from frontend.asgi_fast_path import Exchange, Handler, PushedStream, RawHeaders
from frontend.http import ClientDisconnected, too_large

logger = logging.getLogger("disagg_serve.http")

_JOIN_UP_TO = 64 * 1024  # a whole answer up to this goes out joined to its head; a longer one beside it


class Connection(Protocol):
    """What an exchange may do with the connection it is served on (``entrypoints/http/protocol.py``'s)."""

    @property
    def client_gone(self) -> set[Callable[[], None]]:
        """Callbacks called once, when the connection is lost."""

    def reset(self) -> None:
        """Drop the connection at once, unsent answer and all (a client that stopped reading)."""


class CycleExchange(Exchange):
    """An exchange over a ``RequestCycle`` on ``connection``."""

    __slots__ = ("_connection", "_cycle", "_finished", "_held")

    def __init__(self, cycle: RequestCycle, connection: Connection, send_timeout_s: float | None) -> None:
        super().__init__(cycle.scope, send_timeout_s)
        self._cycle = cycle
        self._connection = connection
        self._held = b""  # a pushed answer's head, not yet written: it goes out with the first piece
        self._finished = False  # a pushed answer's end is written (``_finish``)

    async def run(self, handler: Handler) -> None:
        """``serve``, then what ``RequestCycle.run_asgi`` does after an app: an answer never started is a 500 and
        one never completed a closed connection, each logged with the request's id."""
        cycle = self._cycle
        try:
            await self.serve(handler)
        except asyncio.CancelledError:
            # Not the client's (``serve`` takes those): the server's, at the end of its graceful shutdown.
            logger.error("request %s on POST %s cancelled by the server's shutdown", self.request_id,
                         self.scope["path"])
            self._end_broken()
            raise
        except BaseException as exc:  # (a SystemExit or an exception group too: the server keeps serving)
            # What ``serve`` could not answer: a failure after the answer started, or one that is no Exception.
            logger.error("request %s on POST %s failed: %s", self.request_id, self.scope["path"], exc,
                         exc_info=exc)
            self._end_broken()
        else:
            # (A client that left or stalled was cut off: nothing to answer.)
            if not cycle.response_complete and not cycle.disconnected and self._cut is None:
                logger.error("request %s on POST %s: the handler returned without completing its answer",
                             self.request_id, self.scope["path"])
                self._end_broken()
        finally:
            cycle.detach()

    def _end_broken(self) -> None:
        cycle = self._cycle
        if self._held and not cycle.response_complete:
            self._held = b""  # a pushed answer's head, never sent: a 500 can still be answered
            cycle.response_started = False
        cycle.end_broken(self.request_id)

    # -- the request ---------------------------------------------------------------------------------------------
    async def _read(self, max_bytes: int) -> bytes:
        cycle = self._cycle
        cycle.continue_if_awaited()
        while cycle.more_body and not cycle.disconnected:
            if len(cycle.body) > max_bytes:
                raise too_large(max_bytes)
            cycle.flow.resume_reading()  # paused past 64 KiB of a body read piece by piece
            await cycle.message_event.wait()
            cycle.message_event.clear()
        if cycle.disconnected:
            raise ClientDisconnected()
        body: Any = cycle.body
        cycle.body = bytearray()
        if len(body) > max_bytes:
            raise too_large(max_bytes)
        return body if type(body) is bytes else bytes(body)

    # -- the answer ----------------------------------------------------------------------------------------------
    async def _send_start(self, status: int, headers: RawHeaders) -> None:
        if await self._writable():
            self._cycle.transport.write(self._head(status, headers, chunked=True))

    async def _send_body(self, body: bytes, more: bool) -> None:
        if not await self._writable():
            return
        write = self._write  # (a pushed answer's head first, if no piece has taken it yet)
        if not self._cycle.chunked_encoding:  # an HTTP/1.0 client: the body as it is, its end the connection's
            if body or self._held:
                write(body)
        elif more:
            if body:
                write(b"%x\r\n%b\r\n" % (len(body), body))
            return
        else:
            write(last_chunk(body))
        if not more:
            self._cycle.end()

    async def push(self, pushed: PushedStream, headers: RawHeaders) -> None:
        """A 200 written piece by piece from the callback that read each piece (``PushedStream``), with a send
        fewer at each end: the head goes out with the first piece when it is already there (``push``
        hands on what came with GEN's head before it waits), else at the loop's next turn; and the piece with the
        stream's end marker goes out with the end of the answer (``_finish``), not a send of its own after GEN's
        stream is read to its end."""
        self._started = True
        if await self._writable():
            self._held = self._head(200, [*headers, (b"x-request-id", self.request_id.encode())], chunked=True)
            asyncio.get_running_loop().call_soon(self._write_held)
        await pushed.push(self._write_piece, self._writable, self._finish)
        self._complete = True
        if not self._finished:
            await self._send_body(b"", False)
        elif not self._cycle.response_complete and await self._writable():
            self._cycle.end()  # the end went to a client that was behind: complete once it has taken it

    def _write_piece(self, body: bytes) -> bool:
        """``_send_body(body, True)`` without its wait: whether the client can take more is the answer."""
        cycle = self._cycle
        if self._nowhere_to_write():
            return True
        if body:
            self._write(b"%x\r\n%b\r\n" % (len(body), body) if cycle.chunked_encoding else body)
        return not cycle.flow.write_paused

    def _finish(self, body: bytes) -> None:
        """The pushed answer's last piece and its end, in one send; whatever is written after it is dropped."""
        if self._nowhere_to_write():
            return
        self._complete = True  # a client that hangs up now cuts nothing short
        self._finished = True
        self._write(last_chunk(body) if self._cycle.chunked_encoding else body)
        if not self._cycle.flow.write_paused:
            self._cycle.end()
        # (else the end of ``push`` completes it once the client has taken it, cutting off one that does not)

    def _nowhere_to_write(self) -> bool:
        cycle = self._cycle
        # The client left, was cut off or its connection is closing (the handler is being cancelled), or the
        # answer has ended: a piece has nowhere to go.
        return cycle.disconnected or self._cut is not None or cycle.transport.is_closing() or cycle.response_complete \
            or self._finished

    def _write(self, data: bytes) -> None:
        held, self._held = self._held, b""
        self._cycle.transport.write(held + data if held else data)

    def _write_held(self) -> None:
        """The head of a pushed answer whose first piece did not come with GEN's head: written on its own."""
        if self._held and not self._nowhere_to_write():
            self._write(b"")

    async def _send_whole(self, status: int, headers: RawHeaders, body: bytes) -> None:
        if not await self._writable():
            return
        head = self._head(status, headers, chunked=False)
        if len(body) <= _JOIN_UP_TO:
            self._cycle.transport.write(head + body)  # one send for the answer
        else:
            self._cycle.transport.writelines((head, body))
        self._cycle.end()

    def _head(self, status: int, headers: RawHeaders, chunked: bool) -> bytes:
        """The answer's head, written by the cycle as it writes an app's (its header names are the handler's own,
        not a client's: no check)."""
        cycle = self._cycle
        if chunked and cycle.scope["http_version"] == "1.0":
            chunked = False  # no chunks for HTTP/1.0: the connection's end is the body's (it is not kept)
        cycle.chunked_encoding = chunked
        lines: list[bytes] = []
        for name, value in headers:
            lines += (name, b": ", value, b"\r\n")
        return cycle.answer_head(status, lines, says_close=False, chunked=chunked)

    async def _writable(self) -> bool:
        """Whether the answer can still be written, after waiting (at most ``send_timeout_s``) for a client that is
        ``send_timeout_s`` behind; a client that waits longer is cut off."""
        cycle = self._cycle
        if cycle.flow.write_paused and not cycle.disconnected:
            if self._send_timeout_s is None:
                await cycle.flow.drain()
            else:
                try:
                    async with asyncio.timeout(self._send_timeout_s):
                        await cycle.flow.drain()
                except TimeoutError:
                    self._connection.reset()
                    self._cut_off("stalled")
                    await asyncio.sleep(0)  # where the cut-off's cancellation is raised
        return not cycle.disconnected

    # -- the client ----------------------------------------------------------------------------------------------
    def _watch(self) -> None:
        self._connection.client_gone.add(self._client_left)

    def _unwatch(self) -> None:
        self._connection.client_gone.discard(self._client_left)

"""uvicorn's httptools protocol with a header-read timeout (a slowloris client is cut off), and a request body of
declared length handed to the app whole.

uvicorn (0.54) starts no timer while a request's headers arrive: a client that opens a connection and sends
nothing, or its headers a byte at a time, holds the connection (and a file descriptor) for ever; on a keep-alive
connection the first byte of the next request even cancels the idle timer. Here each request's headers must be
complete within ``header_timeout_s`` of the connection opening or of its first byte, or the connection is closed.
A request whose headers arrived is no longer timed here (its body and answer have their own limits); its scope
gets the ``ABORT_CONNECTION`` extension that ``frontend/client_timeouts.py`` uses, and the ``CLIENT_GONE`` one
through which ``frontend/asgi_fast_path.py`` learns that the client left without a task waiting on ``receive``.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import socket
import struct
from collections.abc import Callable
from typing import Any

from uvicorn.protocols.http.flow_control import HIGH_WATER_LIMIT
from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol

from frontend.asgi_fast_path import CLIENT_GONE
from frontend.client_timeouts import ABORT_CONNECTION, DEFAULT_HEADER_TIMEOUT_S

logger = logging.getLogger(__name__)

# A request body of a declared length up to this is read whole before the app is woken (below).
WHOLE_BODY_UP_TO = 16 * 1024 * 1024


def protocol_with_header_timeout(header_timeout_s: float) -> type[HttpToolsProtocol]:
    """An ``HttpToolsProtocol`` class (uvicorn's ``http=`` takes a class) closing slow-header connections."""

    class HeaderTimeoutProtocol(_HeaderTimeoutProtocol):
        timeout_s = header_timeout_s

    return HeaderTimeoutProtocol


class _HeaderTimeoutProtocol(HttpToolsProtocol):
    timeout_s = DEFAULT_HEADER_TIMEOUT_S

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._header_timer: asyncio.TimerHandle | None = None
        # Called once when the connection is lost: a set, so that a pipelined request's callback is not the
        # running one's; each request takes its own out when it is done.
        self._client_gone: set[Callable[[], None]] = set()
        # The pieces of a body being read whole, or None (uvicorn's own way: the app woken for every piece).
        self._body_pieces: list[bytes] | None = None

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        super().connection_made(transport)
        self._start_header_timer()

    def data_received(self, data: bytes) -> None:
        # Between requests on a keep-alive connection the idle timer runs; the next request's first byte starts
        # its header clock.
        if self._header_timer is None and self.cycle is not None and self.cycle.response_complete:
            self._start_header_timer()
        super().data_received(data)

    def on_headers_complete(self) -> None:
        self._stop_header_timer()
        # How frontend/client_timeouts.py drops a stalled client at once: close() would first wait for the client
        # to read what is still buffered, which it will not.
        extensions = self.scope.setdefault("extensions", {})
        extensions[ABORT_CONNECTION] = {"abort": self._reset_connection}
        extensions[CLIENT_GONE] = {"callbacks": self._client_gone}
        super().on_headers_complete()
        declared = next((value for name, value in self.headers if name == b"content-length"), b"")
        whole = declared.isdigit() and HIGH_WATER_LIMIT < int(declared) <= WHOLE_BODY_UP_TO
        self._body_pieces = [] if whole and not self.parser.should_upgrade() else None

    def on_body(self, body: bytes) -> None:
        """A body of declared length is read whole, then handed over as one piece.

        uvicorn appends every piece to a bytearray, pauses the socket past 64 KiB and wakes the app for each piece;
        the app copies the bytearray out each time and joins the copies. For a 524 KB prompt that is ten
        pause/resume rounds, as many wake-ups of the request's task and three copies of the body. Read whole, it is
        one wake-up and one join. The app reads every body whole anyway (``frontend/asgi_fast_path.py``), and what
        it may hold is capped twice: a declared length above ``max_body_bytes`` is refused before a byte is read,
        and this applies only up to ``WHOLE_BODY_UP_TO``."""
        pieces = self._body_pieces
        if pieces is None or self.cycle.response_complete:
            super().on_body(body)
            return
        pieces.append(body)

    def on_message_complete(self) -> None:
        pieces, self._body_pieces = self._body_pieces, None
        if pieces and not self.cycle.response_complete:
            self.cycle.body = pieces[0] if len(pieces) == 1 else b"".join(pieces)  # type: ignore[assignment]
        super().on_message_complete()

    def connection_lost(self, exc: Exception | None) -> None:
        self._stop_header_timer()
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

"""uvicorn's httptools protocol with a header-read timeout: a slowloris client is cut off.

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

from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol

from frontend.asgi_fast_path import CLIENT_GONE
from frontend.client_timeouts import ABORT_CONNECTION, DEFAULT_HEADER_TIMEOUT_S

logger = logging.getLogger(__name__)


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

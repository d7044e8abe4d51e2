"""uvicorn's httptools protocol with a header-read timeout (a slowloris client is cut off), and a request body of
declared length read straight into its own buffer and handed to the app whole.

uvicorn (0.54) starts no timer while a request's headers arrive: a client that opens a connection and sends
nothing, or its headers a byte at a time, holds the connection (and a file descriptor) for ever; on a keep-alive
connection the first byte of the next request even cancels the idle timer. Here each request's headers must be
complete within ``header_timeout_s`` of the connection opening or of its first byte, or the connection is closed.
A request whose headers arrived is no longer timed here (its body and answer have their own limits); its scope
gets the ``ABORT_CONNECTION`` extension that ``frontend/client_timeouts.py`` uses, and the ``CLIENT_GONE`` one
through which ``frontend/asgi_fast_path.py`` learns that the client left without a task waiting on ``receive``.

The socket is read as a ``BufferedProtocol`` (``BufferedReads``): the kernel copies into a buffer the protocol
chose. Between requests that is a small buffer shared by the thread's connections, copied out as the ``bytes``
uvicorn parses; once the headers of a body of declared length (64 KiB to ``WHOLE_BODY_UP_TO``) are parsed, the
rest of the body goes straight into a buffer of its own, never through the parser. uvicorn's way (a plain
``Protocol``) copied a 524 KB prompt three times after the kernel did: into the ``bytes`` uvloop hands
``data_received``, into the ``bytes`` httptools hands ``on_body``, and into the join of the pieces; now once, into
the ``bytes`` the app gets.
"""

from __future__ import annotations

import asyncio
import contextlib
import ctypes
import logging
import socket
import struct
import threading
from collections.abc import Callable
from typing import Any

import httptools
from uvicorn.protocols.http.flow_control import HIGH_WATER_LIMIT
from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol

from frontend.asgi_fast_path import CLIENT_GONE
from frontend.client_timeouts import ABORT_CONNECTION, DEFAULT_HEADER_TIMEOUT_S

logger = logging.getLogger(__name__)

# A request body of a declared length up to this is read whole before the app is woken (below).
WHOLE_BODY_UP_TO = 16 * 1024 * 1024
# The most one read takes while a request's head is awaited: enough for a head and a short body; what follows a
# long body's head is left in the socket for the body's own buffer.
HEAD_READ_BYTES = 16 * 1024
# The most one read takes of a body not read whole (no declared length, or above WHOLE_BODY_UP_TO).
READ_BYTES = 256 * 1024
# A body read whole is read into buffers of at most this many bytes (a longer one into several, joined at the end):
# what a client that declares a long body and sends none of it makes the server hold.
BODY_PIECE_BYTES = 1024 * 1024

_thread_buffers = threading.local()


def _shared_read_buffer() -> memoryview:
    """The thread's read buffer: one per event loop is enough, since each read is copied out before the next."""
    view: memoryview | None = getattr(_thread_buffers, "view", None)
    if view is None:
        view = _thread_buffers.view = memoryview(bytearray(READ_BYTES))
    return view


_bytes_of_size = ctypes.pythonapi.PyBytes_FromStringAndSize
_bytes_of_size.argtypes = (ctypes.c_void_p, ctypes.c_ssize_t)
_bytes_of_size.restype = ctypes.py_object
_contents_of_bytes = ctypes.pythonapi.PyBytes_AsString
_contents_of_bytes.argtypes = (ctypes.py_object,)
_contents_of_bytes.restype = ctypes.c_void_p
# A view of memory, not of an object (and so no ctypes array type per size: ctypes caches each for ever).
_view_of_memory = ctypes.pythonapi.PyMemoryView_FromMemory
_view_of_memory.argtypes = (ctypes.c_void_p, ctypes.c_ssize_t, ctypes.c_int)
_view_of_memory.restype = ctypes.py_object
_WRITABLE = 0x200  # PyBUF_WRITE


def _unfilled_bytes(size: int) -> tuple[bytes, memoryview]:
    """A new ``bytes`` of ``size`` (> 0) bytes, not yet filled, and a writable view of its contents.

    What C code does to build a ``bytes`` in place: CPython's API makes one with ``PyBytes_FromStringAndSize(NULL,
    size)`` ("the contents are uninitialized") and lets its maker fill it through ``PyBytes_AsString`` ("must not be
    modified ... unless the object was just created using PyBytes_FromStringAndSize(NULL, size)"). A body read into
    it is handed to the app as is: no zeroing of a ``bytearray`` first and no copy into a ``bytes`` after. The view
    does not keep the object alive: its holder does; and no one sees the object before it is filled."""
    piece = _bytes_of_size(None, size)
    return piece, _view_of_memory(_contents_of_bytes(piece), size, _WRITABLE)


def protocol_with_header_timeout(header_timeout_s: float) -> type[BufferedReads]:
    """A protocol class for uvicorn's ``http=`` (a factory called with uvicorn's options): an ``HttpToolsProtocol``
    closing slow-header connections, its socket read by ``BufferedReads``."""

    class HeaderTimeoutProtocol(_HeaderTimeoutProtocol):
        timeout_s = header_timeout_s

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


class _HeaderTimeoutProtocol(HttpToolsProtocol):
    timeout_s = DEFAULT_HEADER_TIMEOUT_S

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._header_timer: asyncio.TimerHandle | None = None
        # Called once when the connection is lost: a set, so that a pipelined request's callback is not the
        # running one's; each request takes its own out when it is done.
        self._client_gone: set[Callable[[], None]] = set()
        # A body being read whole: its pieces (``bytes`` filled in place, ``_unfilled_bytes``), or None (none, or
        # read uvicorn's way: the app woken for every piece); how many of its bytes are still to come, and how many
        # have no piece yet; and the part of the current piece still to fill.
        self._body_pieces: list[bytes] | None = None
        self._body_left = 0
        self._body_unplaced = 0
        self._body_free: memoryview | None = None
        self._read_into: memoryview | None = None  # the buffer of the read in progress, or None for the body's
        self._shared = _shared_read_buffer()
        self._shared_head = self._shared[:HEAD_READ_BYTES]

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        super().connection_made(transport)
        self._start_header_timer()

    # -- reads (``BufferedReads``) ------------------------------------------------------------------------------
    def get_buffer(self, sizehint: int) -> memoryview:
        """Where the next read goes: the rest of a body read whole, else the thread's shared buffer."""
        if self._body_left:
            if self.cycle.response_complete:
                self._body_pieces = self._body_free = None  # answered without it (a 413): read to its end, dropped
            if self._body_pieces is not None:
                self._read_into = None
                return self._body_free or self._new_piece()
            view = self._shared[:self._body_left]
        elif self.cycle is None or not self.cycle.more_body:  # between requests: a head is next
            view = self._shared_head
        else:
            view = self._shared
        self._read_into = view
        return view

    def buffer_updated(self, nbytes: int) -> None:
        into = self._read_into
        if into is not None and not self._body_left:
            self.data_received(bytes(into[:nbytes]))
            return
        self._body_left -= nbytes
        if into is None:
            free = self._body_free
            assert free is not None
            self._body_free = free[nbytes:] if nbytes < len(free) else None
        if not self._body_left:
            # The parser still waits for the bytes that went past it: the next request gets a fresh one.
            self.parser = httptools.HttpRequestParser(self)
            self.on_message_complete()

    def _new_piece(self) -> memoryview:
        piece, self._body_free = _unfilled_bytes(min(self._body_unplaced, BODY_PIECE_BYTES))
        self._body_unplaced -= len(piece)
        self._body_pieces.append(piece)  # type: ignore[union-attr]  # only while a body is read whole
        return self._body_free

    # -- the request --------------------------------------------------------------------------------------------
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
        declared = b""
        for name, value in self.headers:
            if name == b"content-length" and not declared:
                declared = value
            elif name == b"transfer-encoding":
                return  # framed by chunks, whatever it also declares: the parser's way
        if declared.isdigit() and HIGH_WATER_LIMIT < int(declared) <= WHOLE_BODY_UP_TO \
                and not self.parser.should_upgrade():
            self._body_pieces = []
            self._body_left = self._body_unplaced = int(declared)

    def on_body(self, body: bytes) -> None:
        """A body of declared length is read whole, then handed over as one piece.

        uvicorn appends every piece to a bytearray, pauses the socket past 64 KiB and wakes the app for each piece;
        the app copies the bytearray out each time and joins the copies. For a 524 KB prompt that was ten
        pause/resume rounds, as many wake-ups of the request's task and three copies of the body. Read whole, it is
        one wake-up and one copy: here only what came in the read of its head passes the parser; the rest is read
        into the body's own buffer (``get_buffer``). The app reads every body whole anyway
        (``frontend/asgi_fast_path.py``), and what it may hold is capped twice: a declared length above
        ``max_body_bytes`` is refused before a byte is read, and this applies only up to ``WHOLE_BODY_UP_TO``."""
        if not self._body_left:
            super().on_body(body)
            return
        self._body_left -= len(body)
        if self._body_pieces is None or self.cycle.response_complete:
            return
        at = 0
        while at < len(body):
            free = self._body_free or self._new_piece()
            size = min(len(free), len(body) - at)
            free[:size] = body[at:at + size]
            self._body_free = free[size:] if size < len(free) else None
            at += size

    def on_message_complete(self) -> None:
        pieces, self._body_pieces = self._body_pieces, None
        self._body_left = 0
        self._body_free = None
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

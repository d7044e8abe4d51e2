"""Where an HTTP connection's reads go: a buffer shared by the thread's connections, copied out as the ``bytes`` a
parser is fed, and for a long body of declared length, ``bytes`` of that body filled in place by the kernel's reads.

A long prompt (the servers) or CTX's answer (the orchestrator's client) reaches its reader as the very object the
kernel wrote into, with no copy after the kernel's (docs/architecture.md)."""

from __future__ import annotations

import ctypes
import threading
from typing import TYPE_CHECKING

# The most one read takes while a message's head is awaited: enough for a head and a short body; what follows a
# long body's head is left in the socket for the body's own buffer.
HEAD_READ_BYTES = 16 * 1024
# The most one read takes of a body not read into its own buffer (no declared length, or a stream).
READ_BYTES = 256 * 1024
# A body is read into ``bytes`` of at most this many bytes (a longer one into several, joined at the end): what a
# peer that declares a long body and sends none of it makes us set aside.
PIECE_BYTES = 4 * 1024 * 1024

_thread_buffers = threading.local()

# Prototypes of our own, not the shared ``ctypes.pythonapi.<name>`` objects, whose argtypes and restype any library
# may set (a ``c_char_p`` restype there would have the view below made of a temporary copy).
_bytes_of_size = ctypes.PYFUNCTYPE(ctypes.py_object, ctypes.c_void_p, ctypes.c_ssize_t)(
    ("PyBytes_FromStringAndSize", ctypes.pythonapi))
_contents_of_bytes = ctypes.PYFUNCTYPE(ctypes.c_void_p, ctypes.py_object)(("PyBytes_AsString", ctypes.pythonapi))
# A view of memory, not of an object (and so no ctypes array type per size: ctypes keeps each one for ever).
_view_of_memory = ctypes.PYFUNCTYPE(ctypes.py_object, ctypes.c_void_p, ctypes.c_ssize_t, ctypes.c_int)(
    ("PyMemoryView_FromMemory", ctypes.pythonapi))
_WRITABLE = 0x200  # PyBUF_WRITE


def shared_read_buffer() -> memoryview:
    """The thread's read buffer (``READ_BYTES``): one per event loop is enough, since each read is copied out
    before the next."""
    view: memoryview | None = getattr(_thread_buffers, "view", None)
    if view is None:
        view = _thread_buffers.view = memoryview(bytearray(READ_BYTES))
    return view


def unfilled_bytes(size: int) -> tuple[bytes, memoryview]:
    """A new ``bytes`` of ``size`` (> 0) bytes, not yet filled, and a writable view of its contents.

    This is how C code builds a ``bytes`` in place: ``PyBytes_FromStringAndSize`` with a NULL source returns an
    object whose contents are left unset, and the C API lets the code that just made it, and only that code, write
    them through the pointer ``PyBytes_AsString`` returns. No zeroing of a ``bytearray`` first and no copy into a
    ``bytes`` after. The view does not keep the object alive: its holder does; and no one may see the object before
    it is filled."""
    piece = _bytes_of_size(None, size)
    return piece, _view_of_memory(_contents_of_bytes(piece), size, _WRITABLE)


class DeclaredBody:
    """A body of declared length being read: what the parser handed over (``take``), then what was read straight
    into it (``free``, then ``filled``), then its last ``HEAD_READ_BYTES`` read into the shared buffer with whatever
    follows it (``take_from``), until ``left`` is 0 and ``whole`` is the body. The end goes through the shared buffer
    so that the bytes after it (a pipelined request, a worker's unasked answer) come in the same read, as they did
    through the parser: a read into the body itself would stop at its end and leave them unseen in the socket.
    ``drop`` keeps nothing more (a body no one will read): the rest is read into the shared buffer and counted."""

    __slots__ = ("_free", "_pieces", "_unplaced", "left")

    def __init__(self, length: int) -> None:
        self.left = length  # bytes still to come
        self._unplaced = length  # bytes with no piece yet
        self._pieces: list[bytes] | None = []
        self._free: memoryview | None = None  # the part of the last piece still to fill

    def free(self) -> memoryview | None:
        """Where the next read goes, or None: into the shared buffer (the body's end, or a dropped body)."""
        direct = self.left - HEAD_READ_BYTES
        if self._pieces is None or direct <= 0:
            return None
        free = self._free or self._new_piece()
        return free if len(free) <= direct else free[:direct]

    def filled(self, nbytes: int) -> None:
        """``nbytes`` were read into what ``free`` returned."""
        self.left -= nbytes
        free = self._free
        assert free is not None
        self._free = free[nbytes:] if nbytes < len(free) else None

    def take_from(self, data: memoryview) -> memoryview:
        """Takes what of ``data`` (read into the shared buffer) is the body's; returns what follows it."""
        used = min(len(data), self.left)
        self.take(data[:used])
        return data[used:]

    def take(self, data: bytes | memoryview) -> None:
        self.left -= len(data)
        if self._pieces is None:
            return
        at = 0
        while at < len(data):
            free = self._free or self._new_piece()
            size = min(len(free), len(data) - at)
            free[:size] = data[at:at + size]
            self._free = free[size:] if size < len(free) else None
            at += size

    def drop(self) -> None:
        self._pieces = self._free = None

    def whole(self) -> bytes:
        pieces = self._pieces or [b""]
        return pieces[0] if len(pieces) == 1 else b"".join(pieces)

    def _new_piece(self) -> memoryview:
        piece, self._free = unfilled_bytes(min(self._unplaced, PIECE_BYTES))
        self._unplaced -= len(piece)
        self._pieces.append(piece)  # type: ignore[union-attr]  # only while kept
        return self._free


class DeclaredBodyReads:
    """The read side of an HTTP/1.1 ``BufferedProtocol`` (a server's or a client's): a message's head through the
    shared buffer to the parser (``data_received``); once the protocol has set ``declared_body`` (its head said how
    long the body is), the body into its own bytes, its end and whatever follows through the shared buffer, and
    ``declared_body_read`` called when it is whole. Subclasses say when a head is awaited (``awaiting_head``: a
    smaller read then, so that a long body's head leaves the body in the socket)."""

    declared_body: DeclaredBody | None = None
    _into_body = False  # the read in progress goes into ``declared_body``
    _shared: memoryview
    _shared_head: memoryview

    def start_reads(self) -> None:
        self._shared = shared_read_buffer()
        self._shared_head = self._shared[:HEAD_READ_BYTES]

    def get_buffer(self, sizehint: int) -> memoryview:
        body = self.declared_body
        if body is not None:
            into = body.free()
            if into is not None:
                self._into_body = True
                return into
        self._into_body = False
        return self._shared_head if body is None and self.awaiting_head() else self._shared

    def buffer_updated(self, nbytes: int) -> None:
        body = self.declared_body
        if self._into_body:
            assert body is not None  # nothing between a read's get_buffer and its buffer_updated changes it
            body.filled(nbytes)
            self.body_received(nbytes)
            return
        data = self._shared[:nbytes]
        if body is not None:  # the end of a declared body, and what follows it
            left = body.left
            data = body.take_from(data)
            self.body_received(left - body.left)
            if body.left:
                return
            self.declared_body_read()
            if not data:
                return
        self.data_received(bytes(data))

    def awaiting_head(self) -> bool:
        raise NotImplementedError

    def body_received(self, size: int) -> None:
        """``size`` bytes of ``declared_body`` were read past the parser (a server counts and times them)."""

    def declared_body_read(self) -> None:
        """``declared_body`` is whole (``left`` is 0), past the parser, which still waits for its bytes."""
        raise NotImplementedError

    if TYPE_CHECKING:
        def data_received(self, data: bytes) -> None:
            """The protocol's own: the parser is fed everything but a declared body."""

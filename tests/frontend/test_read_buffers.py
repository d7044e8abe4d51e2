"""``frontend/read_buffers.py``: ``bytes`` filled in place, and a body of declared length assembled from what a
parser handed over and what was read straight into it, across pieces, or dropped."""

from __future__ import annotations

import pytest

from frontend import read_buffers
from frontend.read_buffers import DeclaredBody, shared_read_buffer, unfilled_bytes


def pattern(size: int, seed: int = 0) -> bytes:
    return bytes((i * 7 + seed) % 251 for i in range(size))


@pytest.mark.parametrize("size", [1, 2, 70_000])
def test_a_bytes_filled_in_place_is_a_new_object_that_holds_what_was_written(size: int) -> None:
    # Size 1 matters: CPython shares one object per byte value, but only for sizes made from a string.
    piece, view = unfilled_bytes(size)
    other, _ = unfilled_bytes(size)
    assert type(piece) is bytes and len(piece) == len(view) == size and piece is not other
    view[:] = pattern(size)
    assert piece == pattern(size) and hash(piece) == hash(pattern(size))


def read_into(body: DeclaredBody, data: bytes, most: int) -> bytes:
    """What a transport does with ``data`` arriving (the body's rest and what follows it), in reads of at most
    ``most`` bytes: into ``free()``, or into the shared buffer and ``take_from``. Returns what followed the body."""
    at = 0
    while body.left:
        free = body.free()
        if free is not None:
            size = min(len(free), most, len(data) - at)
            free[:size] = data[at:at + size]
            body.filled(size)
        else:
            size = min(len(shared_read_buffer()), most, len(data) - at)
            shared_read_buffer()[:size] = data[at:at + size]
            after = body.take_from(shared_read_buffer()[:size])
            if not body.left:
                return bytes(after) + data[at + size:]
        at += size
    return data[at:]


@pytest.mark.parametrize("piece_bytes", [3, 1000, 1 << 20])
@pytest.mark.parametrize("taken", [0, 1, 999, 30_000])
@pytest.mark.parametrize("most", [777, 1 << 20])
def test_a_body_is_what_the_parser_handed_over_and_what_was_read_into_it_and_stops_at_its_end(
        monkeypatch: pytest.MonkeyPatch, piece_bytes: int, taken: int, most: int) -> None:
    monkeypatch.setattr(read_buffers, "PIECE_BYTES", piece_bytes)
    data = pattern(50_000)
    body = DeclaredBody(len(data))
    body.take(data[:taken])
    assert read_into(body, data[taken:] + b"NEXT", most) == b"NEXT"
    assert body.left == 0 and body.whole() == data


def test_a_read_into_the_body_never_reaches_its_end() -> None:
    body = DeclaredBody(100_000)
    body.take(pattern(100))
    free = body.free()
    # The end (and so whatever follows it in the socket) is read into the shared buffer, as the parser would see it.
    assert free is not None and len(free) == 100_000 - 100 - read_buffers.HEAD_READ_BYTES
    body.filled(len(free))
    assert body.free() is None and body.left == read_buffers.HEAD_READ_BYTES


def test_a_body_that_fits_one_piece_is_the_bytes_read_into_no_copy() -> None:
    data = pattern(300_000)
    body = DeclaredBody(len(data))
    read_into(body, data, 65536)
    whole = body.whole()
    assert whole == data and whole is body.whole()  # the piece itself, not a join or a copy of it


def test_a_dropped_body_is_counted_to_its_end_and_kept_nowhere() -> None:
    body = DeclaredBody(200_000)
    body.take(pattern(1000))
    body.drop()
    assert body.free() is None
    assert read_into(body, pattern(199_000) + b"NEXT", 65536) == b"NEXT"
    assert body.left == 0 and body.whole() == b""

"""Framing for the local IPC channel between the HTTP front end and the engine core process.

A frame is ``<u32 header length><u32 payload length><orjson header><raw payload>``. Token ids cross as raw
little-endian int32 payloads (``ndarray.data``), never as JSON lists or pickles: nothing from the channel is
ever unpickled.
"""

from __future__ import annotations

import asyncio
import socket
import struct
from typing import Any

import orjson

_LENGTHS = struct.Struct("<II")
MAX_HEADER_BYTES = 64 * 1024 * 1024  # the ready frame carries the tokenizer vocabulary (~2 MB for SmolLM2)

Header = dict[str, Any]


class ChannelClosed(Exception):
    """The other side of the channel went away."""


def encode_frame(header: Header, payload: bytes | memoryview = b"") -> list[bytes | memoryview]:
    head = orjson.dumps(header)
    raw = memoryview(payload).cast("B")  # an int32 array's buffer counts in bytes here, not elements
    return [_LENGTHS.pack(len(head), raw.nbytes), head, raw]


async def read_frame(reader: asyncio.StreamReader) -> tuple[Header, bytes]:
    try:
        lengths = await reader.readexactly(_LENGTHS.size)
        header_len, payload_len = _LENGTHS.unpack(lengths)
        if header_len > MAX_HEADER_BYTES:
            raise ChannelClosed(f"frame header of {header_len} bytes is too large")
        header = orjson.loads(await reader.readexactly(header_len))
        payload = await reader.readexactly(payload_len) if payload_len else b""
    except (asyncio.IncompleteReadError, ConnectionError) as exc:
        raise ChannelClosed("the engine channel closed") from exc
    return header, payload


def _recv_exactly(sock: socket.socket, size: int) -> bytes:
    buffer = bytearray(size)
    view = memoryview(buffer)
    received = 0
    while received < size:
        count = sock.recv_into(view[received:], size - received)
        if count == 0:
            raise ChannelClosed("the front end closed the channel")
        received += count
    return bytes(buffer)


def read_frame_blocking(sock: socket.socket) -> tuple[Header, bytes]:
    header_len, payload_len = _LENGTHS.unpack(_recv_exactly(sock, _LENGTHS.size))
    if header_len > MAX_HEADER_BYTES:
        raise ChannelClosed(f"frame header of {header_len} bytes is too large")
    header = orjson.loads(_recv_exactly(sock, header_len))
    payload = _recv_exactly(sock, payload_len) if payload_len else b""
    return header, payload


def send_frame_blocking(sock: socket.socket, header: Header, payload: bytes | memoryview = b"") -> None:
    for part in encode_frame(header, payload):
        if len(part):
            sock.sendall(part)

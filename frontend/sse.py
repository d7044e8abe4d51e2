"""Server-sent event framing, shared by the workers (producing) and the orchestrator (relaying)."""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import Any, Final

import orjson

DONE_FRAME: Final = b"data: [DONE]\n\n"
SSE_MEDIA_TYPE: Final = "text/event-stream"
SSE_HEADERS: Final = {"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}
# The same headers as starlette's StreamingResponse writes them for SSE_MEDIA_TYPE (ASGI's raw form), for a
# stream served without it (frontend.asgi_fast_path).
SSE_RAW_HEADERS: Final = [(b"cache-control", b"no-cache"), (b"x-accel-buffering", b"no"),
                          (b"content-type", b"text/event-stream; charset=utf-8")]


def data_frame(payload: dict[str, Any]) -> bytes:
    """``data: {...}\\n\\n`` as chat and completion streams use."""
    return b"data: " + orjson.dumps(payload) + b"\n\n"


def event_frame(event_type: str, payload: dict[str, Any]) -> bytes:
    """``event: type\\ndata: {...}\\n\\n`` as the Responses API stream uses."""
    return b"event: " + event_type.encode() + b"\ndata: " + orjson.dumps(payload) + b"\n\n"


class FrameSplitter:
    """Splits a byte stream into complete SSE frames (separated by a blank line), whatever the chunking."""

    def __init__(self) -> None:
        self._buffer = b""

    def feed(self, chunk: bytes) -> list[bytes]:
        self._buffer += chunk
        if b"\n\n" not in self._buffer:
            return []
        *frames, self._buffer = self._buffer.split(b"\n\n")
        return [frame + b"\n\n" for frame in frames]


async def close_frames(frames: AsyncIterator[bytes]) -> None:
    """Close ``frames`` if it can be closed (an async generator): what every wrapper that relays a stream owes the
    stream it wraps, however the relay ended."""
    aclose = getattr(frames, "aclose", None)
    if aclose is not None:
        await aclose()

"""uvicorn's cycle for a request served through ASGI on the guarded protocol (``entrypoints/http_protocol.py``),
its ``send`` made to keep two rules."""

from __future__ import annotations

import asyncio
from typing import Any

from uvicorn.protocols.http.httptools_impl import RequestResponseCycle

from entrypoints.client_limits import ClientCutoffs


class GuardedCycle(RequestResponseCycle):
    """uvicorn's cycle for a request served through ASGI, with ``send`` made to keep two rules: an answer that
    starts before the request's body is in closes the connection after it (``close_unread``), and an answer to an
    HTTP/1.0 client of no declared length is its body up to the connection's end, not chunks."""

    connection: ClientCutoffs
    unframed = False  # an HTTP/1.0 answer of no declared length: sent as it is, the connection's end its end

    async def send(self, message: Any) -> None:
        if not self.response_started and message["type"] == "http.response.start":
            if self.more_body:
                self.keep_alive = False  # uvicorn writes ``connection: close``, then closes: through close_unread
                self.transport = _ClosingUnread(self.transport, self.connection)  # type: ignore[assignment]
            if self.scope["http_version"] == "1.0" and not any(
                    name.lower() in _FRAMING for name, _ in message.get("headers", ())):
                self.chunked_encoding = False
                self.unframed = True
        elif self.unframed and message["type"] == "http.response.body":
            self.expected_content_length = len(message.get("body", b""))  # what uvicorn counts down to 0
        await super().send(message)


_FRAMING = (b"content-length", b"transfer-encoding")


class _ClosingUnread:
    """A cycle's transport whose ``close`` is the protocol's ``close_unread``."""

    __slots__ = ("_connection", "_transport")

    def __init__(self, transport: asyncio.Transport, connection: ClientCutoffs) -> None:
        self._transport = transport
        self._connection = connection

    def close(self) -> None:
        self._connection.close_unread()

    def __getattr__(self, name: str) -> Any:
        return getattr(self._transport, name)

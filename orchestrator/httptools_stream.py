"""The default client's streamed answer (``OpenStream``): a connection whose answer's headers have arrived, its body
read as it comes (``chunks``), pushed (``pipe``) or whole (``read``); given back to the pool at its end, closed if
cut short or dropped (that is what tells GEN to stop)."""

from __future__ import annotations

import contextlib
from collections.abc import AsyncGenerator, Awaitable, Callable
from typing import TYPE_CHECKING

from orchestrator.worker_connection import WorkerConnection

if TYPE_CHECKING:
    from orchestrator.httptools_transport import HttptoolsTransport


class HttptoolsStream:
    """``OpenStream`` over a connection whose answer's headers have arrived."""

    def __init__(self, transport: HttptoolsTransport, connection: WorkerConnection) -> None:
        self._transport = transport
        self._connection: WorkerConnection | None = connection
        self._status = connection.status

    @property
    def status_code(self) -> int:
        return self._status

    async def chunks(self) -> AsyncGenerator[bytes, None]:
        try:
            connection = self._connection
            if connection is None:
                return
            while True:
                chunk = await connection.next_chunk()
                if chunk is None:
                    return
                yield chunk
        finally:
            await self.aclose()

    async def pipe(self, take: Callable[[bytes], bool], drained: Callable[[], Awaitable[object]]) -> None:
        try:
            if self._connection is not None:
                await self._connection.pipe(take, drained)
        finally:
            await self.aclose()

    async def read(self) -> bytes:
        try:
            if self._connection is None:
                return b""
            return await self._connection.whole_body()
        finally:
            await self.aclose()

    def __del__(self) -> None:
        # A stream dropped without ``aclose`` (its relay generator never started, say, because the client left
        # while the answer's first line was being sent) closes its connection when it is collected, as aiohttp's
        # responses do: the worker then stops, and the pool slot is free again. (``__del__``, not a
        # ``weakref.finalize``: that costs a registration and a detach on every stream.)
        connection, self._connection = self._connection, None
        if connection is not None:
            with contextlib.suppress(RuntimeError):  # collected after its event loop closed: nothing left to tell
                self._transport._forget(connection)

    async def aclose(self) -> None:
        connection, self._connection = self._connection, None
        if connection is None:
            return
        if connection.complete:
            self._transport._give_back(connection)
        else:
            # Cut short (the client left, or a failure): closing the connection is what tells the worker to stop.
            self._transport._forget(connection)

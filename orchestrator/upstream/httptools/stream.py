"""An answer of the default client whose status has arrived and whose body is still coming (``OpenStream``).

Its end decides its connection's fate: read to the end, the connection goes back to the pool; cut short or dropped,
it is closed, which is what tells GEN to stop. The pool hands the stream those two actions, not itself."""

from __future__ import annotations

import contextlib
from collections.abc import AsyncGenerator, Awaitable, Callable

from orchestrator.upstream.httptools.connection import WorkerConnection

# What the pool does with a connection at a stream's end: take it back, or close it and free its slot.
ConnectionEnd = Callable[[WorkerConnection], None]


class HttptoolsStream:
    """``OpenStream`` over a connection whose answer's headers have arrived."""

    def __init__(self, connection: WorkerConnection, give_back: ConnectionEnd, forget: ConnectionEnd) -> None:
        self._give_back = give_back
        self._forget = forget
        self._connection: WorkerConnection | None = connection
        self._status = connection.status
        self._prompt_report = connection.prompt_report

    @property
    def status_code(self) -> int:
        return self._status

    @property
    def prompt_report(self) -> bytes | None:
        return self._prompt_report

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

    async def push(self, take: Callable[[bytes], bool], drained: Callable[[], Awaitable[object]]) -> None:
        try:
            if self._connection is not None:
                await self._connection.push(take, drained)
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
        # A stream dropped without ``aclose`` (its relay never started: the client left while the answer's first
        # line was being sent) closes its connection when collected, as aiohttp's responses do, so the worker stops
        # and the slot is free. (``__del__``, not ``weakref.finalize``: that costs a registration per stream.)
        connection, self._connection = self._connection, None
        if connection is not None:
            with contextlib.suppress(RuntimeError):  # collected after its event loop closed: nothing left to tell
                self._forget(connection)

    async def aclose(self) -> None:
        connection, self._connection = self._connection, None
        if connection is None:
            return
        if connection.complete:
            self._give_back(connection)
        else:
            # Cut short (the client left, or a failure): closing the connection is what tells the worker to stop.
            self._forget(connection)

"""A raw asyncio worker that misbehaves on purpose, and a default-client transport to it: what the tests of the
httptools transport, its connection and its stream share."""


from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator, Awaitable, Callable

from orchestrator.upstream.base import WorkerTimeouts
from orchestrator.upstream.httptools.pool import HttptoolsTransport

# How a raw worker answers: given the worker (its counters, ``read_request``) and one client connection.
Handler = Callable[["RawWorker", asyncio.StreamReader, asyncio.StreamWriter], Awaitable[None]]


class RawWorker:
    """A TCP server answering each request with ``handler``; counts connections and requests."""

    def __init__(self, handler: Handler) -> None:
        self.handler = handler
        self.connections = 0
        self.requests: list[bytes] = []
        self.open_now = 0
        self.most_open = 0
        self.closed = asyncio.Event()  # set whenever a client connection ends
        self.url = ""

    async def serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.connections += 1
        self.open_now += 1
        self.most_open = max(self.most_open, self.open_now)
        try:
            await self.handler(self, reader, writer)
        except (ConnectionError, asyncio.IncompleteReadError, asyncio.CancelledError):
            pass  # the client went, or the test is over
        finally:
            self.open_now -= 1
            writer.close()
            self.closed.set()

    async def read_request(self, reader: asyncio.StreamReader) -> bytes | None:
        """One request, head and body (Content-Length), or None at the end of the connection."""
        try:
            head = await reader.readuntil(b"\r\n\r\n")
        except asyncio.IncompleteReadError:
            return None
        length = next((int(line.split(b":")[1]) for line in head.split(b"\r\n")
                       if line.lower().startswith(b"content-length:")), 0)
        body = await reader.readexactly(length)
        self.requests.append(head + body)
        return body


@contextlib.asynccontextmanager
async def client_of(handler: Handler, timeouts: WorkerTimeouts | None = None
                    ) -> AsyncIterator[tuple[RawWorker, HttptoolsTransport]]:
    """A raw worker answering with ``handler`` on loopback, and a transport to it; both closed after."""
    worker = RawWorker(handler)
    server = await asyncio.start_server(worker.serve, "127.0.0.1", 0)
    worker.url = f"http://127.0.0.1:{server.sockets[0].getsockname()[1]}"
    transport = HttptoolsTransport(worker.url, timeouts or WorkerTimeouts())
    try:
        yield worker, transport
    finally:
        await transport.aclose()
        server.close()
        await server.wait_closed()


def answer(body: bytes, *, close: bool = False) -> bytes:
    connection = b"Connection: close\r\n" if close else b""
    return (b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\n" + connection
            + b"Content-Length: " + str(len(body)).encode() + b"\r\n\r\n" + body)


def answer_after(release: asyncio.Event) -> Handler:
    """A keep-alive echo that holds every answer until ``release`` is set."""
    async def slow(worker: RawWorker, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        while (body := await worker.read_request(reader)) is not None:
            await release.wait()
            writer.write(answer(body))
            await writer.drain()

    return slow


async def echo_keep_alive(worker: RawWorker, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
    while (body := await worker.read_request(reader)) is not None:
        writer.write(answer(body))
        await writer.drain()

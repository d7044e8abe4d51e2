"""The httptools transport's streamed answer: abandoned or dropped without ``aclose``, it closes its connection so
that the worker stops."""


from __future__ import annotations

import asyncio
import gc

from tests.orchestrator.upstream.httptools.raw_worker import RawWorker, client_of
from tests.waiting import DEFAULT_TIMEOUT_S


async def test_an_abandoned_stream_closes_its_connection_so_the_worker_stops() -> None:
    async def endless(worker: RawWorker, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await worker.read_request(reader)
        writer.write(b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n")
        while True:
            writer.write(b"5\r\nframe\r\n")
            await writer.drain()
            await asyncio.sleep(0.01)

    async with client_of(endless) as (worker, transport):
        stream = await transport.open_stream("/x", b"{}")
        chunks = stream.chunks()
        assert (await anext(chunks)).startswith(b"frame")
        await chunks.aclose()
        await asyncio.wait_for(worker.closed.wait(), DEFAULT_TIMEOUT_S)
        assert worker.open_now == 0
        assert not transport._idle  # never pooled half read


async def test_a_stream_dropped_without_aclose_closes_its_connection() -> None:
    """A relay generator that never started never closes its stream: the stream, collected, closes it."""
    async def endless(worker: RawWorker, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await worker.read_request(reader)
        writer.write(b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n5\r\nframe\r\n")
        await writer.drain()
        await reader.read()  # until the client hangs up

    async with client_of(endless) as (worker, transport):
        stream = await transport.open_stream("/x", b"{}")
        assert len(transport._open) == 1
        del stream
        gc.collect()
        assert not transport._open  # the slot is free
        await asyncio.wait_for(worker.closed.wait(), DEFAULT_TIMEOUT_S)  # and the worker saw the hang-up

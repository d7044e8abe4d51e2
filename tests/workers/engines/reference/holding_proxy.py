"""A real TCP proxy in front of a worker that forwards GETs (health, models, metrics) and holds every POST open,
unanswered, until its client goes away: a GEN worker that has accepted the request and not yet taken the hand-off.
"""

from __future__ import annotations

import asyncio
import contextlib

from tests.tcp_proxy import TcpProxy


async def _read_message(reader: asyncio.StreamReader) -> bytes:
    head = await reader.readuntil(b"\r\n\r\n")
    length = 0
    for line in head.split(b"\r\n")[1:]:
        name, _, value = line.partition(b":")
        if name.strip().lower() == b"content-length":
            length = int(value)
    return head + (await reader.readexactly(length) if length else b"")


class HoldingProxy(TcpProxy):
    def __init__(self, target_url: str) -> None:
        super().__init__(target_url)
        self.held = 0  # POSTs held open now
        self.let_go = 0  # held POSTs whose client went away

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            while True:
                request = await _read_message(reader)
                if request.startswith(b"POST "):
                    self.held += 1
                    try:
                        await reader.read()  # nothing is answered: wait for the client to leave
                    finally:
                        self.held -= 1
                        self.let_go += 1
                    return
                upstream_reader, upstream_writer = await asyncio.open_connection(*self.target)
                upstream_writer.write(request)
                writer.write(await _read_message(upstream_reader))
                upstream_writer.close()
                await writer.drain()
        except (asyncio.IncompleteReadError, ConnectionError):
            pass
        finally:
            with contextlib.suppress(ConnectionError):
                writer.close()

"""A real TCP proxy in front of a GEN worker that, when armed, passes the next POST's answer on only up to a given
number of SSE frames with data (the frames of token ids alone, which the client never sees, are not counted) and
holds the rest: the client has exactly those frames when the test then kills the worker, whatever the worker had
already written. Everything else is piped through as it comes.

Armed with 0 frames it passes nothing of the answer (not even its head): a whole answer lost with its worker.
"""

from __future__ import annotations

import asyncio
import contextlib
import threading


class CuttingProxy:
    def __init__(self, target_url: str) -> None:
        host, port = target_url.removeprefix("http://").split(":")
        self.target = (host, int(port))
        self.loop = asyncio.new_event_loop()
        self._server: asyncio.Server | None = None
        self._thread = threading.Thread(target=self.loop.run_forever, daemon=True)
        self._armed: int | None = None  # frames the next POST's answer may pass on
        self.holding = threading.Event()  # an armed answer reached its cut: the rest is held
        self.cut_answers = 0
        self.armed_posts = 0  # POSTs whose answer was to be cut

    def start(self) -> str:
        self._thread.start()
        self._server = asyncio.run_coroutine_threadsafe(
            asyncio.start_server(self._serve, "127.0.0.1", 0), self.loop).result(timeout=10)
        return f"http://127.0.0.1:{self._server.sockets[0].getsockname()[1]}"

    def stop(self) -> None:
        async def close() -> None:
            if self._server is not None:
                self._server.close()

        asyncio.run_coroutine_threadsafe(close(), self.loop).result(timeout=10)
        self.loop.call_soon_threadsafe(self.loop.stop)
        self._thread.join(timeout=10)

    def arm(self, frames: int) -> None:
        self.holding.clear()
        self._armed = frames

    def disarm(self) -> None:
        self._armed = None

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            up_reader, up_writer = await asyncio.open_connection(*self.target)
        except OSError:
            writer.transport.abort()
            return
        cut: list[int | None] = [None]  # this connection's answer in flight: frames it may pass on

        async def upstream() -> None:
            while data := await reader.read(65536):
                if self._armed is not None and b"POST /v1/" in data:
                    cut[0], self._armed = self._armed, None
                    self.armed_posts += 1
                up_writer.write(data)
                await up_writer.drain()
            up_writer.close()

        async def downstream() -> None:
            passed = 0
            frame = b""  # the frame begun in an earlier read
            while data := await up_reader.read(65536):
                limit = cut[0]
                if limit is None:
                    writer.write(data)
                    await writer.drain()
                    continue
                if self.holding.is_set():
                    continue  # past the cut: held until the worker dies
                keep = 0
                while passed < limit:
                    end = data.find(b"\n\n", keep)
                    if end < 0:
                        frame += data[keep:]
                        keep = len(data)
                        break
                    whole, frame = frame + data[keep:end], b""
                    keep, passed = end + 2, passed + (b"data: " in whole)
                if limit == 0 or passed >= limit:
                    writer.write(data[:keep] if limit else b"")
                    await writer.drain()
                    self.cut_answers += 1
                    self.holding.set()
                    continue
                writer.write(data)
                await writer.drain()
            # The worker is gone (or ended its connection): so is this one, abruptly when an answer was cut.
            if cut[0] is not None:
                writer.transport.abort()
            else:
                writer.close()

        tasks = [asyncio.ensure_future(upstream()), asyncio.ensure_future(downstream())]
        try:
            await asyncio.wait(tasks, return_when=asyncio.FIRST_COMPLETED)
            if tasks[1].done():
                tasks[0].cancel()
            else:
                await tasks[1]
        except (ConnectionError, OSError):
            pass
        finally:
            for task in tasks:
                task.cancel()
            with contextlib.suppress(ConnectionError, OSError):
                writer.transport.abort() if cut[0] is not None else writer.close()
                up_writer.close()

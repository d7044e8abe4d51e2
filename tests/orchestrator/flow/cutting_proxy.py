"""A real TCP proxy in front of a GEN worker that, when armed, passes the next POST's answer on only up to a given
number of SSE frames with data (the frames of token ids alone, which the client never sees, are not counted) and
holds the rest: the client has exactly those frames when the test then kills the worker, whatever the worker had
already written. Everything else is piped through as it comes.

Armed with 0 frames it passes nothing of the answer (not even its head): a whole answer lost with its worker.

Armed with ``then`` (bytes: GEN's own error event, say) it writes those in place of the rest of the answer and ends
the answer well, its worker living on: an engine that fails mid-answer, as the orchestrator sees it over HTTP. The
answer's chunked body is read frame by frame for it, and its head says ``connection: close``, since the worker's own
answer is cut off upstream.
"""

from __future__ import annotations

import asyncio
import contextlib
import threading

from tests.tcp_proxy import TcpProxy


class CuttingProxy(TcpProxy):
    def __init__(self, target_url: str) -> None:
        super().__init__(target_url)
        self._armed: int | None = None  # frames the next POST's answer may pass on
        self._then: bytes | None = None  # what the armed answer ends with in place of the rest (None: held)
        self._disarming: tuple[CuttingProxy, ...] = ()  # proxies disarmed as the armed answer is cut
        self.holding = threading.Event()  # an armed answer reached its cut: the rest is held
        self.cut_answers = 0
        self.armed_posts = 0  # POSTs whose answer was to be cut

    def arm(self, frames: int, then: bytes | None = None, disarming: tuple[CuttingProxy, ...] = ()) -> None:
        """Cut the next POST's answer after ``frames`` frames with data; ``then``: end it with these bytes instead of
        holding the rest; ``disarming``: proxies disarmed at the cut, before a byte of ``then`` is written (so that
        the request's continuation on another worker runs in full)."""
        self.holding.clear()
        self._armed, self._then, self._disarming = frames, then, disarming

    def disarm(self) -> None:
        self._armed = None

    async def _end_instead(self, answer: _ChunkedAnswer, data: bytes, limit: int, then: bytes,
                           disarming: tuple[CuttingProxy, ...], writer: asyncio.StreamWriter) -> bool:
        """Pass the answer's frames on (re-chunked) up to the cut, then ``then`` and the body's end: True once
        the answer is ended so."""
        frames = answer.feed(data)
        if answer.head is not None and not answer.head_sent:
            writer.write(answer.head_closing())
            answer.head_sent = True
        out = b""
        for frame in frames:
            if answer.passed >= limit:
                break
            out += frame
            answer.passed += b"data: " in frame
        if out:
            writer.write(b"%x\r\n%s\r\n" % (len(out), out))
        if answer.passed < limit and not answer.ended:
            await writer.drain()
            return False
        for other in disarming:
            other.disarm()
        self.cut_answers += 1
        self.holding.set()
        writer.write(b"%x\r\n%s\r\n0\r\n\r\n" % (len(then), then))
        await writer.drain()
        writer.close()
        return True

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            up_reader, up_writer = await asyncio.open_connection(*self.target)
        except OSError:
            writer.transport.abort()
            return
        cut: list[int | None] = [None]  # this connection's answer in flight: frames it may pass on
        then: list[bytes | None] = [None]  # and what it ends with in place of the rest
        disarming: list[tuple[CuttingProxy, ...]] = [()]

        async def upstream() -> None:
            while data := await reader.read(65536):
                if self._armed is not None and b"POST /v1/" in data:
                    cut[0], self._armed = self._armed, None
                    then[0], disarming[0] = self._then, self._disarming
                    self.armed_posts += 1
                up_writer.write(data)
                await up_writer.drain()
            up_writer.close()

        async def downstream() -> None:
            passed = 0
            frame = b""  # the frame begun in an earlier read
            answer = _ChunkedAnswer()
            while data := await up_reader.read(65536):
                limit = cut[0]
                if limit is not None and then[0] is not None:
                    if await self._end_instead(answer, data, limit, then[0], disarming[0], writer):
                        return
                    continue
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
                # (An answer ended in place of the rest was ended well: closed, never reset, so that nothing of it
                # is lost on the way.)
                writer.transport.abort() if cut[0] is not None and then[0] is None else writer.close()
                up_writer.close()


class _ChunkedAnswer:
    """An HTTP/1.1 answer with a chunked body (a worker's stream), read as it comes: its head, then its SSE frames."""

    def __init__(self) -> None:
        self.buffer = b""
        self.head: bytes | None = None
        self.head_sent = False
        self.body = b""  # de-chunked, not yet a whole frame
        self.passed = 0  # frames with data passed on
        self.ended = False

    def feed(self, data: bytes) -> list[bytes]:
        """The whole frames ``data`` completes."""
        self.buffer += data
        if self.head is None:
            end = self.buffer.find(b"\r\n\r\n")
            if end < 0:
                return []
            self.head, self.buffer = self.buffer[:end], self.buffer[end + 4:]
            assert b"transfer-encoding: chunked" in self.head.lower(), self.head  # a stream
        while not self.ended and (line_end := self.buffer.find(b"\r\n")) >= 0:
            size = int(self.buffer[:line_end].split(b";")[0], 16)
            if len(self.buffer) < line_end + 2 + size + 2:
                break
            self.body += self.buffer[line_end + 2:line_end + 2 + size]
            self.buffer = self.buffer[line_end + 2 + size + 2:]
            self.ended = size == 0
        frames = []
        while (end := self.body.find(b"\n\n")) >= 0:
            frames.append(self.body[:end + 2])
            self.body = self.body[end + 2:]
        return frames

    def head_closing(self) -> bytes:
        """The head, saying ``connection: close``: the client must not send another request on this connection."""
        assert self.head is not None
        lines = [line for line in self.head.split(b"\r\n") if not line.lower().startswith(b"connection:")]
        return b"\r\n".join([*lines, b"connection: close"]) + b"\r\n\r\n"

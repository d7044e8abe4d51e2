"""The streaming relay: GEN's stream to the client, byte for byte, ended with an error event if GEN's breaks.

The frames are only watched for the stream's end marker, so a GEN that died mid-way still leaves the client a
well-formed stream that says what went wrong. Served bare, the relay is pushed (``RelayedStream.push``): each piece
is written to the client from the callback that read it from GEN, waking no coroutine; a wrapper that reads the
pieces (tracing, a tenant's token count, a kept Responses answer) iterates them (``RelayedStream.frames``). Past a
final end marker GEN has ``TAIL_S`` to end its body, so a GEN that stalls there cannot hold the client's
connection until the worker read timeout; its connection is then closed.

With a ``StreamMigration`` (``orchestrator.flow.migration``) a stream that breaks before its final end marker is
not ended with an error event but continued on another GEN worker: every piece goes through the migration's
``feed`` first (whole frames only, its token ids stripped), and its ``resume`` gives the stream to relay next.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import AsyncGenerator, Callable
from contextlib import aclosing
from typing import Protocol

import orjson

from frontend.asgi_fast_path import ChunkWriter, Drained, LastChunkWriter
from frontend.errors import UpstreamError
from frontend.metrics import Metrics
from frontend.openai_output import Endpoint, stream_error_frames
from frontend.sse import DONE_FRAME
from orchestrator.member import PoolMember
from orchestrator.upstream.base import OpenStream

logger = logging.getLogger(__name__)

_ERROR_EVENT = b"event: error"  # an end marker that another engine's Responses stream may follow with more events
_STREAM_ENDS = (DONE_FRAME, b"event: response.completed", b"event: response.incomplete", _ERROR_EVENT)
TAIL_S = 2.0  # how long GEN's stream is awaited past its final end marker (see above)


class _Broke(Exception):
    """A stream that broke (``StreamMigration.broken``) while GEN writes on: it is read no further."""


class StreamMigration(Protocol):
    """What the relay asks of a stream that may move to another GEN worker (``orchestrator.flow.migration``)."""

    def feed(self, chunk: bytes) -> bytes:
        """What of GEN's ``chunk`` the client gets."""
        ...

    @property
    def broken(self) -> str | None:
        """GEN's own error message, once it wrote an error event (held back from the client)."""
        ...

    async def resume(self, failed: PoolMember, reason: str) -> tuple[OpenStream, PoolMember] | None:
        """The stream that goes on where the client is, on another worker; None where there is none."""
        ...


class _Watch:
    """What the relay watches in the bytes it passes on: time to first token, the gaps between pieces, and its
    frames' end marker (and the last whole frame, which a Responses error event numbers on from). It looks at a
    piece's tail only: the frames themselves are split only when a piece holds an end marker, which is at most
    once a stream. ``on_end`` is told once GEN has sent the end marker (it is handed on in the same piece);
    ``final`` says that marker is one nothing may follow (``[DONE]``, a Responses stream's completion)."""

    __slots__ = ("final", "last", "metrics", "on_end", "pending", "seen_end", "started", "whole")

    def __init__(self, started: float, metrics: Metrics, on_end: Callable[[], None] | None = None) -> None:
        self.started = started
        self.metrics = metrics
        self.on_end = on_end
        self.last: float | None = None
        self.pending = b""  # the frame begun and not yet ended
        self.whole = b""  # the last piece that ended a frame, up to that end (``last_frame`` is cut from it)
        self.seen_end = False
        self.final = False

    @property
    def last_frame(self) -> bytes | None:
        """The last whole frame passed on: cut when asked (once, for an error event), not from every piece."""
        whole = self.whole
        if not whole:
            return None
        begins = whole.rfind(b"\n\n", 0, len(whole) - 2) + 2  # 0 - 1 + 2 when the piece holds one frame
        return whole[begins if begins > 1 else 0:]

    def feed(self, chunk: bytes) -> None:
        now = time.perf_counter()
        last = self.last
        if last is None:
            self.metrics.time_to_first_token.observe(now - self.started)
        else:
            self.metrics.inter_token_latency.observe(now - last)
        self.last = now
        data = self.pending + chunk if self.pending else chunk
        ends = data.rfind(b"\n\n") + 2
        if ends < 2:
            self.pending = data
            return
        whole = self.whole = data[:ends]  # (the piece itself, not a copy, when it ends with its last frame)
        self.pending = data[ends:]
        # Every end marker holds one of the two hints; the exact markers are looked for only in a piece with one
        # (a chat or completions stream's only one is its last).
        if not self.seen_end and (b"[DONE]" in whole or b"event: " in whole) and (
                DONE_FRAME in whole or b"event: response.completed" in whole
                or b"event: response.incomplete" in whole or _ERROR_EVENT in whole):
            ends_found = [frame for frame in whole.split(b"\n\n")[:-1]
                          if (frame + b"\n\n").startswith(_STREAM_ENDS)]
            self.seen_end = bool(ends_found)
            self.final = any(not frame.startswith(_ERROR_EVENT) for frame in ends_found)
            if self.seen_end and self.on_end is not None:
                self.on_end()


class RelayedStream:
    """GEN's 200 stream, relayed to the client byte for byte: pushed (``push``) or iterated (``frames``), closed
    however the relay ends, and ended with an error event if GEN's stream broke. ``on_end`` is told when GEN has
    sent the stream's end marker, which the relay hands on to the client: the answer is whole, even if the client
    then hangs up before GEN's last bytes (the end of its chunked body) are read, as the openai SDK does right
    after ``[DONE]``."""

    __slots__ = ("endpoint", "member", "metrics", "migration", "on_end", "prompt_tokens", "started", "stream",
                 "tail_s")

    def __init__(self, stream: OpenStream, member: PoolMember, prompt_tokens: int, endpoint: Endpoint,
                 started: float, metrics: Metrics, on_end: Callable[[], None] | None = None,
                 tail_s: float = TAIL_S, migration: StreamMigration | None = None) -> None:
        self.stream = stream  # GEN's stream being relayed: another one's after a migration
        self.migration = migration
        self.on_end = on_end
        self.tail_s = tail_s
        self.member = member
        self.prompt_tokens = prompt_tokens
        self.endpoint = endpoint
        self.started = started  # when the client's request arrived (for time to first token)
        self.metrics = metrics

    def also_on_end(self, callback: Callable[[], None]) -> None:
        """Tell ``callback`` too when GEN has sent the end marker (before the relay starts)."""
        first = self.on_end
        if first is None:
            self.on_end = callback
            return

        def both() -> None:
            first()
            callback()
        self.on_end = both

    async def aclose(self) -> None:
        """Close the GEN stream being relayed (idempotent)."""
        await self.stream.aclose()

    async def push(self, write: ChunkWriter, drained: Drained, finish: LastChunkWriter) -> None:
        """Each piece to ``write`` as it is read, the one that holds a final end marker (``_Watch.final``) to
        ``finish`` (which ends the client's answer with it, in one send) and nothing after it; a stream that ends
        without one ends with the error event, as ``frames``. Past the final marker GEN has ``tail_s`` to end."""
        watch = _Watch(self.started, self.metrics, self.on_end)
        loop = asyncio.get_running_loop()
        migration = self.migration
        tail = asyncio.timeout(None)  # no deadline until the final marker has passed

        async def paused() -> None:
            if migration is not None and migration.broken is not None:
                raise _Broke  # nothing more of this stream reaches the client: it is read no further
            await drained()

        def take(chunk: bytes) -> bool:
            if watch.final:
                return True  # past the end marker: nothing for the client
            if migration is not None:
                chunk = migration.feed(chunk)
                if not chunk:
                    return migration.broken is None  # (broken: reading pauses, and ``paused`` ends it)
            watch.feed(chunk)
            if watch.final:
                finish(chunk)  # the client's answer ends with this piece, in its send
                tail.reschedule(loop.time() + self.tail_s)
                return True
            return write(chunk)

        while True:
            failure: UpstreamError | None = None
            tail = asyncio.timeout(None)
            with self.member.carrying(self.prompt_tokens, 0):  # its first byte came: the prompt is computed
                try:
                    async with tail:
                        await self.stream.push(take, paused)
                except UpstreamError as exc:
                    failure = exc
                except _Broke:
                    pass  # (the migration says why)
                except TimeoutError:
                    if not tail.expired():
                        raise
                    self._stalled()
                finally:
                    await self.stream.aclose()
            if not watch.final and migration is not None:
                failure = await self._migrate(migration, failure)
                if failure is None:
                    continue  # relayed on from the continuation's stream
            break
        ending = self._ending(watch, failure)  # (which logs a break, after the end marker too)
        if watch.final:
            return  # the client's answer was whole, however GEN's stream went on after its end marker
        for frame in ending:
            if not write(frame):
                await drained()

    async def frames(self) -> AsyncGenerator[bytes, None]:
        watch = _Watch(self.started, self.metrics, self.on_end)
        migration = self.migration
        while True:
            failure: UpstreamError | None = None
            async with aclosing(self._frames_of_one(watch)) as pieces:
                async for piece in pieces:
                    if isinstance(piece, UpstreamError):
                        failure = piece
                        break
                    yield piece
            if not watch.final and migration is not None:
                failure = await self._migrate(migration, failure)
                if failure is None:
                    continue
            break
        for frame in self._ending(watch, failure):
            yield frame

    async def _frames_of_one(self, watch: _Watch) -> AsyncGenerator[bytes | UpstreamError, None]:
        """The pieces of the GEN stream being relayed, then the failure that ended it, if one did."""
        migration = self.migration
        with self.member.carrying(self.prompt_tokens, 0):
            try:
                async with aclosing(self.stream.chunks()) as chunks:
                    async for chunk in chunks:
                        if migration is not None:
                            chunk = migration.feed(chunk)
                            if not chunk:
                                if migration.broken is not None:
                                    break  # nothing more of this stream reaches the client: read no further
                                continue
                        watch.feed(chunk)
                        yield chunk
                        if watch.final:
                            break
                    if watch.final:  # what GEN still sends is passed on as before, for ``tail_s`` at most
                        due = asyncio.get_running_loop().time() + self.tail_s
                        while True:
                            try:
                                async with asyncio.timeout_at(due):  # (around the read only, never a yield)
                                    chunk = await anext(chunks)
                            except StopAsyncIteration:
                                break
                            except TimeoutError:
                                self._stalled()
                                break
                            yield chunk
            except UpstreamError as exc:
                yield exc
            finally:
                await self.stream.aclose()

    async def _migrate(self, migration: StreamMigration, failure: UpstreamError | None) -> UpstreamError | None:
        """The GEN stream broke before its final end marker: relay on from a continuation (None), or the failure
        that ends the client's stream."""
        broken = migration.broken
        reason = failure.message if failure is not None else broken or "its stream ended before it was complete"
        resumed = await migration.resume(self.member, reason)
        if resumed is None:
            return failure or UpstreamError(broken or "the GEN stream ended before it was complete")
        self.stream, self.member = resumed
        return None

    def _stalled(self) -> None:
        logger.warning("GEN worker %s did not end its stream within %g s of its end marker: its connection is "
                       "closed (the client's answer was whole)", self.member.url, self.tail_s)

    def _ending(self, watch: _Watch, broke: UpstreamError | None) -> list[bytes]:
        """Nothing for a stream that ended well; else the error event (logged) that tells the client why not."""
        if broke is not None:
            failure = UpstreamError(f"the GEN stream broke: {broke.message}")
        elif not watch.seen_end:
            failure = UpstreamError("the GEN stream ended before it was complete")
        else:
            return []
        logger.warning("%s (GEN worker %s)", failure.message, self.member.url)
        return list(stream_error_frames(self.endpoint, failure, next_sequence_number(watch.last_frame)))


def relay_stream(stream: OpenStream, member: PoolMember, prompt_tokens: int, endpoint: Endpoint, started: float,
                 metrics: Metrics) -> AsyncGenerator[bytes, None]:
    """``RelayedStream(...).frames()``: GEN's stream as an iterator."""
    return RelayedStream(stream, member, prompt_tokens, endpoint, started, metrics).frames()


def next_sequence_number(frame: bytes | None) -> int:
    """The ``sequence_number`` that follows the Responses event ``frame`` (0 when GEN sent none), so the relay's
    error event goes on with GEN's numbering rather than restart it. Read only when a stream fails: the relay
    itself never parses what it passes on."""
    if frame is None:
        return 0
    _, _, data = frame.partition(b"data: ")
    try:
        number = orjson.loads(data)["sequence_number"]
    except (orjson.JSONDecodeError, KeyError, TypeError):
        return 0  # not a Responses event (chat and completions streams have no numbers)
    return number + 1 if isinstance(number, int) else 0

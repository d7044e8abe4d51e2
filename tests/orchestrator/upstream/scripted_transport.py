"""A ``Transport`` whose answers are scripted: the test double of the orchestrator's transport boundary.

Each call takes the next step of the script: a ``Reply`` (a whole answer; for ``open_stream``, a stream of its
content in one chunk), a ``ScriptedStream`` (a stream of given chunks, optionally failing after them), or an
``UpstreamError`` to raise. Every call is recorded.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncGenerator, Awaitable, Callable
from dataclasses import dataclass, field

from frontend.errors import UpstreamError
from orchestrator.upstream.base import Body, Reply, WorkerTimeouts, body_bytes, push_chunks


@dataclass
class ScriptedStream:
    status_code: int
    parts: list[bytes]
    fails_with: UpstreamError | None = None  # raised after the parts, as a connection that broke
    closed: bool = False
    iterated: list[bytes] = field(default_factory=list)
    stalls: bool = False  # after the parts, neither ends nor fails: waits until it is closed
    prompt_report: bytes | None = None  # its x-disagg-prompt-tokens header

    async def chunks(self) -> AsyncGenerator[bytes, None]:
        try:
            for part in self.parts:
                self.iterated.append(part)
                yield part
            if self.stalls:
                await asyncio.Event().wait()  # never set: only a cancellation ends it
            if self.fails_with is not None:
                raise self.fails_with
        finally:
            await self.aclose()

    async def push(self, take: Callable[[bytes], bool], drained: Callable[[], Awaitable[object]]) -> None:
        await push_chunks(self, take, drained)

    async def read(self) -> bytes:
        await self.aclose()
        return b"".join(self.parts)

    async def aclose(self) -> None:
        self.closed = True


Step = Reply | ScriptedStream | UpstreamError


@dataclass
class Call:
    method: str
    path: str
    body: bytes | None
    headers: dict[str, str] | None


class ScriptedTransport:
    def __init__(self, url: str, script: list[Step] | None = None) -> None:
        self.url = url
        self.script = list(script or [])
        self.calls: list[Call] = []
        self.opened: list[ScriptedStream] = []
        self.closed = False

    def _next(self, call: Call) -> Reply | ScriptedStream:
        self.calls.append(call)
        if not self.script:
            raise AssertionError(f"{self.url}: no scripted answer left for {call.method} {call.path}")
        step = self.script.pop(0)
        if isinstance(step, UpstreamError):
            raise step
        return step

    async def post(self, path: str, body: Body, headers: dict[str, str] | None = None) -> Reply:
        step = self._next(Call("POST", path, body_bytes(body), headers))
        assert isinstance(step, Reply)
        return step

    async def open_stream(self, path: str, body: Body, headers: dict[str, str] | None = None) -> ScriptedStream:
        step = self._next(Call("STREAM", path, body_bytes(body), headers))
        stream = step if isinstance(step, ScriptedStream) else ScriptedStream(
            step.status_code, [step.content], prompt_report=step.prompt_report)
        self.opened.append(stream)
        return stream

    async def get(self, path: str, timeout_s: float) -> Reply:
        step = self._next(Call("GET", path, None, None))
        assert isinstance(step, Reply)
        return step

    async def aclose(self) -> None:
        self.closed = True


class ScriptedTransports:
    """A transport factory for ``WorkerPool`` that hands out one ``ScriptedTransport`` per URL, scripted ahead."""

    def __init__(self, scripts: dict[str, list[Step]]) -> None:
        self.by_url = {url: ScriptedTransport(url, script) for url, script in scripts.items()}

    def __call__(self, url: str, timeouts: WorkerTimeouts) -> ScriptedTransport:
        return self.by_url.setdefault(url, ScriptedTransport(url))

"""What moves bytes to one worker and back: the interface the orchestrator sees of its HTTP client.

The flow, the pool and the routes see only this: bytes in, a status and bytes (or a stream) out, and the project's
own errors. No client library gets through, so another client is one module implementing ``Transport`` plus one
line in ``choice.py``. This module imports none of its implementations (a contract in pyproject.toml).

Contract of every implementation:
- bodies are JSON bytes already encoded by the caller (``Body``: one bytes object, or chunks written one after the
  other, never joined where the client can write them as they are); the transport adds ``Content-Type:
  application/json``;
- a failure to connect, send or read raises ``UpstreamUnavailableError`` (the worker refused the connection: it is
  gone), ``UpstreamTimeoutError`` or ``UpstreamError``, naming the worker's URL; an HTTP error status is not a
  failure: it comes back as a status like any other;
- a keep-alive connection the worker closed while it was idle is not used for a request; a request written and then
  met by a close on a reused connection is never sent again by the default client (the worker may have run it: the
  caller's retry policy decides, on another worker), while aiohttp retries it once on a fresh connection;
- one connection pool per worker, kept until ``aclose``;
- ``headers`` given when the transport is made go with every request, GETs included: the deployment secret's
  header (frontend/internal_secret.py), which proves each call comes from one of the deployment's processes;
- of the answer's headers, only ``x-disagg-prompt-tokens`` is kept (``prompt_report``: a GEN's account of what of
  its prompt came through the hand-off, frontend/prompt_report.py); the rest are not the orchestrator's business.
"""

from __future__ import annotations

from collections.abc import AsyncGenerator, Awaitable, Callable
from contextlib import aclosing
from dataclasses import dataclass
from typing import Protocol

# A request body: bytes, or chunks (GEN's body around CTX's b64 prompt, a view of CTX's answer: b64_splice.py).
Body = bytes | tuple[bytes | memoryview, ...]


@dataclass(frozen=True, slots=True)
class Reply:
    """A whole answer: its status and its body as it came."""

    status_code: int
    content: bytes
    prompt_report: bytes | None = None  # the answer's x-disagg-prompt-tokens header, as it came


@dataclass(frozen=True, slots=True)
class WorkerTimeouts:
    request_s: float = 600.0
    connect_s: float = 5.0
    health_s: float = 5.0


class OpenStream(Protocol):
    """An answer whose status has arrived and whose body is still coming.

    Whoever opened it must consume it: iterate ``chunks`` to the end, or ``read`` it, or ``aclose`` it. ``aclose``
    is idempotent and safe after either, so ``try: ... finally: await stream.aclose()`` is always right.
    """

    @property
    def status_code(self) -> int: ...

    @property
    def prompt_report(self) -> bytes | None:
        """The answer's ``x-disagg-prompt-tokens`` header, as it came (None without one)."""
        ...

    def chunks(self) -> AsyncGenerator[bytes, None]:
        """The body as it arrives, unchanged; failures mid-way raise ``UpstreamError``; closes at the end."""
        ...

    async def push(self, take: Callable[[bytes], bool], drained: Callable[[], Awaitable[object]]) -> None:
        """``chunks`` pushed rather than pulled: each piece handed to ``take`` as it arrives (from the callback that
        read it, where the client library allows), reading paused until ``drained`` returns whenever ``take``
        returns False; failures raise ``UpstreamError``; closes at the end. The relay's fast mode (relay.py)."""
        ...

    async def read(self) -> bytes:
        """The rest of the body, whole; then closed."""
        ...

    async def aclose(self) -> None: ...


class Transport(Protocol):
    """Moves bytes to and from one worker (``url``)."""

    url: str

    async def post(self, path: str, body: Body, headers: dict[str, str] | None = None) -> Reply:
        """POST ``body`` and read the whole answer."""
        ...

    async def open_stream(self, path: str, body: Body, headers: dict[str, str] | None = None) -> OpenStream:
        """POST ``body`` and return as soon as the answer's status has arrived."""
        ...

    async def get(self, path: str, timeout_s: float) -> Reply:
        """GET with its own, short timeout (health checks, model listings)."""
        ...

    async def aclose(self) -> None:
        """Close the connection pool; answers being streamed are cut."""
        ...


async def push_chunks(stream: OpenStream, take: Callable[[bytes], bool],
                      drained: Callable[[], Awaitable[object]]) -> None:
    """``OpenStream.push`` for a client that can only be iterated."""
    async with aclosing(stream.chunks()) as chunks:
        async for chunk in chunks:
            if not take(chunk):
                await drained()


def body_length(body: Body) -> int:
    """How many bytes ``body`` sends, without joining its chunks."""
    return len(body) if isinstance(body, bytes) else sum(len(chunk) for chunk in body)


def body_bytes(body: Body) -> bytes:
    """``body`` as one bytes object (for a client that takes nothing else)."""
    return body if isinstance(body, bytes) else b"".join(body)


"""``Transport`` over aiohttp: the general client to fall back on (``upstream_client: aiohttp``), and the only module
that imports aiohttp.

Why aiohttp, not httpx: its parser is C (llhttp) on asyncio's protocols, where httpx goes through httpcore, h11 (pure
Python) and anyio, 60 % of the orchestrator's samples against mock workers (docs/benchmarks.md, orchestrator cost).
aiohttp's exceptions are translated in one place, ``_translated``, around every call and stream iteration: a timeout
is ``UpstreamTimeoutError``, a refused connection ``UpstreamUnavailableError``, anything else ``UpstreamError``.
"""

from __future__ import annotations

from collections.abc import AsyncGenerator, Awaitable, Callable, Iterator, Mapping
from contextlib import contextmanager
from typing import Any

import aiohttp
from aiohttp.abc import AbstractStreamWriter
from aiohttp.payload import Payload

from frontend.errors import UpstreamError, UpstreamTimeoutError, UpstreamUnavailableError
from frontend.prompt_report import PROMPT_TOKENS_HEADER
from orchestrator.upstream.base import Body, Reply, WorkerTimeouts, body_length, push_chunks

_JSON_HEADERS = {"Content-Type": "application/json"}
# Neither is of use between the orchestrator and its workers, and each costs a header per request.
_SKIPPED_HEADERS = ("User-Agent", "Accept-Encoding")

# aiohttp pauses reading a connection once 2 x read_bufsize bytes wait unread (64 KiB by default): CTX's 700 KB
# answer then arrives in ~10 pause/resume rounds, each an extra turn of the event loop. A CTX answer is read whole
# anyway, so the buffer may hold it whole.
_READ_BUFSIZE = 2**21

# aiohttp writes each chunk of a body with its own send() (it never uses writelines before Python 3.12.9): on loopback
# a send costs more than copying a few tens of KB, so a small body's chunks are joined into one (at 1k tokens GEN's
# body is ~6 KB: one send instead of three). A large one is sent as it is, its b64 span never copied.
_JOIN_UP_TO = 64 * 1024

# A pooled keep-alive connection the worker closed just as it was reused (a race with its idle timeout): worth one
# more try on a fresh connection before anyone calls the worker broken. A refused connection is not one of these.
_STALE_CONNECTION = (aiohttp.ServerDisconnectedError, aiohttp.ClientOSError)


class AiohttpTransport:
    def __init__(self, url: str, timeouts: WorkerTimeouts, headers: Mapping[str, str] | None = None) -> None:
        self.url = url
        self._headers = dict(headers or {})  # sent with every request (the deployment secret's header)
        self._timeouts = timeouts
        # Between reads at most request_s (a stream may run long; a stalled one fails), as with httptools.
        self._timeout = aiohttp.ClientTimeout(total=None, connect=timeouts.connect_s, sock_read=timeouts.request_s)
        self._session: aiohttp.ClientSession | None = None

    @property
    def session(self) -> aiohttp.ClientSession:
        # Made on first use, inside the running loop (a pool member is made before the server's loop runs).
        if self._session is None:
            self._session = aiohttp.ClientSession(
                base_url=self.url,
                # Idle connections are dropped well before a worker's own keep-alive timeout (75 s), so the
                # orchestrator is the side that closes them, not a race it loses.
                connector=aiohttp.TCPConnector(limit=1024, keepalive_timeout=30.0),
                timeout=self._timeout, auto_decompress=False, cookie_jar=aiohttp.DummyCookieJar(),
                skip_auto_headers=_SKIPPED_HEADERS, read_bufsize=_READ_BUFSIZE, headers=self._headers)
        return self._session

    async def post(self, path: str, body: Body, headers: dict[str, str] | None = None) -> Reply:
        with _translated(self.url):
            response = await self._send(path, body, headers)
            try:
                return Reply(response.status, await response.read(), _prompt_report(response))
            finally:
                response.release()

    async def open_stream(self, path: str, body: Body, headers: dict[str, str] | None = None) -> AiohttpStream:
        with _translated(self.url):
            response = await self._send(path, body, headers)
        return AiohttpStream(response, self.url)

    async def get(self, path: str, timeout_s: float) -> Reply:
        with _translated(self.url):
            async with self.session.get(path, timeout=aiohttp.ClientTimeout(total=timeout_s)) as response:
                return Reply(response.status, await response.read())

    async def aclose(self) -> None:
        if self._session is not None:
            await self._session.close()

    async def _send(self, path: str, body: Body, headers: dict[str, str] | None) -> aiohttp.ClientResponse:
        sent = {**_JSON_HEADERS, **headers} if headers else _JSON_HEADERS
        try:
            return await self.session.post(path, data=_payload(body), headers=sent)
        except aiohttp.ClientConnectorError:
            raise
        except _STALE_CONNECTION:
            return await self.session.post(path, data=_payload(body), headers=sent)

    def __repr__(self) -> str:
        return f"AiohttpTransport({self.url!r})"


class AiohttpStream:
    """``OpenStream`` over an aiohttp response whose body is still to be read."""

    def __init__(self, response: aiohttp.ClientResponse, url: str) -> None:
        self._response = response
        self._url = url

    @property
    def status_code(self) -> int:
        return self._response.status

    @property
    def prompt_report(self) -> bytes | None:
        return _prompt_report(self._response)

    async def chunks(self) -> AsyncGenerator[bytes, None]:
        try:
            with _translated(self._url):
                async for chunk in self._response.content.iter_any():
                    yield chunk
        finally:
            await self.aclose()

    async def push(self, take: Callable[[bytes], bool], drained: Callable[[], Awaitable[object]]) -> None:
        await push_chunks(self, take, drained)

    async def read(self) -> bytes:
        try:
            with _translated(self._url):
                return await self._response.read()
        finally:
            await self.aclose()

    async def aclose(self) -> None:
        # A body read to its end gives the connection back to the pool; one cut short (the client went away)
        # closes it, which is also what tells GEN to stop.
        if self._response.content.at_eof():
            self._response.release()
        else:
            self._response.close()


class _Chunks(Payload):
    """A body of several chunks, written one after the other under one Content-Length."""

    def __init__(self, chunks: tuple[bytes | memoryview, ...]) -> None:
        super().__init__(chunks, content_type="application/json")
        self._chunks = chunks
        self._size = body_length(chunks)
        self._one_send = self._size <= _JOIN_UP_TO

    def decode(self, encoding: str = "utf-8", errors: str = "strict") -> str:
        return b"".join(self._chunks).decode(encoding, errors)

    async def write(self, writer: AbstractStreamWriter) -> None:
        if self._one_send:
            await writer.write(b"".join(self._chunks))
            return
        for chunk in self._chunks:
            await writer.write(chunk)


def _payload(body: Body) -> Any:
    return body if isinstance(body, bytes) else _Chunks(body)


@contextmanager
def _translated(url: str) -> Iterator[None]:
    try:
        yield
    except (TimeoutError, aiohttp.ClientError) as exc:
        raise translate_aiohttp_error(exc, url) from exc


def translate_aiohttp_error(exc: aiohttp.ClientError | TimeoutError, url: str) -> UpstreamError:
    if isinstance(exc, TimeoutError):  # aiohttp's own timeouts are TimeoutErrors too
        return UpstreamTimeoutError(f"worker {url} timed out ({type(exc).__name__})")
    if isinstance(exc, aiohttp.ClientConnectorError):
        # Only a refused connection says the worker is gone (the pool takes it out until a health check passes).
        return UpstreamUnavailableError(f"worker {url} is unreachable ({type(exc).__name__})")
    return UpstreamError(f"worker {url} failed: {type(exc).__name__}: {exc}")


def _prompt_report(response: aiohttp.ClientResponse) -> bytes | None:
    value = response.headers.get(PROMPT_TOKENS_HEADER)
    return value.encode("latin-1") if value is not None else None

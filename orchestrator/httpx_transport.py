"""``Transport`` over httpx: the only module of the orchestrator that imports httpx.

httpx's exceptions are translated in one place, ``_translated``, around every call and around stream iteration
too; none goes further. Bodies are handed over as bytes already encoded with orjson (httpx's own ``json=`` is
~50x slower on a 500 KB prompt).
"""

from __future__ import annotations

from collections.abc import AsyncGenerator, Awaitable, Callable, Iterator
from contextlib import contextmanager

import httpx

from frontend.errors import UpstreamError, UpstreamTimeoutError, UpstreamUnavailableError
from orchestrator.transport import Body, Reply, WorkerTimeouts, body_bytes, pipe_chunks

_JSON_HEADERS = {"Content-Type": "application/json"}

# Errors of a connection that went away under a request; on a reused keep-alive connection, usually a race
# with the worker's idle timeout, so worth one more try before anyone calls the worker broken.
_STALE_CONNECTION = (httpx.RemoteProtocolError, httpx.ReadError, httpx.WriteError)


class HttpxTransport:
    def __init__(self, url: str, timeouts: WorkerTimeouts) -> None:
        self.url = url
        self._client = httpx.AsyncClient(
            base_url=url,
            timeout=httpx.Timeout(timeouts.request_s, connect=timeouts.connect_s),
            # Idle connections are dropped well before a worker's own keep-alive timeout (75 s), so the
            # orchestrator is the side that closes them, not a race it loses.
            limits=httpx.Limits(max_connections=1024, max_keepalive_connections=256, keepalive_expiry=30.0),
        )

    async def post(self, path: str, body: Body, headers: dict[str, str] | None = None) -> Reply:
        with _translated(self.url):
            response = await self._send(path, body, headers, stream=False)
        return Reply(response.status_code, response.content)

    async def open_stream(self, path: str, body: Body, headers: dict[str, str] | None = None) -> HttpxStream:
        with _translated(self.url):
            response = await self._send(path, body, headers, stream=True)
        return HttpxStream(response, self.url)

    async def get(self, path: str, timeout_s: float) -> Reply:
        with _translated(self.url):
            response = await self._client.get(path, timeout=timeout_s)
        return Reply(response.status_code, response.content)

    async def aclose(self) -> None:
        await self._client.aclose()

    async def _send(self, path: str, body: Body, headers: dict[str, str] | None, *, stream: bool
                    ) -> httpx.Response:
        request = self._client.build_request("POST", path, content=body_bytes(body),
                                             headers={**_JSON_HEADERS, **headers} if headers else _JSON_HEADERS)
        try:
            return await self._client.send(request, stream=stream)
        except _STALE_CONNECTION:
            # The worker closed a pooled keep-alive connection just as it was reused: once more, on a fresh one.
            return await self._client.send(request, stream=stream)

    def __repr__(self) -> str:
        return f"HttpxTransport({self.url!r})"


class HttpxStream:
    """``OpenStream`` over an httpx response opened with ``stream=True``."""

    def __init__(self, response: httpx.Response, url: str) -> None:
        self._response = response
        self._url = url

    @property
    def status_code(self) -> int:
        return self._response.status_code

    async def chunks(self) -> AsyncGenerator[bytes, None]:
        try:
            with _translated(self._url):
                async for chunk in self._response.aiter_raw():
                    yield chunk
        finally:
            await self.aclose()

    async def pipe(self, take: Callable[[bytes], bool], drained: Callable[[], Awaitable[object]]) -> None:
        await pipe_chunks(self, take, drained)

    async def read(self) -> bytes:
        try:
            with _translated(self._url):
                return await self._response.aread()
        finally:
            await self.aclose()

    async def aclose(self) -> None:
        with _translated(self._url):
            await self._response.aclose()


@contextmanager
def _translated(url: str) -> Iterator[None]:
    try:
        yield
    except httpx.HTTPError as exc:
        raise translate_http_error(exc, url) from exc


def translate_http_error(exc: httpx.HTTPError, url: str) -> UpstreamError:
    if isinstance(exc, httpx.TimeoutException):
        return UpstreamTimeoutError(f"worker {url} timed out ({type(exc).__name__})")
    if isinstance(exc, httpx.ConnectError):
        # Only a refused connection says the worker is gone (the pool takes it out until a health check passes).
        return UpstreamUnavailableError(f"worker {url} is unreachable ({type(exc).__name__})")
    return UpstreamError(f"worker {url} failed: {type(exc).__name__}: {exc}")

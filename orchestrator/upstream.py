"""One pooled HTTP client per worker; httpx's exceptions are translated here and go no further.

Bodies are handed over as bytes already encoded with orjson (httpx's own ``json=`` is ~50x slower on a 500 KB
prompt), and one connection pool per upstream is kept for the process's life.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import dataclass

import httpx

from frontend.errors import UpstreamError, UpstreamTimeoutError, UpstreamUnavailableError
from frontend.guardrail import GenEngineFacts

_JSON_HEADERS = {"Content-Type": "application/json"}


@dataclass(frozen=True, slots=True)
class UpstreamReply:
    status_code: int
    content: bytes
    headers: dict[str, str] | None = None


@dataclass(frozen=True, slots=True)
class WorkerTimeouts:
    request_s: float = 600.0
    connect_s: float = 5.0
    health_s: float = 5.0


class WorkerClient:
    """One worker as the orchestrator sees it: a pooled HTTP client, its health, and its load as counted here."""

    def __init__(self, url: str, timeouts: WorkerTimeouts) -> None:
        self.url = url
        self.healthy = False
        self.facts: GenEngineFacts | None = None
        self.inflight = 0
        self.inflight_prompt_tokens = 0
        self._failures = 0
        self._successes = 0
        self._client = httpx.AsyncClient(
            base_url=url,
            timeout=httpx.Timeout(timeouts.request_s, connect=timeouts.connect_s),
            # Idle connections are dropped well before a worker's own keep-alive timeout (75 s), so the
            # orchestrator is the side that closes them, not a race it loses.
            limits=httpx.Limits(max_connections=1024, max_keepalive_connections=256, keepalive_expiry=30.0),
        )

    @property
    def engine_facts(self) -> GenEngineFacts:
        # Until the worker has told us, assume the facts under which metadata-only is never admitted.
        return self.facts or GenEngineFacts(kv_block_reuse=True, prompt_tokens_in_handoff=False)

    def record_health(self, ok: bool, failure_threshold: int, recovery_threshold: int) -> None:
        if ok:
            self._failures = 0
            self._successes += 1
            if not self.healthy and self._successes >= recovery_threshold:
                self.healthy = True
        else:
            self._successes = 0
            self._failures += 1
            if self.healthy and self._failures >= failure_threshold:
                self.healthy = False

    def mark_unreachable(self) -> None:
        """Passive health: a refused connection takes the worker out at once; the monitor brings it back."""
        self.healthy = False
        self._successes = 0

    async def post(self, path: str, body: bytes, headers: dict[str, str] | None = None) -> UpstreamReply:
        for attempt in range(2):
            try:
                response = await self._client.post(path, content=body, headers=self._headers(headers))
                return UpstreamReply(response.status_code, response.content)
            except _STALE_CONNECTION as exc:
                if attempt:
                    raise translate_http_error(exc, self.url) from exc
                # The worker closed a pooled keep-alive connection just as it was reused: once more.
            except httpx.HTTPError as exc:
                raise translate_http_error(exc, self.url) from exc
        raise AssertionError("unreachable")

    @asynccontextmanager
    async def stream(
        self, path: str, body: bytes, headers: dict[str, str] | None = None
    ) -> AsyncIterator[httpx.Response]:
        response = None
        for attempt in range(2):
            request = self._client.build_request("POST", path, content=body, headers=self._headers(headers))
            try:
                response = await self._client.send(request, stream=True)
                break
            except _STALE_CONNECTION as exc:
                if attempt:
                    raise translate_http_error(exc, self.url) from exc
            except httpx.HTTPError as exc:
                raise translate_http_error(exc, self.url) from exc
        assert response is not None
        try:
            yield response
        finally:
            await response.aclose()

    async def get(self, path: str, timeout_s: float) -> UpstreamReply:
        try:
            response = await self._client.get(path, timeout=timeout_s)
        except httpx.HTTPError as exc:
            raise translate_http_error(exc, self.url) from exc
        return UpstreamReply(response.status_code, response.content)

    async def aclose(self) -> None:
        await self._client.aclose()

    @staticmethod
    def _headers(extra: dict[str, str] | None) -> dict[str, str]:
        return {**_JSON_HEADERS, **extra} if extra else _JSON_HEADERS

    def __repr__(self) -> str:
        return f"WorkerClient({self.url!r}, healthy={self.healthy})"


# Errors of a connection that went away under a request; on a reused keep-alive connection, usually a race
# with the worker's idle timeout, so worth one more try before anyone calls the worker broken.
_STALE_CONNECTION = (httpx.RemoteProtocolError, httpx.ReadError, httpx.WriteError)


def translate_http_error(exc: httpx.HTTPError, url: str) -> UpstreamError:
    if isinstance(exc, httpx.TimeoutException):
        return UpstreamTimeoutError(f"worker {url} timed out ({type(exc).__name__})")
    if isinstance(exc, httpx.ConnectError):
        # Only a refused connection says the worker is gone (the pool takes it out until a health check passes).
        return UpstreamUnavailableError(f"worker {url} is unreachable ({type(exc).__name__})")
    return UpstreamError(f"worker {url} failed: {type(exc).__name__}: {exc}")

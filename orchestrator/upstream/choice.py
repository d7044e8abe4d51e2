"""The one place that chooses the HTTP client, outside the interface it returns (``base`` imports neither client)."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Literal

from orchestrator.upstream.aiohttp import AiohttpTransport
from orchestrator.upstream.base import Transport, WorkerTimeouts
from orchestrator.upstream.httptools.pool import HttptoolsTransport

Client = Literal["httptools", "aiohttp"]


def make_transport(url: str, timeouts: WorkerTimeouts, client: Client = "httptools",
                   headers: Mapping[str, str] | None = None) -> Transport:
    """Our own client on httptools by default (a pooled keep-alive POST and nothing else: about half aiohttp's CPU
    per request at 1k tokens, docs/benchmarks.md, orchestrator cost), aiohttp on request (``upstream_client``), the
    general client to fall back on (docs/architecture.md says why these two)."""
    if client == "aiohttp":
        return AiohttpTransport(url, timeouts, headers)
    return HttptoolsTransport(url, timeouts, headers)

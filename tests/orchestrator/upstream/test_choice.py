"""The one place that chooses the HTTP client, which the configuration (``upstream_client``) feeds."""

from __future__ import annotations

from orchestrator.upstream.aiohttp import AiohttpTransport
from orchestrator.upstream.base import Transport, WorkerTimeouts
from orchestrator.upstream.choice import make_transport
from orchestrator.upstream.httptools.pool import HttptoolsTransport


async def test_the_transport_is_chosen_in_one_place() -> None:
    for client, cls in (("aiohttp", AiohttpTransport), ("httptools", HttptoolsTransport)):
        transport: Transport = make_transport("http://w:1", WorkerTimeouts(), client)  # type: ignore[arg-type]
        try:
            assert isinstance(transport, cls)
            assert transport.url == "http://w:1"
        finally:
            await transport.aclose()
    default = make_transport("http://w:1", WorkerTimeouts())
    assert isinstance(default, HttptoolsTransport)
    await default.aclose()

"""The ``Transport`` contract, run for every transport (httptools, the default, and aiohttp) against real workers on
loopback: whole and streamed answers, bodies sent as chunks, and every failure arriving as the project's own error,
stream iteration included; and each client library used by its own module only."""

from __future__ import annotations

import ast
import asyncio
import contextlib
import pathlib
import socket
from collections.abc import AsyncIterator, Iterator

import orjson
import pytest
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import Response, StreamingResponse
from starlette.routing import Route

import orchestrator
from frontend.errors import UpstreamTimeoutError, UpstreamUnavailableError
from orchestrator.upstream.aiohttp import AiohttpTransport
from orchestrator.upstream.base import WorkerTimeouts
from orchestrator.upstream.httptools.pool import HttptoolsTransport
from tests.cluster import MODEL, Cluster, start_worker
from tests.servers import running
from workers.engines.synthetic import SyntheticConfig


def closed_port_url() -> str:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return f"http://127.0.0.1:{sock.getsockname()[1]}"


@pytest.fixture(scope="module")
def slow_worker_url() -> Iterator[str]:
    with contextlib.ExitStack() as stack:
        yield start_worker(stack, "both", SyntheticConfig(time_to_first_token_s=10)).url


TransportClass = type[AiohttpTransport] | type[HttptoolsTransport]


@pytest.fixture(params=[AiohttpTransport, HttptoolsTransport], ids=["aiohttp", "httptools"])
def transport_class(request: pytest.FixtureRequest) -> TransportClass:
    cls: TransportClass = request.param
    return cls


async def test_post_stream_and_get_against_a_real_worker(cluster: Cluster, transport_class: TransportClass) -> None:
    transport = transport_class(cluster.aggregated.url, WorkerTimeouts())
    try:
        body = orjson.dumps({"model": MODEL, "prompt": "x", "max_tokens": 3})
        reply = await transport.post("/v1/completions", body)
        assert reply.status_code == 200
        assert orjson.loads(reply.content)["choices"][0]["text"] == "The"
        health = await transport.get("/health", 5)
        assert health.status_code == 200
        stream = await transport.open_stream("/v1/completions", orjson.dumps(
            {"model": MODEL, "prompt": "x", "max_tokens": 2, "stream": True}))
        assert stream.status_code == 200
        raw = b"".join([chunk async for chunk in stream.chunks()])
        assert raw.endswith(b"data: [DONE]\n\n")
        await stream.aclose()  # idempotent after the iteration closed it
    finally:
        await transport.aclose()


async def test_an_error_status_is_an_answer_not_an_exception(cluster: Cluster, transport_class: TransportClass) -> None:
    transport = transport_class(cluster.aggregated.url, WorkerTimeouts())
    try:
        reply = await transport.post("/v1/completions", b"{}")
        assert reply.status_code == 400
        stream = await transport.open_stream("/v1/completions", b"{}")
        assert stream.status_code == 400
        assert orjson.loads(await stream.read())["error"]["type"] == "invalid_request_error"
    finally:
        await transport.aclose()


async def test_a_closed_port_is_unavailable(transport_class: TransportClass) -> None:
    transport = transport_class(closed_port_url(), WorkerTimeouts(connect_s=2))
    try:
        with pytest.raises(UpstreamUnavailableError):
            await transport.post("/v1/completions", b"{}")
        with pytest.raises(UpstreamUnavailableError):
            await transport.open_stream("/v1/completions", b"{}")
        with pytest.raises(UpstreamUnavailableError):
            await transport.get("/health", 2)
    finally:
        await transport.aclose()


async def test_a_worker_slower_than_the_request_timeout_times_out(slow_worker_url: str,
                                                                 transport_class: TransportClass) -> None:
    transport = transport_class(slow_worker_url, WorkerTimeouts(request_s=0.2))
    try:
        with pytest.raises(UpstreamTimeoutError):
            await transport.post("/v1/completions", orjson.dumps({"model": MODEL, "prompt": "x", "max_tokens": 2}))
    finally:
        await transport.aclose()


def stalling_stream() -> Starlette:
    """Answers 200 and one frame at once, then nothing for 10 s."""
    async def stream(_: Request) -> Response:
        async def frames() -> AsyncIterator[bytes]:
            yield b"data: {}\n\n"
            await asyncio.sleep(10)

        return StreamingResponse(frames(), media_type="text/event-stream")

    return Starlette(routes=[Route("/v1/completions", stream, methods=["POST"])])


async def test_a_stream_that_stalls_mid_way_fails_with_the_projects_error(transport_class: TransportClass) -> None:
    with running(stalling_stream()) as url:
        transport = transport_class(url, WorkerTimeouts(request_s=0.3))
        try:
            stream = await transport.open_stream("/v1/completions", b"{}")
            assert stream.status_code == 200
            received = []
            with pytest.raises(UpstreamTimeoutError, match=url):
                async for chunk in stream.chunks():
                    received.append(chunk)
            assert received == [b"data: {}\n\n"]
        finally:
            await transport.aclose()


def test_each_http_client_stays_inside_its_module() -> None:
    root = pathlib.Path(orchestrator.__file__).parent
    for source in root.rglob("*.py"):
        tree = ast.parse(source.read_text())
        imported = {alias.name.split(".")[0] for node in ast.walk(tree) if isinstance(node, ast.Import)
                    for alias in node.names}
        imported |= {(node.module or "").split(".")[0] for node in ast.walk(tree) if isinstance(node, ast.ImportFrom)}
        assert not {"httpx", "httpcore", "h11"} & imported, f"{source.relative_to(root)} imports an HTTP client"
        if source != root / "upstream" / "aiohttp.py":
            assert "aiohttp" not in imported, f"{source.relative_to(root)} imports the HTTP client"
        if source != root / "upstream" / "httptools" / "connection.py":
            assert "httptools" not in imported, f"{source.relative_to(root)} imports the HTTP parser"
        called = {node.attr for node in ast.walk(tree) if isinstance(node, ast.Attribute)}
        assert not {"__aenter__", "__aexit__"} & called, f"{source.relative_to(root)} drives a context by hand"
        if source != root / "upstream" / "aiohttp.py":
            assert "translate_aiohttp_error" not in source.read_text()


def echo_body() -> Starlette:
    """Answers every POST with the very bytes it received, whole or streamed back."""
    async def echo(request: Request) -> Response:
        body = await request.body()
        if request.headers.get("x-stream") == "1":
            async def frames() -> AsyncIterator[bytes]:
                yield body

            return StreamingResponse(frames(), media_type="text/event-stream")
        return Response(body, media_type=request.headers.get("content-type", ""))

    return Starlette(routes=[Route("/echo", echo, methods=["POST"])])


async def test_a_body_of_chunks_arrives_as_their_concatenation(transport_class: TransportClass) -> None:
    span = memoryview(b'{"prompt_token_ids_b64":"' + b"QUJD" * 50_000 + b'"}')[25:-2]
    chunks = (b'{"model":"m","prompt_token_ids_b64":"', span, b'"}')
    expected = b"".join(chunks)
    with running(echo_body()) as url:
        transport = transport_class(url, WorkerTimeouts())
        try:
            reply = await transport.post("/echo", chunks)
            assert reply.status_code == 200 and reply.content == expected
            stream = await transport.open_stream("/echo", chunks, {"x-stream": "1"})
            assert b"".join([chunk async for chunk in stream.chunks()]) == expected
        finally:
            await transport.aclose()


async def test_the_transport_sends_its_fixed_headers_on_every_request(transport_class: TransportClass) -> None:
    """The deployment secret's header goes with every call to a worker (POST, stream, GET), next to the caller's own
    headers: what the workers' internal routes let the orchestrator in by."""
    seen: list[tuple[str, str | None, str | None]] = []

    async def record(request: Request) -> Response:
        seen.append((request.method, request.headers.get("x-disagg-internal-token"),
                     request.headers.get("x-request-id")))
        return Response(b"{}", media_type="application/json")

    app = Starlette(routes=[Route("/r", record, methods=["GET", "POST"])])
    with running(app) as url:
        transport = transport_class(url, WorkerTimeouts(), {"x-disagg-internal-token": "t" * 32})
        try:
            assert (await transport.post("/r", b"{}", {"x-request-id": "a"})).status_code == 200
            stream = await transport.open_stream("/r", b"{}", {"x-request-id": "b"})
            await stream.read()
            assert (await transport.get("/r", 5)).status_code == 200
        finally:
            await transport.aclose()
    assert seen == [("POST", "t" * 32, "a"), ("POST", "t" * 32, "b"), ("GET", "t" * 32, None)]

from __future__ import annotations

import contextlib
import socket
from collections.abc import Iterator

import httpx
import orjson
import pytest

from frontend.errors import UpstreamError, UpstreamTimeoutError, UpstreamUnavailableError
from orchestrator.upstream import WorkerClient, WorkerTimeouts, translate_http_error
from tests.cluster import MODEL, Cluster, start_worker
from workers.engines.synthetic import SyntheticConfig


def closed_port_url() -> str:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return f"http://127.0.0.1:{sock.getsockname()[1]}"


@pytest.fixture(scope="module")
def slow_worker_url() -> Iterator[str]:
    with contextlib.ExitStack() as stack:
        yield start_worker(stack, "both", SyntheticConfig(time_to_first_token_s=10)).url


@pytest.mark.parametrize(
    ("error", "expected"),
    [
        (httpx.ConnectTimeout("t"), UpstreamTimeoutError),
        (httpx.ReadTimeout("t"), UpstreamTimeoutError),
        (httpx.PoolTimeout("t"), UpstreamTimeoutError),
        (httpx.ConnectError("c"), UpstreamUnavailableError),
        # A connection lost under a request is an upstream failure, but not proof the worker is gone.
        (httpx.RemoteProtocolError("r"), UpstreamError),
        (httpx.ReadError("r"), UpstreamError),
        (httpx.WriteError("w"), UpstreamError),
        (httpx.DecodingError("d"), UpstreamError),
    ],
)
def test_httpx_errors_are_translated(error: httpx.HTTPError, expected: type[UpstreamError]) -> None:
    translated = translate_http_error(error, "http://w:1")
    assert type(translated) is expected
    assert "http://w:1" in translated.message


async def test_post_and_get_against_a_real_worker(cluster: Cluster) -> None:
    client = WorkerClient(cluster.aggregated.url, WorkerTimeouts())
    try:
        body = orjson.dumps({"model": MODEL, "prompt": "x", "max_tokens": 3})
        reply = await client.post("/v1/completions", body)
        assert reply.status_code == 200
        assert orjson.loads(reply.content)["choices"][0]["text"] == "The"
        health = await client.get("/health", 5)
        assert health.status_code == 200
        async with client.stream("/v1/completions", orjson.dumps({"model": MODEL, "prompt": "x", "max_tokens": 2,
                                                                  "stream": True})) as response:
            raw = await response.aread()
        assert raw.endswith(b"data: [DONE]\n\n")
    finally:
        await client.aclose()


async def test_a_closed_port_is_unavailable() -> None:
    client = WorkerClient(closed_port_url(), WorkerTimeouts(connect_s=2))
    try:
        with pytest.raises(UpstreamUnavailableError):
            await client.post("/v1/completions", b"{}")
        with pytest.raises(UpstreamUnavailableError):
            async with client.stream("/v1/completions", b"{}"):
                pass
    finally:
        await client.aclose()


async def test_a_worker_slower_than_the_request_timeout_times_out(slow_worker_url: str) -> None:
    client = WorkerClient(slow_worker_url, WorkerTimeouts(request_s=0.2))
    try:
        with pytest.raises(UpstreamTimeoutError):
            await client.post("/v1/completions", orjson.dumps({"model": MODEL, "prompt": "x", "max_tokens": 2}))
    finally:
        await client.aclose()


def test_health_thresholds() -> None:
    worker = WorkerClient("http://w:1", WorkerTimeouts())
    assert worker.healthy is False
    worker.record_health(True, failure_threshold=2, recovery_threshold=2)
    assert worker.healthy is False
    worker.record_health(True, 2, 2)
    assert worker.healthy is True
    worker.record_health(False, 2, 2)
    assert worker.healthy is True  # one failed check is not enough
    worker.record_health(True, 2, 2)
    worker.record_health(False, 2, 2)
    assert worker.healthy is True  # the failures must be in a row
    worker.record_health(False, 2, 2)
    assert worker.healthy is False
    worker.mark_unreachable()
    assert worker.healthy is False


def test_unknown_engine_facts_are_the_restrictive_ones() -> None:
    worker = WorkerClient("http://w:1", WorkerTimeouts())
    assert worker.facts is None
    assert worker.engine_facts.kv_block_reuse is True
    assert worker.engine_facts.prompt_tokens_in_handoff is False

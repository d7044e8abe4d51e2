"""A client that goes away frees everything it held, on the reference engine (real engine core processes).

The tiny model is given a long context and a small prefill chunk so that a long prompt keeps CTX busy for a while,
and ``ignore_eos`` with a large ``max_tokens`` keeps GEN decoding; the test waits until the engine core really
holds the request (asked over its channel) and only then drops the client's TCP connection.
"""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import httpx
import pytest

from bench.driver.common import open_raw_post
from frontend.config import parse_config
from frontend.metrics import Metrics
from orchestrator.server import create_orchestrator_app
from tests.cluster import sample
from tests.servers import ServerThread
from tests.waiting import eventually
from tests.workers.engines.reference.holding_proxy import HoldingProxy
from tests.workers.engines.reference.ledger import ADMIN_KEY, assert_ledger_balances
from tests.workers.engines.reference.tiny_model import write_tiny_model
from workers.engines.reference.engine import ReferenceEngine
from workers.engines.reference.options import ReferenceOptions
from workers.server import create_worker_app
from workers.settings import Role, WorkerSettings

CONTEXT = 8192
LONG_PROMPT = 7000  # tokens of CTX prefill, in chunks of 16


@dataclass
class Worker:
    engine: ReferenceEngine
    server: ServerThread
    url: str
    role: Role
    metrics: Metrics

    def core(self) -> dict[str, int]:
        """The engine core's own counters, asked on the server's event loop."""
        assert self.server.loop is not None
        future = asyncio.run_coroutine_threadsafe(self.engine.core_stats(), self.server.loop)
        return future.result(timeout=15)

    def gauge(self, name: str, **labels: str) -> float:
        return sample(self.metrics, name, **labels)

    def kv_entries(self) -> float:
        text = httpx.get(self.url + "/metrics", timeout=10).text
        line = next(line for line in text.splitlines() if line.startswith("disagg_kv_store_entries "))
        return float(line.split()[1])

    def inflight(self) -> float:
        return self.gauge("disagg_engine_inflight_requests", role=self.role)


@dataclass
class Cluster:
    ctx: Worker
    gen: Worker
    url: str  # the orchestrator
    model: str


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Cluster]:
    model = write_tiny_model(tmp_path_factory.mktemp("long") / "tiny-long.gguf", seed=0, context_length=CONTEXT)
    options = ReferenceOptions(model_path=str(model), served_model_name="tiny", blas_threads=1, prefill_chunk=16)
    servers: list[ServerThread] = []
    try:
        workers = []
        for role in ("context", "generation"):
            engine, metrics = ReferenceEngine(options), Metrics()
            server = ServerThread(create_worker_app(engine, WorkerSettings(role=role, admin_key=ADMIN_KEY), metrics))
            servers.append(server)
            workers.append(Worker(engine, server, server.start(timeout_s=120), role, metrics))
        config = parse_config({"context_servers": {"urls": [workers[0].url]},
                               "generation_servers": {"urls": [workers[1].url]}})
        orchestrator = ServerThread(create_orchestrator_app(config))
        servers.append(orchestrator)
        yield Cluster(workers[0], workers[1], orchestrator.start(), "tiny")
    finally:
        for server in reversed(servers):
            server.stop()



def _idle(cluster: Cluster) -> bool:
    return (cluster.ctx.core()["active"] == 0 and cluster.gen.core()["active"] == 0
            and cluster.ctx.inflight() == 0 and cluster.gen.inflight() == 0 and cluster.ctx.kv_entries() == 0)


def test_a_client_leaving_while_ctx_prefills_frees_ctx(cluster: Cluster) -> None:
    assert _idle(cluster)
    body = {"model": cluster.model, "prompt": [7] * LONG_PROMPT, "max_tokens": 4, "temperature": 0}
    sock = open_raw_post(cluster.url, "/v1/completions", body)
    try:
        assert eventually(lambda: cluster.ctx.core()["active"] == 1), "CTX never started the prefill"
        assert cluster.ctx.inflight() == 1
        assert cluster.gen.inflight() == 0  # still in the CTX step
    finally:
        sock.close()  # the client goes away mid-prefill
    assert eventually(lambda: cluster.ctx.core()["active"] == 0 and cluster.ctx.inflight() == 0, every_s=0.05)
    # Aborted, not finished: a finished prefill would have parked its KV for a GEN that will never come.
    assert cluster.ctx.kv_entries() == 0
    assert eventually(lambda: cluster.ctx.gauge("disagg_requests_total", role="context", endpoint="completions",
                                           status="499") == 1)
    assert cluster.gen.core()["active"] == 0
    _serves_normally(cluster)


@pytest.mark.parametrize("path", ["/v1/chat/completions", "/v1/completions"])
def test_a_client_leaving_while_gen_streams_frees_gen_and_the_handoff(cluster: Cluster, path: str) -> None:
    assert _idle(cluster)
    body: dict[str, Any] = {"model": cluster.model, "max_tokens": CONTEXT - 200, "ignore_eos": True,
                            "temperature": 0, "stream": True}
    body.update({"messages": [{"role": "user", "content": "Tell me a long story."}]} if "chat" in path
                else {"prompt": "Once upon a time"})
    with httpx.Client(timeout=30) as http, http.stream("POST", cluster.url + path, json=body) as response:
        assert response.status_code == 200
        chunks = response.iter_raw()
        for _ in range(3):
            next(chunks)
        assert cluster.gen.core()["active"] == 1
        assert cluster.gen.inflight() == 1
        assert cluster.ctx.kv_entries() == 0  # GEN took the hand-off already
    # The client closed the connection after three chunks of thousands.
    assert eventually(lambda: cluster.gen.core()["active"] == 0 and cluster.gen.inflight() == 0, every_s=0.05)
    assert cluster.ctx.core()["active"] == 0
    assert cluster.ctx.kv_entries() == 0
    _serves_normally(cluster)


def test_a_client_leaving_while_gen_streams_n_sequences_frees_them_all(cluster: Cluster) -> None:
    assert _idle(cluster)
    body = {"model": cluster.model, "prompt": "Once upon a time", "max_tokens": CONTEXT - 200, "ignore_eos": True,
            "temperature": 1.0, "seed": 3, "n": 3, "stream": True}
    with httpx.Client(timeout=30) as http, http.stream("POST", cluster.url + "/v1/completions", json=body) as response:
        assert response.status_code == 200
        chunks = response.iter_raw()
        for _ in range(3):
            next(chunks)
        assert cluster.gen.core()["sequences"] == 3  # one request, three sequences decoding
        assert cluster.ctx.kv_entries() == 0  # GEN took the one hand-off for all three
    assert eventually(lambda: cluster.gen.core()["sequences"] == 0 and cluster.gen.core()["active"] == 0
                      and cluster.gen.inflight() == 0, every_s=0.05)
    _serves_normally(cluster)


def test_a_client_leaving_during_the_handoff_releases_the_parked_kv(cluster: Cluster) -> None:
    """CTX has answered and parked the KV; the GEN call is accepted but not answered yet (a proxy holds it)."""
    assert _idle(cluster)
    before = assert_ledger_balances(cluster.ctx.url)["totals"]
    proxy = HoldingProxy(cluster.gen.url)
    servers = [ServerThread(create_orchestrator_app(parse_config({
        "context_servers": {"urls": [cluster.ctx.url]}, "generation_servers": {"urls": [proxy.start()]}})))]
    try:
        orchestrator = servers[0].start()
        body = {"model": cluster.model, "prompt": "Once upon a time", "max_tokens": 8, "temperature": 0,
                "stream": True}
        sock = open_raw_post(orchestrator, "/v1/completions", body)
        try:
            assert eventually(lambda: proxy.held == 1), "the GEN step never started"
            assert cluster.ctx.kv_entries() == 1  # the hand-off is parked, waiting for a GEN
        finally:
            sock.close()  # the client goes away mid hand-off
        assert eventually(lambda: proxy.let_go == 1)  # the orchestrator dropped its GEN call
        after = assert_ledger_balances(cluster.ctx.url)["totals"]
        assert after["released"] == before["released"] + 1
        assert after["parked"] == before["parked"] + 1
    finally:
        for server in servers:
            server.stop()
        proxy.stop()
    _serves_normally(cluster)


def _serves_normally(cluster: Cluster) -> None:
    reply = httpx.post(cluster.url + "/v1/completions",
                       json={"model": cluster.model, "prompt": "Hello", "max_tokens": 3, "temperature": 0},
                       timeout=60)
    assert reply.status_code == 200, reply.text
    assert reply.json()["usage"]["completion_tokens"] >= 1
    assert eventually(lambda: _idle(cluster), every_s=0.05)
    assert_ledger_balances(cluster.ctx.url)


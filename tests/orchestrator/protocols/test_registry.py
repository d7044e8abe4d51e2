"""Protocol detection: each worker is spoken to in the wire its model card says it speaks."""

from __future__ import annotations

import contextlib
from typing import Any

import httpx
import pytest

from frontend.config import parse_config
from orchestrator.protocols.native import NativeProtocol
from orchestrator.protocols.registry import PROTOCOLS, build_protocols, detect_protocol
from orchestrator.protocols.trtllm.wire import TrtllmProtocol
from orchestrator.server import create_orchestrator_app
from tests.cluster import MODEL, Cluster, sample, start_orchestrator, start_worker
from tests.orchestrator.protocols.trtllm.trtllm_worker import TrtllmWorker
from tests.servers import running
from tests.waiting import eventually
from workers.trtllm.settings import LifecycleSettings

CHAT = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 3}


@pytest.mark.parametrize("card, protocol", [
    ({"owned_by": "tensorrt_llm"}, "trtllm"),  # an unmodified trtllm-serve
    ({"owned_by": "disagg-serve", "engine_info": {"disagg_protocols": ["native", "trtllm"]}}, "native"),
    ({"owned_by": "x", "engine_info": {"disagg_protocols": ["sglang", "trtllm"]}}, "trtllm"),  # first we know
    ({"owned_by": "someone-else"}, "native"),
    ({}, "native"),
], ids=["trtllm-serve", "ours", "first-known", "unknown-owner", "empty"])
def test_detection(card: dict[str, Any], protocol: str) -> None:
    assert detect_protocol(card) == protocol


def test_every_registered_protocol_builds_from_the_config() -> None:
    config = parse_config({"context_servers": {"urls": ["http://c:1"]}, "generation_servers": {"urls": ["http://g:1"]},
                           "gen_strip_message_history": True})
    protocols = build_protocols(config)
    assert set(protocols) == set(PROTOCOLS)
    assert isinstance(protocols["native"], NativeProtocol)
    trtllm = protocols["trtllm"]
    assert isinstance(trtllm, TrtllmProtocol) and trtllm.strip_message_history is True


def test_the_pool_detects_each_worker_of_a_mixed_fleet(cluster: Cluster) -> None:
    with contextlib.ExitStack() as stack:
        trtllm = stack.enter_context(running(TrtllmWorker("gen").app()))
        ours = start_worker(stack, "generation")
        config = parse_config({"context_servers": {"urls": [cluster.ctx.url]},
                               "generation_servers": {"urls": [trtllm, ours.url]}, "health_check_interval_s": 0.05})
        app = create_orchestrator_app(config)
        stack.enter_context(running(app))
        gen_pool = app.state.pools["generation"]
        assert eventually(lambda: all(w.healthy for w in gen_pool.workers))
        assert {w.url: w.protocol for w in gen_pool.workers} == {trtllm: "trtllm", ours.url: "native"}


def test_our_workers_started_with_lifecycle_v1_are_served_by_a_default_orchestrator() -> None:
    """They announce our wire first, and refuse any cross-side request without v1's attempt identity: their
    advertisement is read all the same, and they are spoken to in TensorRT-LLM's wire, under v1."""
    v1 = LifecycleSettings(protocol_version=1)
    with contextlib.ExitStack() as stack:
        ctx, gen = start_worker(stack, "context", lifecycle=v1), start_worker(stack, "generation", lifecycle=v1)
        node = start_orchestrator(stack, [ctx.url], [gen.url])
        reply = httpx.post(node.url + "/v1/chat/completions", json=CHAT, timeout=60)
        workers = [*node.app.state.pools["context"].workers, *node.app.state.pools["generation"].workers]
    assert reply.status_code == 200, reply.text
    assert [w.protocol for w in workers] == ["trtllm", "trtllm"] and all(w.lifecycle is not None for w in workers)
    assert sample(node.metrics, "disagg_trtllm_lifecycle_events_total", event="grant_accepted") == 1


def test_a_v1_worker_the_config_keeps_on_another_wire_takes_no_requests(caplog: pytest.LogCaptureFixture) -> None:
    """A deployment mismatch: not routable, logged once with the setting named, and a 503 for the operator rather
    than the workers' 400 that blames the client."""
    v1 = LifecycleSettings(protocol_version=1)
    with contextlib.ExitStack() as stack:
        ctx = start_worker(stack, "context", lifecycle=v1)
        gen = start_worker(stack, "generation")
        node = start_orchestrator(stack, [ctx.url], [gen.url], health_check_interval_s=0.05,
                                  context_servers={"urls": [ctx.url], "protocol": "native"})
        (worker,) = node.app.state.pools["context"].workers
        assert eventually(lambda: worker.unroutable is not None and worker.lifecycle is not None)
        reply = httpx.post(node.url + "/v1/chat/completions", json=CHAT, timeout=60)
        assert not worker.healthy
    assert reply.status_code == 503, reply.text
    assert "--lifecycle-protocol-version" in reply.json()["error"]["message"]
    warnings = [r.getMessage() for r in caplog.records if r.name == "disagg_serve.trtllm_lifecycle"]
    assert len(warnings) == 1 and "--lifecycle-protocol-version" in warnings[0]
    assert ctx.recorder is not None and not any(e.path.startswith("/v1/") and e.method == "POST"
                                                for e in ctx.recorder.exchanges)

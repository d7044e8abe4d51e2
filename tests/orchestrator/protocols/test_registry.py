"""Protocol detection: each worker is spoken to in the wire its model card says it speaks."""

from __future__ import annotations

import contextlib
from typing import Any

import pytest

from frontend.config import parse_config
from orchestrator.protocols.native import NativeProtocol
from orchestrator.protocols.registry import PROTOCOLS, build_protocols, detect_protocol
from orchestrator.protocols.trtllm.wire import TrtllmProtocol
from orchestrator.server import create_orchestrator_app
from tests.cluster import Cluster, start_worker
from tests.orchestrator.protocols.trtllm.trtllm_worker import TrtllmWorker
from tests.servers import running
from tests.waiting import eventually


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

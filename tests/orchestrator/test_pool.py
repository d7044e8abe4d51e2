from __future__ import annotations

import pytest

from frontend.errors import UpstreamUnavailableError
from frontend.guardrail import GenEngineFacts
from orchestrator.pool import HealthMonitor, WorkerPool
from orchestrator.routers import RoundRobinRouter, RoutingKey
from orchestrator.upstream.base import WorkerTimeouts
from tests.cluster import Cluster
from tests.servers import ServerThread
from workers.engines.synthetic import SyntheticEngine
from workers.server import create_worker_app
from workers.settings import WorkerSettings

KEY = RoutingKey()


def pool(failure_threshold: int = 2) -> WorkerPool:
    return WorkerPool("gen", RoundRobinRouter(), WorkerTimeouts(connect_s=2, health_s=2),
                      failure_threshold=failure_threshold)


async def test_a_new_pool_has_no_healthy_worker_until_checked(cluster: Cluster) -> None:
    gen = pool()
    try:
        worker = gen.add(cluster.gen.url)
        assert gen.has_healthy is False
        with pytest.raises(UpstreamUnavailableError, match="no healthy gen worker"):
            gen.pick(KEY)
        await gen.check_health()
        assert worker.healthy is True
        assert gen.pick(KEY) is worker
        assert worker.facts == GenEngineFacts(kv_block_reuse=False, prompt_tokens_in_handoff=False)
    finally:
        await gen.aclose()


async def test_adding_a_url_twice_keeps_one_member(cluster: Cluster) -> None:
    gen = pool()
    try:
        first = gen.add(cluster.gen.url + "/")
        assert gen.add(cluster.gen.url) is first
        assert len(gen.workers) == 1
    finally:
        await gen.aclose()


async def test_round_robin_over_healthy_workers_skipping_tried_ones(cluster: Cluster) -> None:
    gen = pool()
    try:
        a, b = gen.add(cluster.gen.url), gen.add(cluster.aggregated.url)
        await HealthMonitor([gen], interval_s=3600).check_now()
        picks = [gen.pick(KEY) for _ in range(4)]
        assert picks.count(a) == picks.count(b) == 2
        assert gen.pick(KEY, exclude=[a]) is b
        with pytest.raises(UpstreamUnavailableError, match="tried"):
            gen.pick(KEY, exclude=[a, b])
    finally:
        await gen.aclose()


async def test_a_worker_that_stops_answering_leaves_after_the_failure_threshold() -> None:
    server = ServerThread(create_worker_app(SyntheticEngine(), WorkerSettings(role="generation")))
    url = server.start()
    gen = pool(failure_threshold=2)
    try:
        worker = gen.add(url)
        await gen.check_health()
        assert worker.healthy is True
        server.stop()
        await gen.check_health()
        assert worker.healthy is True  # one failed check is not enough
        await gen.check_health()
        assert worker.healthy is False
        assert worker.facts is None  # forgotten: it may come back with another engine
    finally:
        server.stop()
        await gen.aclose()


async def test_removing_a_worker_takes_it_out_of_routing(cluster: Cluster) -> None:
    gen = pool()
    try:
        worker = gen.add(cluster.gen.url)
        await gen.check_health()
        assert gen.remove(cluster.gen.url) is True
        assert gen.remove(cluster.gen.url) is False
        assert worker.healthy is False
        assert gen.workers == []
    finally:
        await gen.aclose()

from __future__ import annotations

import asyncio
import socket

import pytest

from entrypoints.launcher import free_port
from frontend.errors import UpstreamUnavailableError
from frontend.guardrail import GenEngineFacts
from orchestrator.circuit_breaker import CLOSED, OPEN
from orchestrator.pool import HealthMonitor, PoolsWait, WorkerPool
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


def closed_port_url() -> str:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return f"http://127.0.0.1:{sock.getsockname()[1]}"


async def test_a_worker_that_says_it_drains_leaves_routing_at_once_and_is_not_failed() -> None:
    app = create_worker_app(SyntheticEngine(), WorkerSettings(role="generation"))
    server = ServerThread(app)
    url = server.start()
    gen = pool(failure_threshold=3)
    try:
        worker = gen.add(url)
        await gen.check_health()
        assert worker.healthy is True
        assert gen.expects_worker() is False  # a healthy pool waits for nothing
        app.state.drain.draining = True  # what SIGTERM starts (workers/drain.py)
        await gen.check_health()
        assert worker.healthy is False and worker.draining  # one check, not the failure threshold's three
        assert worker.breaker.state == CLOSED  # a drain is no failure
        assert gen.expects_worker() is True  # it, or its replacement, is coming back
    finally:
        server.stop()
        await gen.aclose()


async def test_a_pool_whose_workers_crashed_or_are_gone_expects_none_and_nothing_waits() -> None:
    gen = pool()
    try:
        # Bounded far beyond the test: a wait that began would hang it (and fail it at eventually's bound).
        assert await asyncio.wait_for(gen.wait_for_worker(3600), 60) is False  # empty by configuration
        gen.add(closed_port_url())
        await gen.check_health()
        assert await asyncio.wait_for(gen.wait_for_worker(3600), 60) is False  # nothing says it comes back
        assert PoolsWait([gen]).expected() is False
    finally:
        await gen.aclose()


async def test_a_worker_back_while_requests_wait_is_taken_back_on_its_first_good_check() -> None:
    port = free_port()
    first_app = create_worker_app(SyntheticEngine(), WorkerSettings(role="generation"))
    first = ServerThread(first_app, port=port)
    url = first.start()
    # Five good checks to rejoin, and no health monitor running: only the waiters' own probe can take it back.
    gen = WorkerPool("gen", RoundRobinRouter(), WorkerTimeouts(connect_s=2, health_s=2), recovery_threshold=5,
                     wait_for_worker_s=3600)
    second: ServerThread | None = None
    try:
        worker = gen.add(url)
        for _ in range(5):
            await gen.check_health()
        assert worker.healthy is True
        for _ in range(5):  # requests failed as it went (streams cut at its drain's timeout): its breaker opened
            worker.breaker.failed(worker.breaker.started())
        assert worker.breaker.state == OPEN
        first_app.state.drain.draining = True
        await gen.check_health()
        first.stop()
        waiters = [asyncio.create_task(gen.wait_for_worker()) for _ in range(3)]
        wait = asyncio.create_task(PoolsWait([gen]).back(3600))
        second = ServerThread(create_worker_app(SyntheticEngine(), WorkerSettings(role="generation")), port=port)
        second.start()  # the restarted worker, on the same address
        assert await asyncio.wait_for(asyncio.gather(*waiters), 60) == [True, True, True]
        await asyncio.wait_for(wait, 60)
        # Routable at once: what the breaker counted while it was going away says nothing of the new process.
        assert worker.routable and not worker.draining
        assert worker.breaker.state == CLOSED
    finally:
        first.stop()
        if second is not None:
            second.stop()
        await gen.aclose()

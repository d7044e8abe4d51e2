"""The one retry policy, against scripted workers: what is retried, on which worker, what is counted, and when
it gives up."""

from __future__ import annotations

import asyncio
import time

import pytest

from frontend.errors import UpstreamError, UpstreamTimeoutError, UpstreamUnavailableError
from frontend.metrics import Metrics
from orchestrator.flow.retry import RetryPolicy
from orchestrator.member import PoolMember
from orchestrator.pool import WorkerPool
from orchestrator.routers import RoundRobinRouter, RoutingKey
from orchestrator.upstream.base import Reply, WorkerTimeouts
from tests.cluster import sample
from tests.orchestrator.upstream.scripted_transport import ScriptedTransport, ScriptedTransports, Step

A, B, C = "http://a:1", "http://b:1", "http://c:1"
OK = Reply(200, b"{}")


def pool_of(scripts: dict[str, list[Step]]) -> WorkerPool:
    pool = WorkerPool("ctx", RoundRobinRouter(), WorkerTimeouts(), transport_factory=ScriptedTransports(scripts))
    for url in scripts:
        pool.add(url).healthy = True
    return pool


@pytest.fixture
def metrics() -> Metrics:
    return Metrics()


async def post(member: PoolMember) -> Reply:
    return await member.transport.post("/v1/x", b"{}")


async def run(policy: RetryPolicy, pool: WorkerPool) -> tuple[Reply, str, int]:
    done = await policy.run("ctx", pool, RoutingKey(), post)
    return done.answer, done.member.url, done.attempts


async def test_an_answer_on_the_first_worker_is_returned_at_once(metrics: Metrics) -> None:
    pool = pool_of({A: [OK], B: []})
    assert await run(RetryPolicy(1, metrics), pool) == (OK, A, 1)
    assert sample(metrics, "disagg_upstream_retries_total", step="ctx", reason="status_5xx") == 0


async def test_a_refused_connection_moves_on_and_takes_the_worker_out(metrics: Metrics) -> None:
    pool = pool_of({A: [UpstreamUnavailableError("refused")], B: [OK]})
    assert await run(RetryPolicy(1, metrics), pool) == (OK, B, 2)
    assert [w.healthy for w in pool.workers] == [False, True]  # passive health
    assert sample(metrics, "disagg_upstream_retries_total", step="ctx", reason="UpstreamUnavailableError") == 1
    assert sample(metrics, "disagg_upstream_failovers_total", step="ctx") == 1


async def test_a_timeout_moves_on_but_leaves_the_worker_in(metrics: Metrics) -> None:
    pool = pool_of({A: [UpstreamTimeoutError("slow")], B: [OK]})
    assert await run(RetryPolicy(1, metrics), pool) == (OK, B, 2)
    assert [w.healthy for w in pool.workers] == [True, True]


async def test_a_5xx_moves_on_without_counting_a_failover(metrics: Metrics) -> None:
    pool = pool_of({A: [Reply(503, b"busy")], B: [OK]})
    assert await run(RetryPolicy(1, metrics), pool) == (OK, B, 2)
    assert sample(metrics, "disagg_upstream_retries_total", step="ctx", reason="status_5xx") == 1
    assert sample(metrics, "disagg_upstream_failovers_total", step="ctx") == 0
    assert [w.healthy for w in pool.workers] == [True, True]


async def test_a_4xx_is_an_answer_not_a_failure(metrics: Metrics) -> None:
    refused = Reply(400, b'{"error": {}}')
    pool = pool_of({A: [refused], B: []})
    assert await run(RetryPolicy(3, metrics), pool) == (refused, A, 1)


async def test_out_of_retries_an_error_is_raised_naming_the_step(metrics: Metrics) -> None:
    pool = pool_of({A: [UpstreamError("broke")], B: [UpstreamError("broke")], C: [UpstreamError("broke")]})
    with pytest.raises(UpstreamError, match=r"the CTX step failed after 2 attempt\(s\): broke") as caught:
        await run(RetryPolicy(1, metrics), pool)
    assert type(caught.value) is UpstreamError
    assert isinstance(caught.value.__cause__, UpstreamError)
    calls = [len(w.transport.calls) for w in pool.workers if isinstance(w.transport, ScriptedTransport)]
    assert sorted(calls) == [0, 1, 1]  # max_retries=1: two workers tried, not three


async def test_the_raised_error_keeps_the_last_failures_kind(metrics: Metrics) -> None:
    pool = pool_of({A: [UpstreamTimeoutError("slow")], B: [UpstreamTimeoutError("slow")]})
    with pytest.raises(UpstreamTimeoutError, match="slow"):
        await run(RetryPolicy(1, metrics), pool)


async def test_out_of_retries_a_5xx_is_returned_to_be_relayed(metrics: Metrics) -> None:
    last = Reply(502, b"bad gateway")
    pool = pool_of({A: [Reply(503, b"busy")], B: [last]})
    assert await run(RetryPolicy(1, metrics), pool) == (last, B, 2)


async def test_no_retries_at_all(metrics: Metrics) -> None:
    pool = pool_of({A: [UpstreamUnavailableError("refused")], B: [OK]})
    with pytest.raises(UpstreamUnavailableError, match="after 1 attempt"):
        await run(RetryPolicy(0, metrics), pool)


async def test_when_no_worker_is_left_the_last_failure_stands(metrics: Metrics) -> None:
    pool = pool_of({A: [UpstreamUnavailableError("refused")]})
    with pytest.raises(UpstreamUnavailableError, match=r"the CTX step failed after 1 attempt\(s\): refused"):
        await run(RetryPolicy(5, metrics), pool)


async def test_a_5xx_from_the_only_worker_is_its_answer_not_an_unavailable_pool(metrics: Metrics) -> None:
    failed = Reply(500, b'{"error":{"message":"the engine core restarted","code":"engine_error"}}')
    pool = pool_of({A: [failed]})
    assert await run(RetryPolicy(5, metrics), pool) == (failed, A, 1)
    assert [w.healthy for w in pool.workers] == [True]


async def test_a_deterministic_failure_is_never_retried(metrics: Metrics) -> None:
    failed = Reply(500, b'{"error":{"message":"bad request for the engine","code":"engine_request_failed"}}')
    pool = pool_of({A: [failed], B: [OK]})
    assert await run(RetryPolicy(5, metrics), pool) == (failed, A, 1)
    assert sample(metrics, "disagg_upstream_retries_total", step="ctx", reason="status_5xx") == 0


async def test_a_4xx_is_an_answer_and_never_retried(metrics: Metrics) -> None:
    refused = Reply(400, b'{"error":{"message":"seed: bad","code":null}}')
    pool = pool_of({A: [refused], B: [OK]})
    assert await run(RetryPolicy(5, metrics), pool) == (refused, A, 1)


async def test_a_request_waits_for_a_worker_only_what_is_left_of_the_pool_s_bound_since_it_began(
        metrics: Metrics) -> None:
    # The only worker drains (it or its replacement is expected back): a request that already waited the whole
    # bound (at admission, or in the step before) must not wait it all over again.
    pool = WorkerPool("ctx", RoundRobinRouter(), WorkerTimeouts(), wait_for_worker_s=3600,
                      transport_factory=ScriptedTransports({A: []}))
    try:
        pool.add(A).mark_draining()
        assert pool.expects_worker()
        began = time.perf_counter() - 3600
        # Bounded far beyond the test: a wait that began would hang it.
        with pytest.raises(UpstreamUnavailableError):
            await asyncio.wait_for(RetryPolicy(1, metrics).run("ctx", pool, RoutingKey(), post, wait_from=began), 60)
    finally:
        await pool.aclose()

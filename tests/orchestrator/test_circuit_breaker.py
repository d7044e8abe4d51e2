"""The circuit breaker: closed, open after failures in a row, half-open with one trial after the cool-down, closed
again on its success or open twice as long on its failure; and in the retry policy, a worker that keeps failing
requests taken out of routing though its health checks pass, its state a metric."""

from __future__ import annotations

from frontend.errors import UpstreamTimeoutError
from frontend.metrics import Metrics
from orchestrator.circuit_breaker import CLOSED, HALF_OPEN, OPEN, CircuitBreaker
from orchestrator.flow.retry import RetryPolicy
from orchestrator.pool import BreakerSettings, WorkerPool
from orchestrator.routers import RoundRobinRouter, RoutingKey
from orchestrator.upstream.base import Reply, WorkerTimeouts
from tests.cluster import sample
from tests.orchestrator.flow.test_retry import post
from tests.orchestrator.test_response_store import FakeClock
from tests.orchestrator.upstream.scripted_transport import ScriptedTransports, Step

A, B = "http://a:1", "http://b:1"
OK = Reply(200, b"{}")
FAILED = Reply(503, b'{"error": {"message": "engine down", "type": "server_error", "param": null, "code": null}}')


def test_failures_in_a_row_open_it_and_a_success_between_them_does_not() -> None:
    breaker = CircuitBreaker(failures=3, cooldown_s=10, clock=FakeClock())
    for outcome in ("failed", "failed", "succeeded", "failed", "failed"):
        getattr(breaker, outcome)(breaker.started())
    assert breaker.state == CLOSED and breaker.allows()
    breaker.failed(breaker.started())
    assert breaker.state == OPEN and not breaker.allows()


def test_after_the_cool_down_one_trial_decides() -> None:
    clock = FakeClock()
    states: list[int] = []
    breaker = CircuitBreaker(failures=1, cooldown_s=10, clock=clock, on_change=states.append)
    breaker.failed(breaker.started())
    clock.now += 10
    assert breaker.state == HALF_OPEN and breaker.allows()
    trial = breaker.started()
    assert not breaker.allows()  # one trial at a time
    breaker.failed(trial)  # the trial failed: open twice as long
    clock.now += 19
    assert breaker.state == OPEN
    clock.now += 1
    assert breaker.allows()
    breaker.abandoned(breaker.started())  # the client left: the trial is given back
    assert breaker.allows()
    breaker.succeeded(breaker.started())
    assert breaker.state == CLOSED
    assert states == [OPEN, HALF_OPEN, OPEN, HALF_OPEN, CLOSED]
    breaker.failed(breaker.started())  # the cool-down is back to its base
    clock.now += 10
    assert breaker.state == HALF_OPEN


def test_an_outcome_counts_only_for_the_state_its_call_started_in() -> None:
    clock = FakeClock()
    breaker = CircuitBreaker(failures=1, cooldown_s=10, clock=clock)
    slow = breaker.started()  # a long call, started while closed
    breaker.failed(breaker.started())  # another fails: open
    breaker.succeeded(slow)  # the slow one succeeds late: the breaker stays open
    assert breaker.state == OPEN
    clock.now += 10
    trial = breaker.started()
    other = breaker.started()  # not a trial: the half-open breaker allows one
    assert (trial.is_trial, other.is_trial) == (True, False)
    breaker.abandoned(other)  # gives back nothing: it was not the trial
    assert not breaker.allows()
    breaker.succeeded(trial)
    assert breaker.state == CLOSED


async def test_a_worker_that_fails_every_request_is_routed_around_while_its_health_checks_pass() -> None:
    metrics = Metrics()
    states: dict[str, int] = {}
    settings = BreakerSettings(2, 10.0, lambda url, state: states.__setitem__(url, state))
    scripts: dict[str, list[Step]] = {A: [FAILED, UpstreamTimeoutError("slow")], B: [OK] * 6}
    pool = WorkerPool("gen", RoundRobinRouter(), WorkerTimeouts(), transport_factory=ScriptedTransports(scripts),
                      breaker=settings)
    for url in scripts:
        pool.add(url).healthy = True
    policy = RetryPolicy(1, metrics)
    assert states == {A: CLOSED, B: CLOSED}
    for _ in range(6):
        done = await policy.run("gen", pool, RoutingKey(), post)
        assert done.answer == OK and done.member.url == B
    assert states == {A: OPEN, B: CLOSED}
    assert [w.healthy for w in pool.workers] == [True, True]  # health checks still pass: the breaker decides
    assert sample(metrics, "disagg_upstream_retries_total", step="gen", reason="status_5xx") == 1

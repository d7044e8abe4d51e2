"""A fresh orchestrator exports every labelled series whose labels are known at 0, before its first request (real
servers, read over HTTP), and what a retry or a request counts later lands in one of those series, never a new one."""

from __future__ import annotations

import contextlib

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from frontend.config import parse_config
from frontend.errors import UpstreamError, UpstreamTimeoutError, UpstreamUnavailableError
from frontend.guardrail import FallbackReason
from frontend.metrics import Metrics
from orchestrator.flow.retry import RetryPolicy
from orchestrator.metric_labels import MIGRATION_OUTCOMES, RETRIED_STEPS, export_known_series
from orchestrator.pool import WorkerPool
from orchestrator.routers import RoundRobinRouter, RoutingKey
from orchestrator.server import create_orchestrator_app
from orchestrator.upstream.base import Reply, WorkerTimeouts
from tests.cluster import MODEL, start_orchestrator, start_worker
from tests.orchestrator.upstream.scripted_transport import ScriptedTransports, Step
from tests.servers import running

Samples = dict[tuple[str, frozenset[tuple[str, str]]], float]

STEPS = ("ctx", "gen", "models")
RETRY_REASONS = ("UpstreamError", "UpstreamUnavailableError", "UpstreamTimeoutError", "status_5xx")


def scrape(url: str) -> Samples:
    text = httpx.get(url + "/metrics", timeout=10).text
    return {(s.name, frozenset(s.labels.items())): s.value
            for family in text_string_to_metric_families(text) for s in family.samples}


def value(samples: Samples, name: str, **labels: str) -> float | None:
    return samples.get((name, frozenset(labels.items())))


def series(samples: Samples, name: str) -> set[frozenset[tuple[str, str]]]:
    return {labels for sample_name, labels in samples if sample_name == name}


def test_a_fresh_orchestrator_exports_every_known_series_at_zero() -> None:
    with contextlib.ExitStack() as stack:
        ctx, gen = start_worker(stack, "context"), start_worker(stack, "generation")
        orchestrator = start_orchestrator(stack, [ctx.url], [gen.url])
        fresh = scrape(orchestrator.url)
        for step in STEPS:
            assert value(fresh, "disagg_upstream_failovers_total", step=step) == 0, step
            for reason in RETRY_REASONS:
                assert value(fresh, "disagg_upstream_retries_total", step=step, reason=reason) == 0, (step, reason)
        assert value(fresh, "disagg_upstream_retries_total", step="ctx", reason="handoff_lost") == 0
        for fallback in FallbackReason:
            assert value(fresh, "disagg_metadata_only_fallback_total", reason=fallback.value) == 0, fallback
        assert value(fresh, "disagg_ctx_step_seconds_count", worker=ctx.url) == 0
        assert value(fresh, "disagg_gen_first_byte_seconds_count", worker=gen.url) == 0
        assert value(fresh, "disagg_gen_first_byte_seconds_bucket", worker=gen.url, le="+Inf") == 0
        assert value(fresh, "disagg_gen_prompt_tokens_recomputed_total", pool="gen", worker=gen.url) == 0
        for outcome in MIGRATION_OUTCOMES:
            assert value(fresh, "disagg_stream_migrations_total", pool="gen", worker=gen.url, outcome=outcome) == 0
        assert series(fresh, "disagg_stream_migrations_total") == {
            frozenset({"pool": "gen", "worker": gen.url, "outcome": o}.items()) for o in MIGRATION_OUTCOMES}
        for endpoint in ("chat", "completions", "responses", "messages"):
            assert value(fresh, "disagg_request_latency_seconds_count", endpoint=endpoint) == 0, endpoint

        # A request is counted in the series exported at start-up: the pool's worker URLs are the flow's labels.
        # (Streamed: GEN's first byte is timed for streams.)
        reply = httpx.post(orchestrator.url + "/v1/completions", timeout=30,
                           json={"model": MODEL, "prompt": "hello", "max_tokens": 4, "stream": True})
        assert reply.status_code == 200 and reply.text.endswith("data: [DONE]\n\n"), reply.text
        # /v1/messages runs as chat, counted under its own label: one of those exported too.
        message = httpx.post(orchestrator.url + "/v1/messages", timeout=30,
                             json={"model": MODEL, "max_tokens": 2, "stream": True,
                                   "messages": [{"role": "user", "content": "hi"}]})
        assert message.status_code == 200 and "event: message_stop" in message.text, message.text
        served = scrape(orchestrator.url)
    for name in ("disagg_ctx_step_seconds_count", "disagg_gen_first_byte_seconds_count"):
        assert series(served, name) == series(fresh, name)
        assert sum(v for (sample_name, _), v in served.items() if sample_name == name) == 2, name
    assert series(served, "disagg_request_latency_seconds_count") == \
        series(fresh, "disagg_request_latency_seconds_count")
    assert value(served, "disagg_request_latency_seconds_count", endpoint="completions") == 1
    assert value(served, "disagg_request_latency_seconds_count", endpoint="messages") == 1


def test_a_worker_that_joins_later_has_its_series_exported_at_zero_and_kept_after_it_leaves() -> None:
    """Registered over the admin API (DNS discovery adds members the same way): its per-worker series are there
    before its first request, and stay once it has left, as a counter's do."""
    admin = {"Authorization": "Bearer admin-secret"}
    with contextlib.ExitStack() as stack:
        ctx, gen = start_worker(stack, "context"), start_worker(stack, "generation")
        config = parse_config({"context_servers": {"registration": True}, "generation_servers": {"registration": True}})
        orchestrator = stack.enter_context(running(create_orchestrator_app(config, admin_key="admin-secret")))
        assert not series(scrape(orchestrator), "disagg_stream_migrations_total")
        for role, worker in (("context", ctx), ("generation", gen)):
            joined = httpx.post(orchestrator + "/admin/workers", json={"role": role, "url": worker.url},
                                headers=admin, timeout=10)
            assert joined.status_code == 201, joined.text
        after_joining = scrape(orchestrator)
        assert value(after_joining, "disagg_ctx_step_seconds_count", worker=ctx.url) == 0
        assert value(after_joining, "disagg_gen_first_byte_seconds_count", worker=gen.url) == 0
        assert value(after_joining, "disagg_gen_prompt_tokens_recomputed_total", pool="gen", worker=gen.url) == 0
        for outcome in MIGRATION_OUTCOMES:
            assert value(after_joining, "disagg_stream_migrations_total", pool="gen", worker=gen.url,
                         outcome=outcome) == 0, outcome
        left = httpx.request("DELETE", orchestrator + "/admin/workers", json={"role": "generation", "url": gen.url},
                             headers=admin, timeout=10)
        assert left.json()["removed"] is True
        after_leaving = scrape(orchestrator)
    for name in ("disagg_stream_migrations_total", "disagg_gen_prompt_tokens_recomputed_total"):
        assert series(after_leaving, name) == series(after_joining, name), name


A, B = "http://a:1", "http://b:1"


@pytest.mark.parametrize("failure", [UpstreamError("broke"), UpstreamUnavailableError("refused"),
                                     UpstreamTimeoutError("slow"), Reply(503, b"busy")],
                         ids=["error", "unavailable", "timeout", "5xx"])
async def test_what_a_retry_counts_is_a_series_exported_at_start_up(failure: Step) -> None:
    metrics = Metrics()
    export_known_series(metrics, [], [])
    families = ("disagg_upstream_retries_total", "disagg_upstream_failovers_total")
    exported = {(s.name, frozenset(s.labels.items())) for family in metrics.registry.collect()
                for s in family.samples if s.name in families}
    for step in RETRIED_STEPS:
        pool = WorkerPool(step, RoundRobinRouter(), WorkerTimeouts(),
                          transport_factory=ScriptedTransports({A: [failure], B: [Reply(200, b"{}")]}))
        for url in (A, B):
            pool.add(url).healthy = True
        done = await RetryPolicy(1, metrics).run(step, pool, RoutingKey(),
                                                 lambda member: member.transport.post("/v1/x", b"{}"))
        assert done.attempts == 2
    counted = {(s.name, frozenset(s.labels.items())) for family in metrics.registry.collect()
               for s in family.samples if s.name in families and s.value}
    assert len(counted) >= len(RETRIED_STEPS)  # it did count: one retry per step (and a failover per failed call)
    assert counted <= exported

"""The label values of the orchestrator's labelled metrics, and every series they make exported at 0 from start-up.

prometheus_client exports a labelled series only once its child exists; left to the first event, a fresh system's
dashboards would show "No data" (and ``rate()`` no zero) where the truth is "none so far"."""

from __future__ import annotations

from collections.abc import Iterable

from frontend.errors import UpstreamError
from frontend.guardrail import FallbackReason
from frontend.metrics import Metrics
from orchestrator.flow.request import PATHS
from orchestrator.routers import ROUTING_DECISIONS

# The steps the retry policy runs (its ``step`` label).
CTX_STEP = "ctx"
GEN_STEP = "gen"
MODELS_STEP = "models"  # /v1/models, asked of a CTX worker
RETRIED_STEPS = (CTX_STEP, GEN_STEP, MODELS_STEP)
# Retry reasons that are not an error type: a 5xx answer tried on another worker (the literal
# orchestrator/flow/retry.py counts; tests/orchestrator/test_metric_labels.py holds the two together), and CTX run again
# because the KV hand-off was lost with a failed GEN.
STATUS_5XX = "status_5xx"
HANDOFF_LOST = "handoff_lost"
# Where a prompt is prefilled (disagg_prefill_placement): through CTX, or on GEN alone for being short, or for
# GEN holding all but a short remainder of it.
ON_CTX, ON_GEN_SHORT, ON_GEN_CACHED = "ctx", "gen_short", "gen_cached"
PREFILL_PLACEMENTS = (ON_CTX, ON_GEN_SHORT, ON_GEN_CACHED)
CTX_POOL_NAME, GEN_POOL_NAME = "ctx", "gen"  # the pools' names (orchestrator.server): a metric label
POOLS = (CTX_POOL_NAME, GEN_POOL_NAME)
RESPONSE_STORE_OPERATIONS = ("get", "put", "delete")  # the calls a shared Responses store counts and times
# How a pair probe of a CTX/GEN pair ended (orchestrator/pair_probe.py says what each means).
PROBE_PASSED, PROBE_RECOMPUTED, PROBE_FAILED, PROBE_UNVERIFIED = "passed", "recomputed", "failed", "unverified"
PROBE_OUTCOMES = (PROBE_PASSED, PROBE_RECOMPUTED, PROBE_FAILED, PROBE_UNVERIFIED)
# What became of a GEN stream that broke mid-way (orchestrator/flow/migration.py): continued on another GEN worker,
# or not, for want of a CTX or GEN to continue on, past the request's migration limit, or on a stream that cannot move.
MIGRATION_RESUMED, MIGRATION_FAILED = "resumed", "failed"
MIGRATION_OVER_LIMIT, MIGRATION_NOT_RESUMABLE = "over_limit", "not_resumable"
MIGRATION_OUTCOMES = (MIGRATION_RESUMED, MIGRATION_FAILED, MIGRATION_OVER_LIMIT, MIGRATION_NOT_RESUMABLE)
# The routes' ``endpoint`` label: the flow's endpoints, and /v1/messages, which runs as chat under its own name
# (orchestrator/messages.py; tests/orchestrator/test_metric_labels.py holds the route's label to this one).
MESSAGES_ENDPOINT = "messages"
ENDPOINT_LABELS = (*PATHS, MESSAGES_ENDPOINT)


def upstream_failure_reasons() -> tuple[str, ...]:
    """The retry policy counts a failed call by the name of its ``UpstreamError`` type: that class or a subclass."""
    names: list[str] = []
    kinds: list[type[UpstreamError]] = [UpstreamError]
    while kinds:
        kind = kinds.pop(0)
        names.append(kind.__name__)
        kinds.extend(kind.__subclasses__())
    return tuple(names)


def export_ctx_worker_series(metrics: Metrics, url: str) -> None:
    """The series of CTX worker ``url``: exported for those in the pool at start-up and for each that joins later
    (kept, like any counter's, once it has left)."""
    metrics.ctx_latency.labels(worker=url)


def export_gen_worker_series(metrics: Metrics, url: str) -> None:
    """The series of GEN worker ``url``, as ``export_ctx_worker_series``."""
    metrics.gen_first_byte.labels(worker=url)
    metrics.gen_prompt_recomputed.labels(pool=GEN_POOL_NAME, worker=url)
    for outcome in MIGRATION_OUTCOMES:
        metrics.stream_migrations.labels(pool=GEN_POOL_NAME, worker=url, outcome=outcome)


def export_known_series(metrics: Metrics, ctx_workers: Iterable[str], gen_workers: Iterable[str]) -> None:
    """Create the child of every known label combination (the workers: those in the pools at start-up; those that
    join later are exported as they join, ``orchestrator.server``)."""
    reasons = (*upstream_failure_reasons(), STATUS_5XX)
    for step in RETRIED_STEPS:
        metrics.failovers.labels(step=step)  # a failover is a retry after a failed call, never after a 5xx
        for reason in reasons:
            metrics.retries.labels(step=step, reason=reason)
    metrics.retries.labels(step=CTX_STEP, reason=HANDOFF_LOST)
    for fallback in FallbackReason:
        metrics.metadata_only_fallback.labels(reason=fallback.value)
    for pool in POOLS:
        for decision in ROUTING_DECISIONS:
            metrics.routing_decisions.labels(pool=pool, decision=decision)
    for placement in PREFILL_PLACEMENTS:
        metrics.prefill_placement.labels(placement=placement)
    for outcome in PROBE_OUTCOMES:
        metrics.pair_probes.labels(outcome=outcome)
    for endpoint in ENDPOINT_LABELS:
        metrics.request_latency.labels(endpoint=endpoint)
    for operation in RESPONSE_STORE_OPERATIONS:
        metrics.response_store_errors.labels(operation=operation)
        metrics.response_store_latency.labels(operation=operation)
    for url in ctx_workers:
        export_ctx_worker_series(metrics, url)
    for url in gen_workers:
        export_gen_worker_series(metrics, url)

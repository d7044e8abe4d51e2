"""Prometheus metrics. Each process (and each app built in a test) owns its registry, so apps never collide."""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from typing import Generic, TypeVar

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.exposition import CONTENT_TYPE_LATEST
from prometheus_client.multiprocess import MultiProcessCollector

METRICS_CONTENT_TYPE = CONTENT_TYPE_LATEST
MULTIPROC_ENV = "PROMETHEUS_MULTIPROC_DIR"

# Why a front end cut a client's connection: its head took longer than the header timeout, or was longer than the
# head limit (431); its body went without a byte for the body timeout, or came slower than the body's minimum rate
# (408); its head was malformed (400); it stopped reading an answer for the send timeout; or its body was refused
# (429) because the bytes of bodies being read, or its address's bodies being read, were at their limit.
CONNECTION_CUT_REASONS = ("head_timeout", "head_too_large", "body_timeout", "bad_request", "send_stalled",
                          "body_overload")

_LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0, 300.0)


@dataclass
class Metrics:
    registry: CollectorRegistry = field(default_factory=CollectorRegistry)

    def __post_init__(self) -> None:
        r = self.registry
        self.requests = Counter(
            "disagg_requests", "Requests served, by role, endpoint and HTTP status", ["role", "endpoint", "status"],
            registry=r,
        )
        self.gen_prompt_path = Counter(
            "disagg_gen_prompt_path", "How GEN received the prompt: array (b64), list, or metadata_only", ["path"],
            registry=r,
        )
        self.engine_inflight = Gauge(
            "disagg_engine_inflight_requests", "Requests inside the engine right now", ["role"], registry=r,
            multiprocess_mode="livesum",
        )
        self.time_to_first_token = Histogram(
            "disagg_time_to_first_token_seconds", "Orchestrator: request start to first byte of output",
            buckets=_LATENCY_BUCKETS, registry=r,
        )
        self.request_latency = Histogram(
            "disagg_request_latency_seconds", "Orchestrator: whole-request latency", ["endpoint"],
            buckets=_LATENCY_BUCKETS, registry=r,
        )
        self.ctx_latency = Histogram(
            "disagg_ctx_step_seconds", "Orchestrator: time in the CTX step, by CTX worker", ["worker"],
            buckets=_LATENCY_BUCKETS, registry=r,
        )
        # Streams that broke after the client had part of the answer (orchestrator/flow/migration.py): by the GEN
        # worker that broke and what became of the stream (resumed on another, failed, over_limit, not_resumable).
        self.stream_migrations = Counter(
            "disagg_stream_migrations", "Orchestrator: GEN streams that broke mid-way, by pool, worker and outcome",
            ["pool", "worker", "outcome"], registry=r,
        )
        self.gen_first_byte = Histogram(
            "disagg_gen_first_byte_seconds", "Orchestrator: GEN request sent to its first byte, by GEN worker",
            ["worker"], buckets=_LATENCY_BUCKETS, registry=r,
        )
        # GEN workers that prefilled prompt tokens the KV hand-off should have carried (orchestrator/recompute_watch.py)
        self.gen_prompt_recomputed = Counter(
            "disagg_gen_prompt_tokens_recomputed", "Orchestrator: prompt tokens a GEN worker computed itself although "
            "CTX had handed their KV off (a failed or misconfigured KV transfer), by pool and GEN worker",
            ["pool", "worker"], registry=r,
        )
        # The pair probe (orchestrator/pair_probe.py): each CTX/GEN pair's last verdict, and the probes by outcome.
        self.pair_probe_passing = Gauge(
            "disagg_pair_probe_passing", "Orchestrator: 1 while the CTX/GEN pair passed its last probe (GEN took the "
            "KV from CTX), 0 while it failed (kept out of routing)", ["ctx", "gen"], registry=r,
            multiprocess_mode="livemin",
        )
        self.pair_probes = Counter(
            "disagg_pair_probes", "Orchestrator: pair probes run, by outcome (passed, recomputed, failed, unverified)",
            ["outcome"], registry=r,
        )
        self.inter_token_latency = Histogram(
            "disagg_inter_token_latency_seconds", "Orchestrator: gap between stream chunks relayed from GEN",
            buckets=(0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5), registry=r,
        )
        self.failovers = Counter(
            "disagg_upstream_failovers", "Requests moved to another worker after one failed, by step", ["step"],
            registry=r,
        )
        self.local_prefill = Counter(
            "disagg_local_prefill_requests", "Short prompts sent to GEN alone (conditional disaggregation)",
            registry=r,
        )
        self.routing_decisions = Counter(
            "disagg_routing_decisions", "Cache-aware routing choices: cache_hit (the worker holding the longest "
            "prefix), spill (another, for load), cold (no worker holds any), session (the conversation's own worker)",
            ["pool", "decision"], registry=r,
        )
        self.prefill_placement = Counter(
            "disagg_prefill_placement", "Where prompts were prefilled: ctx, gen_short (a short prompt, on GEN "
            "alone), gen_cached (GEN held all but a short remainder: CTX and the KV transfer skipped)",
            ["placement"], registry=r,
        )
        self.ctx_finished = Counter(
            "disagg_ctx_finished_requests", "Requests CTX finished by itself (GEN never called)", registry=r
        )
        self.metadata_only_fallback = Counter(
            "disagg_metadata_only_fallback", "Metadata-only mode not taken, by reason", ["reason"], registry=r
        )
        self.trtllm_lifecycle = Counter(
            "disagg_trtllm_lifecycle_events", "TensorRT-LLM lifecycle v1 control calls to trtllm-serve workers, by "
            "event (grant_accepted, grant_refused, grant_ambiguous, grant_renew_failed, grant_aborted, "
            "artifact_aborted, echo_mismatch, and *_failed for a clean-up call that failed)", ["event"], registry=r,
        )
        self.retries = Counter(
            "disagg_upstream_retries", "Orchestrator retries, by step and reason", ["step", "reason"], registry=r
        )
        self.event_loop_lag = Histogram(
            "disagg_event_loop_lag_seconds", "How late a 50 ms timer fires on this process's event loop",
            buckets=(0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0), registry=r,
        )
        self.kv_store_entries = Gauge("disagg_kv_store_entries", "KV hand-offs held for GEN", registry=r,
                                      multiprocess_mode="max")
        self.kv_store_bytes = Gauge("disagg_kv_store_bytes", "Bytes of KV hand-offs held for GEN", registry=r,
                                    multiprocess_mode="max")
        # What this worker publishes that its engine holds (workers/prefix_holdings.py), read when scraped.
        self.prefix_holdings_tokens = Gauge(
            "disagg_worker_prefix_holdings_tokens", "Prompt tokens of KV this worker's engine holds for reuse, as "
            "published in its KV events (prefix-chain links, aged to the engine's prefix-cache capacity)",
            registry=r, multiprocess_mode="max",
        )
        # The worker's prompt tokenization (workers/tokenization/), moved in from its running totals when scraped.
        self.tokenize_prompts = Counter(
            "disagg_tokenize_prompts", "Prompt texts this worker tokenized", registry=r)
        self.tokenize_encoded_tokens = Counter(
            "disagg_tokenize_encoded_tokens", "Prompt tokens this worker's encoder produced (the rest of each "
            "prompt's tokens came from the conversation cache)", registry=r)
        self.tokenize_cache_hits = Counter(
            "disagg_tokenize_cache_hits", "Prompts whose start was found in the conversation cache", registry=r)
        self.tokenize_cache_reused_tokens = Counter(
            "disagg_tokenize_cache_reused_tokens", "Prompt tokens taken from the conversation cache instead of "
            "being tokenized again", registry=r)
        self.tokenize_cache_evictions = Counter(
            "disagg_tokenize_cache_evictions", "Conversations dropped from the cache to stay within its size",
            registry=r)
        self.tokenize_cache_bytes = Gauge(
            "disagg_tokenize_cache_bytes", "Bytes (text, ids, cuts) the conversation cache holds", registry=r,
            multiprocess_mode="livesum")
        self.tokenize_cache_entries = Gauge(
            "disagg_tokenize_cache_entries", "Conversations the cache holds", registry=r, multiprocess_mode="livesum")
        self.tokenize_render_hits = Counter(
            "disagg_tokenize_render_hits", "Chat renders that reused an earlier turn's rendered text", registry=r)
        self.tokenize_render_reused_messages = Counter(
            "disagg_tokenize_render_reused_messages", "Messages taken rendered from an earlier turn instead of being "
            "rendered again", registry=r)
        self.tokenize_render_bytes = Gauge(
            "disagg_tokenize_render_bytes", "Bytes the rendered-turns cache counts (its texts are mostly the "
            "conversation cache's own objects)", registry=r, multiprocess_mode="livesum")
        # The orchestrator's store of Responses API answers (read when scraped; one process's memory).
        self.response_store_entries = Gauge("disagg_response_store_entries", "Responses API answers stored",
                                            registry=r, multiprocess_mode="max")
        self.response_store_bytes = Gauge("disagg_response_store_bytes", "Bytes of stored Responses API answers",
                                          registry=r, multiprocess_mode="max")
        # Admission (orchestrator/admission.py): requests waiting for a running slot, how long they waited, and
        # how each admission ended (admitted at once, after queueing, or refused: queue full, timed out, client
        # left, no worker).
        self.admission_queue_length = Gauge(
            "disagg_admission_queue_length", "Requests waiting for a running slot, by gate (orchestrator: any "
            "request; prefill: a CTX worker's room) and priority", ["gate", "priority"], registry=r,
            multiprocess_mode="livesum",
        )
        self.admission_wait = Histogram(
            "disagg_admission_wait_seconds", "Time a request admitted after queueing waited, by gate and priority",
            ["gate", "priority"], registry=r, buckets=_LATENCY_BUCKETS,
        )
        self.admissions = Counter(
            "disagg_admission", "How admissions ended, by gate, priority and outcome (admitted, queued, queue_full, "
            "timed_out, left, no_worker)", ["gate", "priority", "outcome"], registry=r,
        )
        self.worker_circuit_state = Gauge(
            "disagg_worker_circuit_state", "Each worker's circuit breaker at the orchestrator: 0 closed, 1 half-open "
            "(one request tries it), 2 open (it gets none)", ["pool", "worker"], registry=r, multiprocess_mode="max",
        )
        self.tenant_refusals = Counter(
            "disagg_tenant_refusals", "Requests refused (429) for being over a tenant's limit, by tenant and limit "
            "(concurrent, requests_per_s, prompt_tokens_per_s, completion_tokens_per_s)", ["tenant", "limit"],
            registry=r,
        )
        # A shared (Redis) store: its calls that failed (unreachable, too slow) by operation, whether this process
        # reaches it now, and how long its calls take.
        self.response_store_errors = Counter(
            "disagg_response_store_errors", "Calls to the shared Responses store that failed (unreachable or slower "
            "than response_store.timeout_s), by operation: get, put, delete", ["operation"], registry=r,
        )
        self.response_store_up = Gauge(
            "disagg_response_store_up", "1 while the shared Responses store answers this process, 0 after a failed "
            "call until one succeeds", registry=r, multiprocess_mode="livemin",
        )
        self.response_store_latency = Histogram(
            "disagg_response_store_call_seconds", "Time of a call to the shared Responses store, by operation",
            ["operation"], registry=r,
            buckets=(0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5),
        )
        self.kv_handoffs = Counter(
            "disagg_kv_handoffs", "KV hand-offs this CTX worker parked (outcome=parked) and how each left the store: "
            "taken by a GEN, released (GEN refused it, client gone, orchestrator failure, aborted) or expired",
            ["outcome"], registry=r,
        )
        # Connections a front end cut on a client (entrypoints/http/protocol.py), each also logged with its cause.
        self.connections_cut = Counter(
            "disagg_http_connections_cut", "Client connections this front end closed on a limit, by reason",
            ["reason"], registry=r,
        )
        for reason in CONNECTION_CUT_REASONS:
            self.connections_cut.labels(reason=reason)  # exported at 0 until the first

    def render(self) -> bytes:
        if os.environ.get(MULTIPROC_ENV):
            # Several front-end processes: any one of them answers with the sum over all of them.
            merged = CollectorRegistry()
            MultiProcessCollector(merged)  # type: ignore[no-untyped-call]
            return generate_latest(merged)
        return generate_latest(self.registry)


class CounterFeed:
    """Feeds counters from running totals that something else keeps (an engine's ledger, a tokenizer's counts): each
    ``add`` adds what is new since the last for that key. A total that went down started again from zero (a restarted
    engine core), so all of it is new."""

    __slots__ = ("_seen",)

    def __init__(self) -> None:
        self._seen: dict[str, int] = {}

    def add(self, counter: Counter, key: str, total: int) -> None:
        before = self._seen.get(key, 0)
        added = total - before if total >= before else total
        if added:
            counter.inc(added)
        self._seen[key] = total


MetricT = TypeVar("MetricT", Counter, Gauge, Histogram)


class LabelledChildren(Generic[MetricT]):
    """``metric.labels(*values)``, made once per set of label values and then looked up in a dict.

    prometheus_client's ``labels()`` checks the values and takes a lock on every call: measured 21 µs for one label
    against 2 µs for the child's own ``inc()`` on the busy 2-core machine (docs/performance-history.md),
    and the orchestrator's hot path calls it six times per request. Values are positional, in the order of the
    metric's label names.
    """

    def __init__(self, metric: MetricT) -> None:
        self.metric: MetricT = metric
        self._children: dict[tuple[str, ...], MetricT] = {}

    def __call__(self, *values: str) -> MetricT:
        child = self._children.get(values)
        if child is None:
            child = self.metric.labels(*values)
            self._children[values] = child
        return child

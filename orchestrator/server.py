"""The orchestrator's HTTP front end: thin routes over ``DisaggFlow``, plus health, models, metrics and admin."""

from __future__ import annotations

import logging
import time
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from functools import partial
from typing import Any

import orjson
from fastapi import FastAPI, Request
from pydantic import BaseModel
from starlette.responses import Response

from frontend import tracing
from frontend.anthropic.errors import as_anthropic
from frontend.anthropic.models import CountTokensRequest, MessagesRequest
from frontend.asgi_fast_path import Exchange, FastPathApp
from frontend.auth import check_bearer, require_bearer
from frontend.config import ConfigError, OrchestratorConfig, ResponseStoreConfig, ServerGroupConfig
from frontend.errors import AuthenticationError, InvalidRequestError, ModelNotFoundError, ServingError
from frontend.http import (
    REQUEST_ID_HEADER,
    BodyBudget,
    BodyReads,
    JSONBytesResponse,
    install_error_handlers,
    install_request_ids,
    json_response,
    parse_json_object,
    read_body,
)
from frontend.internal_secret import InternalSecret
from frontend.logging_setup import RequestLines
from frontend.loop_monitor import LoopLagMonitor
from frontend.memory import IdleMemoryTrimmer
from frontend.metrics import METRICS_CONTENT_TYPE, LabelledChildren, Metrics
from frontend.openai_models import ChatCompletionRequest, CompletionRequest, ResponsesRequest
from frontend.openai_output import Endpoint
from frontend.openapi import install_body_schemas, json_body
from frontend.sse import SSE_RAW_HEADERS
from orchestrator.admission import DEFAULT, Admission, priority_of
from orchestrator.cache_index import DEFAULT_KV_CAPACITY_TOKENS, CacheIndex
from orchestrator.client_body import parse_client_body
from orchestrator.conversation import header_order, read_conversation
from orchestrator.discovery import DnsDiscovery
from orchestrator.flow.disagg_flow import DisaggFlow
from orchestrator.flow.request import PATHS, Answer, FlowRequest, StreamedAnswer, WholeAnswer, check_client_body
from orchestrator.messages import COUNT_TOKENS_PATH, MESSAGES_PATH, authorization, count_tokens, serve_messages
from orchestrator.metric_labels import (
    CTX_POOL_NAME,
    GEN_POOL_NAME,
    MODELS_STEP,
    export_ctx_worker_series,
    export_gen_worker_series,
    export_known_series,
)
from orchestrator.pair_probe import PairProbe
from orchestrator.pair_probe_routes import install_pair_probe_routes
from orchestrator.pool import BreakerSettings, HealthMonitor, PoolsWait, WorkerPool
from orchestrator.relay import RelayedStream
from orchestrator.response_memory import ResponseMemory
from orchestrator.response_store import MemoryResponseStore, ResponseStore
from orchestrator.routers import RoutingKey, make_router
from orchestrator.tenants import Tenant, Tenants
from orchestrator.upstream.base import WorkerTimeouts
from orchestrator.upstream.choice import make_transport

ROLE = "orchestrator"
SPAN_NAMES: dict[str, str] = {"chat": "orchestrator chat", "completions": "orchestrator completions",
                              "responses": "orchestrator responses",
                              "messages": "orchestrator messages"}  # built once, not per request
WIRE_MODELS: dict[Endpoint, type[BaseModel]] = {"chat": ChatCompletionRequest, "completions": CompletionRequest,
                                                "responses": ResponsesRequest}  # for the OpenAPI schema
logger = logging.getLogger("disagg_serve.orchestrator")


def _pool(name: str, group: ServerGroupConfig, config: OrchestratorConfig, metrics: Metrics,
          default_router: str, worker_headers: dict[str, str] | None = None,
          secret: InternalSecret | None = None) -> WorkerPool:
    timeouts = WorkerTimeouts(config.request_timeout_s, config.connect_timeout_s, min(config.connect_timeout_s, 5.0))
    index = CacheIndex(group.router.pending_s, recent_half_s=group.router.recent_half_s, secret=secret,
                       kv_capacity_tokens=group.router.kv_capacity_tokens or DEFAULT_KV_CAPACITY_TOKENS)
    decisions = LabelledChildren(metrics.routing_decisions)
    circuit = LabelledChildren(metrics.worker_circuit_state)
    router = make_router(group.router, default_router, index, lambda decision: decisions(name, decision).inc())
    pool = WorkerPool(name, router, timeouts, index=index,
                      failure_threshold=config.health_failure_threshold,
                      recovery_threshold=config.health_recovery_threshold,
                      transport_factory=partial(make_transport, client=config.upstream_client,
                                                headers=worker_headers),
                      protocol=None if group.protocol == "detect" else group.protocol,
                      breaker=BreakerSettings(config.circuit_breaker.failures, config.circuit_breaker.cooldown_s,
                                              lambda url, state: circuit(name, url).set(state)),
                      max_running=group.max_running_prefills or None,
                      # A request that finds no worker waits for one to come back as long as it would queue.
                      wait_for_worker_s=config.admission.queue_timeout_s)
    for url in group.urls:
        pool.add(url, "static")
    return pool


def make_response_store(config: ResponseStoreConfig, metrics: Metrics) -> ResponseStore:
    """The store ``config`` names: this process's memory, or the Redis every process and replica shares."""
    if config.backend == "redis":
        # Imported here: an orchestrator on the memory store never loads the Redis client.
        from orchestrator.response_store_redis import RedisResponseStore

        return RedisResponseStore(config, metrics)
    return MemoryResponseStore(config)


async def _run_freeing(flow: DisaggFlow, request: FlowRequest, free_slots: Callable[[], None]) -> Answer:
    """``flow.run``, its relayed stream told to call ``free_slots`` at GEN's end marker: the client's answer is whole
    then, and the request's slots go then, not once GEN's stream has ended too (a GEN that stalls past its marker is
    awaited a little longer: orchestrator/relay.py). (A traced stream's relay is wrapped, not exposed: its slots go
    at its end.)"""
    answer = await flow.run(request)
    if isinstance(answer, StreamedAnswer) and isinstance(answer.pushed, RelayedStream):
        answer.pushed.also_on_end(free_slots)
    return answer


def model_card(listing: dict[str, Any], model_id: str) -> dict[str, Any]:
    """The card of ``model_id`` in a ``/v1/models`` listing; ``ModelNotFoundError`` if it has none."""
    for card in listing.get("data") or ():
        if isinstance(card, dict) and card.get("id") == model_id:
            return card
    raise ModelNotFoundError(f"the model '{model_id}' does not exist", param="model")


def create_orchestrator_app(
    config: OrchestratorConfig,
    metrics: Metrics | None = None,
    *,
    api_key: str | None = None,
    admin_key: str | None = None,
    response_store: ResponseStore | None = None,
    internal_secret: InternalSecret | None = None,
    trtllm_auth_key: str | None = None,
) -> FastPathApp:
    """``internal_secret``: the deployment secret (``DISAGG_INTERNAL_TOKEN``, read by the CLI at start-up), sent to
    the workers on every call so that their internal routes let this orchestrator in; ``trtllm_auth_key``:
    TensorRT-LLM's ``internal_request_auth_key``, for trtllm-serve workers that require its signatures."""
    metrics = metrics or Metrics()
    worker_headers = internal_secret.headers() if internal_secret is not None else None
    ctx_pool = _pool(CTX_POOL_NAME, config.context_servers, config, metrics, "cache_aware", worker_headers,
                     internal_secret)
    gen_pool = _pool(GEN_POOL_NAME, config.generation_servers, config, metrics, "round_robin", worker_headers,
                     internal_secret)
    pools = {"context": ctx_pool, "generation": gen_pool}
    # A worker that joins later (DNS, POST /admin/workers) has its series exported at 0 as it joins.
    ctx_pool.on_added.append(partial(export_ctx_worker_series, metrics))
    gen_pool.on_added.append(partial(export_gen_worker_series, metrics))
    flow = DisaggFlow(config, ctx_pool, gen_pool, metrics, trtllm_auth_key=trtllm_auth_key)
    pair_probe = PairProbe(config.pair_probe, flow, metrics)
    # previous_response_id and store: only /v1/responses reaches it.
    if response_store is None:
        response_store = make_response_store(config.response_store, metrics)
    if not config.response_store.shared:
        metrics.response_store_up.set(1)  # this process's memory always answers; a shared store says for itself
    stored_responses = ResponseMemory(config.response_store, response_store)
    metrics.response_store_entries.set_function(lambda: stored_responses.store.entries)
    metrics.response_store_bytes.set_function(lambda: stored_responses.store.size_bytes)
    monitor = HealthMonitor([ctx_pool, gen_pool], config.health_check_interval_s)
    discoveries = [DnsDiscovery(pool, group.discovery)
                   for pool, group in ((ctx_pool, config.context_servers), (gen_pool, config.generation_servers))
                   if group.discovery is not None]
    inflight = {"count": 0}
    started = {"ready": False}  # /health said ready once: from then on only worker health decides
    try:
        tenants = Tenants(config.tenants, metrics, process_share=config.admission.process_share)
    except ValueError as exc:
        raise ConfigError(str(exc)) from exc
    local_prefill = config.max_local_prefill_length > 0  # a short prompt needs no CTX worker
    admission_queue = Admission(config.max_concurrent_requests, config.admission, metrics,
                                has_workers=lambda: gen_pool.has_healthy and (ctx_pool.has_healthy or local_prefill),
                                # A request that finds no worker waits while one of those it needs is coming back.
                                worker_wait=PoolsWait([gen_pool] if local_prefill else [gen_pool, ctx_pool]))
    lag_monitor = LoopLagMonitor(metrics.event_loop_lag, is_idle=lambda: inflight["count"] == 0)
    trimmer = IdleMemoryTrimmer(lambda: inflight["count"] == 0)

    @asynccontextmanager
    async def lifespan(_: FastAPI) -> AsyncIterator[None]:
        for discovery in discoveries:
            await discovery.refresh()
            discovery.start()
        # Every series whose labels are known now is exported at 0 from here on (orchestrator/metric_labels.py).
        export_known_series(metrics, [w.url for w in ctx_pool.workers], [w.url for w in gen_pool.workers])
        await stored_responses.store.start()
        await monitor.check_now()
        monitor.start()
        pair_probe.start()  # (if enabled) its first round in the background, once the pools' health is known
        lag_monitor.start()
        trimmer.start()
        try:
            yield
        finally:
            await pair_probe.stop()
            await lag_monitor.stop()
            await trimmer.stop()
            for discovery in discoveries:
                await discovery.stop()
            await monitor.stop()
            await ctx_pool.aclose()
            await gen_pool.aclose()
            await stored_responses.store.aclose()

    app = FastPathApp(title="disagg-serve orchestrator", lifespan=lifespan)
    app.state.flow = flow
    app.state.metrics = metrics
    app.state.pools = pools
    install_error_handlers(app)
    install_request_ids(app)
    install_body_schemas(app, [ChatCompletionRequest, CompletionRequest, ResponsesRequest, MessagesRequest,
                               CountTokensRequest])

    # Label lookups made once, not per request (frontend.metrics.LabelledChildren says what they cost).
    inflight_gauge = metrics.engine_inflight.labels(role=ROLE)
    # What bodies being read may hold, in bytes received: the front end's protocol charges them as they come
    # (entrypoints/http/protocol.py); and how many one tenant may have being read.
    app.state.body_budget = BodyBudget(config.max_body_bytes_reading)
    tenant_reads = BodyReads(config.max_body_reads_per_tenant)
    # The headers that name a conversation: the configured one, then TensorRT-LLM's (orchestrator/conversation.py).
    conversation_headers = header_order(config.context_servers.router.session_header.lower().encode("latin-1"))
    priority_header = config.admission.priority_header.lower().encode("latin-1")
    request_lines = RequestLines(logger)
    requests_count, request_latency = LabelledChildren(metrics.requests), LabelledChildren(metrics.request_latency)

    def authenticate(authorization: str | None) -> Tenant | None:
        """The request's tenant, if its key is one of theirs; else the orchestrator's own key (``--api-key``) is
        required, and with tenants configured and no such key, a tenant's is."""
        tenant = tenants.identify(authorization) if tenants else None
        if tenant is None:
            if tenants and api_key is None:
                raise AuthenticationError("missing or incorrect API key: send 'Authorization: Bearer <key>'")
            check_bearer(authorization, api_key)
        return tenant

    def release(endpoint: str, started: float, span: Any, flow_request: FlowRequest | None,
                status: int) -> None:
        """The request's end, counted: ``flow_request`` is None for a request that failed before its body was
        parsed. (Its slots are freed before: ``free_slots``.)"""
        inflight["count"] -= 1
        inflight_gauge.dec()
        elapsed = time.perf_counter() - started
        if span is not None:
            tracing.end(span, {"http.status_code": status}, f"status {status}" if status >= 500 else None)
        requests_count(ROLE, endpoint, str(status)).inc()
        request_latency(endpoint).observe(elapsed)
        if request_lines.enabled():  # the line's fields are not built for a level that drops it
            request_lines.write("request done", {"event": "request", "endpoint": endpoint, "status": status,
                                                 "latency_ms": round(elapsed * 1000, 2),
                                                 "ctx_worker": flow_request.ctx_worker if flow_request else None,
                                                 "gen_worker": flow_request.gen_worker if flow_request else None})

    async def handle(exchange: Exchange, endpoint: Endpoint, label: str | None = None) -> None:
        """The hot path, served bare (``frontend.asgi_fast_path``): admit -> read -> flow -> answer or stream.
        The exchange turns what this raises into the answer; a client that leaves cancels this coroutine.
        ``label``: the route's name in metrics and traces where it is not ``endpoint`` (``/v1/messages`` runs
        as chat: orchestrator/messages.py)."""
        label = label or endpoint
        # The request's trace: a child of the client's traceparent when it sent one (None when tracing is off).
        span = tracing.start(SPAN_NAMES[label], exchange.headers, server=True) if tracing.enabled() else None
        admission = tracing.start("admission", span)
        try:
            tenant = authenticate(exchange.header(b"authorization"))
        except BaseException as exc:
            tracing.end(admission, error=exc)
            tracing.end(span, {"http.status_code": exchange.status_of(exc)})
            raise
        started = time.perf_counter()
        try:
            # The body before the limit: a client that sends it slowly holds its connection (for as long as the
            # front end's body clock allows, entrypoints/http/limits.py), never one of the limit's slots; and one
            # tenant's bodies being read are capped (known from the head: they cost nothing before that).
            if tenant is None:
                raw = await exchange.read_body(config.max_body_bytes)
            else:
                tenant_reads.begin(tenant.name, exchange.request_id)
                try:
                    raw = await exchange.read_body(config.max_body_bytes)
                finally:
                    tenant_reads.end(tenant.name)
            # Its tenant's limits first (orchestrator/tenants.py); then, over the running limit, it waits by its
            # class (orchestrator/admission.py), its body read.
            # A class above its own is no client's to take: a tenant's is the highest it may ask for, and a
            # client that is no tenant (anonymous, or --api-key's) may ask for default or batch only, so the
            # interactive reserve is kept for the tenants configured to use it (docs/admission.md).
            asked = exchange.header(priority_header)
            priority = priority_of(asked)
            ceiling = DEFAULT if tenant is None else tenant.priority
            priority = max(priority, ceiling) if asked is not None else ceiling
            if tenant is not None:
                charged = tenants.admit(tenant, len(raw))
            try:
                await admission_queue.admit(priority)
            except BaseException:
                if tenant is not None:
                    tenants.finished(tenant)
                raise
        except BaseException as exc:
            status = exchange.status_of(exc)
            requests_count(ROLE, label, str(status)).inc()
            request_latency(label).observe(time.perf_counter() - started)
            tracing.end(admission, error=exc)
            tracing.end(span, {"http.status_code": status})
            raise
        held = [True]  # its running slot and its tenant's, until freed: at GEN's end marker, or at its end

        def free_slots() -> None:
            if held:
                held.clear()
                admission_queue.release(priority)
                if tenant is not None:
                    tenants.finished(tenant)

        request_id = exchange.request_id  # the client's, or a new one (frontend.http.request_id_of)
        inflight["count"] += 1
        inflight_gauge.inc()
        headers = {REQUEST_ID_HEADER: request_id}
        flow_request: FlowRequest | None = None  # once the body is parsed
        status = 500
        try:
            # /v1/responses keeps its input as values (a stored response's history); elsewhere a long prompt
            # string stays the bytes the client sent (orchestrator.client_body).
            body = parse_json_object(raw) if endpoint == "responses" else parse_client_body(raw)
            check_client_body(body)
            turn = (await stored_responses.begin(body, tenant.name if tenant else "")
                    if endpoint == "responses" else None)
            conversation = read_conversation(body, exchange.header, conversation_headers)
            session = turn.session if turn is not None and turn.session else conversation.routing_id
            flow_request = flow.new_request(endpoint, turn.body if turn else body, started, headers, session,
                                            conversation.conversation_id)
            flow_request.span = span
            flow_request.priority = priority
            if tenant is not None:
                # What CTX will prefill, a stored conversation included, not the body's size (orchestrator/tenants.py).
                charged = tenants.charge_prompt(tenant, charged, flow_request.key.prompt_tokens)
            if admission is not None:
                tracing.end(admission, {"disagg.request_id": request_id, "disagg.streaming": flow_request.streaming})
                admission = None
            run = partial(_run_freeing, flow, flow_request, free_slots)
            answer = await (turn.answer(run) if turn else run())
            status = 200  # from here on the request counts as answered, whether or not the client reads it all
            if tenant is not None:  # the prompt as the workers counted it, where they said
                ctx = flow_request.ctx
                counted = ctx.prompt_len if ctx is not None else None
                if counted is None and isinstance(answer, WholeAnswer):
                    counted = tenants.prompt_tokens_of(answer.content)
                tenants.settle_prompt(tenant, charged, counted)
            if isinstance(answer, StreamedAnswer):
                try:
                    if tenant is not None and tenant.counts_completions:
                        await exchange.stream(tenants.spend_streamed(tenant, answer.frames), SSE_RAW_HEADERS)
                    elif answer.pushed is not None:
                        await exchange.push(answer.pushed, SSE_RAW_HEADERS)
                    else:
                        await exchange.stream(answer.frames, SSE_RAW_HEADERS)
                finally:
                    await answer.close_upstream()  # GEN stops even if the relay never started
            else:
                if tenant is not None and tenant.counts_completions:
                    tenants.spend_whole(tenant, answer.content)
                await exchange.answer(answer.content)
        except BaseException as exc:  # a worker's own error answer too: it is a RelayedError
            if status != 200:
                status = exchange.status_of(exc)
                tracing.end(admission, error=exc)
            raise
        finally:
            free_slots()
            release(label, started, span, flow_request, status)

    for endpoint, path in PATHS.items():
        app.fast_post(path, partial(handle, endpoint=endpoint), name=path.removeprefix("/v1/").replace("/", "_"),
                      openapi_extra=json_body(WIRE_MODELS[endpoint]))

    app.fast_post(MESSAGES_PATH, partial(serve_messages, handle=partial(handle, endpoint="chat", label="messages")),
                  name="messages", openapi_extra=json_body(MessagesRequest))

    @app.post(COUNT_TOKENS_PATH, openapi_extra=json_body(CountTokensRequest))
    async def messages_count_tokens(request: Request) -> Response:
        try:
            authenticate(authorization(lambda name: request.headers.get(name.decode("latin-1"))))
            raw = await read_body(request, config.max_body_bytes)
            counted = await count_tokens(flow.retry, ctx_pool, raw, {REQUEST_ID_HEADER: request.state.request_id})
        except ServingError as exc:
            raise as_anthropic(exc) from exc
        return JSONBytesResponse(counted)

    @app.get("/v1/responses/{response_id}")
    async def stored_response(request: Request, response_id: str) -> Response:
        tenant = authenticate(request.headers.get("authorization"))
        owner = tenant.name if tenant else ""
        return JSONBytesResponse((await stored_responses.stored(response_id, owner)).response)

    @app.delete("/v1/responses/{response_id}")
    async def delete_response(request: Request, response_id: str) -> Response:
        tenant = authenticate(request.headers.get("authorization"))
        await stored_responses.delete(response_id, tenant.name if tenant else "")
        return json_response({"id": response_id, "object": "response", "deleted": True})

    @app.get("/v1/models")
    async def models(request: Request) -> Response:
        authenticate(request.headers.get("authorization"))
        answered = await flow.retry.run(MODELS_STEP, ctx_pool, RoutingKey(),
                                        lambda ctx: ctx.transport.get("/v1/models", config.connect_timeout_s),
                                        judges_workers=False)
        return JSONBytesResponse(answered.answer.content, status_code=answered.answer.status_code)

    @app.get("/v1/models/{model_id:path}")
    async def model(request: Request, model_id: str) -> Response:
        """One model's card (the SDK's ``models.retrieve``): the CTX workers' card of that id, or a 404."""
        authenticate(request.headers.get("authorization"))
        answered = await flow.retry.run(MODELS_STEP, ctx_pool, RoutingKey(),
                                        lambda ctx: ctx.transport.get("/v1/models", config.connect_timeout_s),
                                        judges_workers=False)
        if answered.answer.status_code != 200:
            return JSONBytesResponse(answered.answer.content, status_code=answered.answer.status_code)
        return json_response(model_card(orjson.loads(answered.answer.content), model_id))

    @app.get("/health")
    async def health() -> Response:
        # Ready once both roles have a healthy worker and, the first time, once the KV-event history of those that
        # keep one has been read (CATCH_UP_S at most each): before that, cache-aware routing would send follow-ups
        # blind. Later, a worker that restarts is caught up with while the others serve: readiness does not flap.
        catching_up = ctx_pool.catching_up() + gen_pool.catching_up()
        ready = ctx_pool.has_healthy and gen_pool.has_healthy and (not catching_up or started["ready"])
        started["ready"] = started["ready"] or ready
        body: dict[str, object] = {
            "status": "ok" if ready else "unavailable",
            "context_servers": {w.url: w.healthy for w in ctx_pool.workers},
            "generation_servers": {w.url: w.healthy for w in gen_pool.workers},
        }
        if catching_up:
            body["kv_events_catching_up"] = catching_up
        return json_response(body, status_code=200 if ready else 503)

    @app.get("/metrics")
    async def metrics_endpoint() -> Response:
        return Response(metrics.render(), media_type=METRICS_CONTENT_TYPE)

    async def membership_change(request: Request) -> tuple[WorkerPool, str]:
        require_bearer(request, admin_key, admin=True)
        body = parse_json_object(await read_body(request, 64 * 1024))
        role, url = body.get("role"), body.get("url")
        if role not in pools:
            raise InvalidRequestError("'role' must be 'context' or 'generation'", param="role")
        if not isinstance(url, str) or not url.startswith(("http://", "https://")):
            raise InvalidRequestError("'url' must be an http(s) URL", param="url")
        return pools[role], url

    @app.post("/admin/workers", status_code=201)
    async def register_worker(request: Request) -> Response:
        pool, url = await membership_change(request)
        worker = pool.add(url, "registered")
        await pool.check_health()  # a registered worker serves as soon as it answers its first check
        return json_response({"url": worker.url, "healthy": worker.healthy}, status_code=201)

    @app.delete("/admin/workers")
    async def deregister_worker(request: Request) -> Response:
        pool, url = await membership_change(request)
        return json_response({"url": url, "removed": pool.remove(url)})

    @app.get("/admin/workers")
    async def list_workers(request: Request) -> Response:
        require_bearer(request, admin_key, admin=True)
        listing: dict[str, Any] = {
            role: [{"url": w.url, "healthy": w.healthy, "inflight": w.inflight,
                    "inflight_prompt_tokens": w.inflight_prompt_tokens} for w in pool.workers]
            for role, pool in pools.items()
        }
        return json_response(listing)

    install_pair_probe_routes(app, pair_probe, admin_key)
    return app

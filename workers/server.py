"""The worker's HTTP front end: thin routes over ``WorkerService`` (parse -> call -> serialise). TensorRT-LLM's
lifecycle and generation-first routes are in ``workers.trtllm.routes``, the KV events in
``workers.kv_event_publishing``."""

from __future__ import annotations

import time
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import TYPE_CHECKING, Any

import pybase64
from fastapi import FastAPI, Request
from starlette.responses import Response, StreamingResponse

from frontend import tracing
from frontend.anthropic.models import CountTokensRequest, MessagesRequest
from frontend.auth import require_bearer
from frontend.errors import InvalidRequestError, ServingError, WorkerDrainingError
from frontend.http import (
    BodyBudget,
    ClientDisconnected,
    answered_status,
    cancel_on_disconnect,
    install_error_handlers,
    install_request_ids,
    json_response,
    parse_json_object,
    read_body,
    then_call,
)
from frontend.loop_monitor import LoopLagMonitor
from frontend.memory import IdleMemoryTrimmer
from frontend.metrics import METRICS_CONTENT_TYPE, Metrics
from frontend.openai_models import (
    ChatCompletionRequest,
    CompletionRequest,
    GenerationWireRequest,
    ResponsesRequest,
)
from frontend.openapi import install_body_schemas, json_body
from frontend.prefix_chain import trusted_chain_header
from frontend.sse import SSE_HEADERS, SSE_MEDIA_TYPE
from workers import worker_tracing
from workers.drain import Drain
from workers.engines.base import (
    Engine,
    ExposesMetrics,
    HealthCheck,
    KVHandoffStore,
    ReportsTokenizeStats,
)
from workers.engines.request import Phase
from workers.handoff_counts import LedgerCounts, export_known_series, prompt_report_headers
from workers.kv_event_publishing import KvEventPublishing, kv_capacity_tokens
from workers.messages import install_messages_routes
from workers.prepared_generation import PreparedGeneration
from workers.registration import Registration
from workers.service import WorkerService
from workers.settings import WorkerSettings
from workers.tokenize_counts import TokenizeCounts
from workers.trtllm.body import parse_request_body
from workers.trtllm.routes import install_lifecycle_routes

if TYPE_CHECKING:
    from opentelemetry.trace import Span


_STARTED = int(time.time())


def parked_handoffs(engine: Engine) -> int:
    """The KV hand-offs a CTX engine holds for GEN workers to fetch now (0 for an engine that parks none)."""
    return engine.kv_store_stats()[0] if isinstance(engine, KVHandoffStore) else 0


def create_worker_app(
    engine: Engine, settings: WorkerSettings, metrics: Metrics | None = None, *,
    registration: Registration | None = None,
) -> FastAPI:
    metrics = metrics or Metrics()
    service = WorkerService(engine, settings, metrics)
    lag_monitor = LoopLagMonitor(metrics.event_loop_lag)
    trimmer = IdleMemoryTrimmer(lambda: service.inflight == 0)
    ready = {"engine": False}
    counted = LedgerCounts(metrics)
    tokenized = TokenizeCounts(metrics)
    export_known_series(metrics, engine, settings.role)
    # Built once, not per request.
    span_names = {e: f"{settings.role} {e}" for e in ("chat", "completions", "responses", "messages")}
    kv_events = KvEventPublishing(engine, settings, service)
    chain_secret = settings.internal_secret  # a prefix chain is believed only from its holder (the orchestrator)
    # SIGTERM drains first (the server runs ``drain.run`` before it stops): a registered worker leaves at once. A
    # CTX whose engine parks KV hand-offs waits for them too: a GEN is about to fetch each.
    drain = Drain(settings.drain_timeout_s, lambda: service.inflight + parked_handoffs(engine),
                  on_begin=registration.leave if registration is not None else None)

    @asynccontextmanager
    async def lifespan(_: FastAPI) -> AsyncIterator[None]:
        await engine.start()
        try:
            kv_events.start()  # after the engine: its capacity may be known only once it has started (vLLM)
        except BaseException:
            await engine.aclose()
            raise
        lag_monitor.start()
        trimmer.start()
        service.lifecycle.start()
        ready["engine"] = True
        if registration is not None:
            registration.start()
        try:
            yield
        finally:
            ready["engine"] = False  # health turns 503 first, so balancers stop sending before we go
            if registration is not None:
                await registration.leave()
            await lag_monitor.stop()
            await trimmer.stop()
            await service.lifecycle.aclose()
            await kv_events.aclose()
            await engine.aclose()

    app = FastAPI(title=f"disagg-serve worker ({settings.role})", lifespan=lifespan)
    app.state.service = service
    app.state.metrics = metrics
    app.state.kv_events = kv_events
    app.state.drain = drain
    # What bodies being read may hold, in bytes received: the front end's protocol charges them as they come
    # (entrypoints/http/protocol.py).
    app.state.body_budget = BodyBudget(settings.max_body_bytes_reading)
    install_error_handlers(app)
    install_request_ids(app)
    install_body_schemas(app, [ChatCompletionRequest, CompletionRequest, ResponsesRequest, MessagesRequest,
                               CountTokensRequest])

    async def serve(request: Request, wire_model: type[GenerationWireRequest], endpoint: str) -> Response:
        """Read the body -> admit -> prepare -> a stream, or the whole answer; counted and traced once, with the
        status the client got, when the answer (or the stream) ends."""
        # A child of the orchestrator's call when it sent a traceparent (None when tracing is off).
        span = tracing.start(span_names[endpoint], request.headers, server=True)
        status = 500
        try:
            # The body before the limit: a client that sends it slowly holds its connection (for as long as the
            # front end's body clock allows), never one of the limit's slots.
            raw = await read_body(request, settings.max_body_bytes)
            if drain.draining:
                drain.refused(request.client.host if request.client else None)
                raise WorkerDrainingError("this worker is draining (it is shutting down): send the request to "
                                          "another worker")
            service.admit()
        except BaseException as exc:
            status = answered_status(exc)
            metrics.requests.labels(role=settings.role, endpoint=endpoint, status=str(status)).inc()
            tracing.end(span, {"http.status_code": status}, exc if isinstance(exc, ServingError) else None)
            raise
        streaming = False
        try:
            prepared = await prepare(request, raw, wire_model)
            worker_tracing.prepared(span, prepared)
            if prepared.streams:
                response = await stream(request, prepared, span)
                streaming = True  # the stream's end releases the slot and ends the span
            else:
                response = await whole(request, prepared, span)
            status = 200
            return response
        except BaseException as exc:
            status = answered_status(exc)  # a client that went away is a 499, not a failure of ours
            raise
        finally:
            if not streaming:
                service.release()
                tracing.end(span, {"http.status_code": status}, f"status {status}" if status >= 500 else None)
            metrics.requests.labels(role=settings.role, endpoint=endpoint, status=str(status)).inc()

    async def prepare(request: Request, raw: bytes, wire_model: type[GenerationWireRequest]) -> PreparedGeneration:
        body = parse_request_body(raw, request.headers)
        # Under the disconnect watch too: a generation-first GEN waits here for its hand-off (up to
        # generation_first_wait_s), and one whose orchestrator left must free its slot and stop asking for it.
        return await cancel_on_disconnect(
            request, lambda: service.prepare(body, wire_model, trusted_chain_header(request.headers, chain_secret),
                                             request.headers))

    async def stream(request: Request, prepared: PreparedGeneration, span: Span | None) -> Response:
        # Up to the first token (a whole prefill, or a KV fetch) a gone client must stop the work too.
        with tracing.span("first_token", span) as first, tracing.use(first):
            frames = await cancel_on_disconnect(request, lambda: service.open_stream(prepared))

        def ended() -> None:
            service.release()
            tracing.end(span, {"http.status_code": 200})

        return StreamingResponse(then_call(tracing.traced_frames("stream", span, frames), ended),
                                 media_type=SSE_MEDIA_TYPE, headers={**SSE_HEADERS, **prompt_report_headers(prepared)})

    async def whole(request: Request, prepared: PreparedGeneration, span: Span | None) -> Response:
        with tracing.span(worker_tracing.engine_step(prepared), span) as step, tracing.use(step):
            result = await cancel_on_disconnect(request, lambda: service.complete(prepared))
            worker_tracing.completed(step, result)
        if prepared.request.phase is Phase.CONTEXT_ONLY and await request.is_disconnected():
            # The orchestrator left while the KV was being parked: no GEN will ever ask for this hand-off.
            await release_parked(result)
            raise ClientDisconnected()
        return json_response(result, headers=prompt_report_headers(prepared))

    @app.post("/v1/chat/completions", openapi_extra=json_body(ChatCompletionRequest))
    async def chat_completions(request: Request) -> Response:
        return await serve(request, ChatCompletionRequest, "chat")

    @app.post("/v1/completions", openapi_extra=json_body(CompletionRequest))
    async def completions(request: Request) -> Response:
        return await serve(request, CompletionRequest, "completions")

    @app.post("/v1/responses", openapi_extra=json_body(ResponsesRequest))
    async def responses(request: Request) -> Response:
        return await serve(request, ResponsesRequest, "responses")

    async def release_parked(result: dict[str, Any]) -> None:
        params = (result.get("choices") or [result])[0].get("disaggregated_params") or {}
        state = params.get("encoded_opaque_state")
        if isinstance(engine, KVHandoffStore) and isinstance(state, str):
            await engine.release_handoff(str(params["ctx_request_id"]), pybase64.b64decode(state))

    @app.get("/v1/disagg/handoffs")
    async def handoffs(request: Request) -> Response:
        """The KV hand-off ledger (admin): what is parked now, with ages and sizes, and every outcome so far."""
        require_bearer(request, settings.admin_key, admin=True)
        if not isinstance(engine, KVHandoffStore):
            return json_response({"parked_now": [], "parked_bytes": 0, "totals": {}})
        ledger = await engine.handoff_ledger()
        return json_response({
            "parked_now": [{"ctx_request_id": p.ctx_request_id, "age_s": p.age_s, "bytes": p.bytes,
                            "expires_in_s": p.expires_in_s} for p in ledger.parked_now],
            "parked_bytes": ledger.parked_bytes,
            "totals": dict(ledger.totals),
        })

    @app.post("/v1/disagg/release")
    async def release_handoff(request: Request) -> Response:
        """Free a parked KV hand-off no GEN will take. The one-time key inside the state proves ownership."""
        body = parse_json_object(await read_body(request, 64 * 1024))
        ctx_id, state = body.get("ctx_request_id"), body.get("encoded_opaque_state")
        if isinstance(ctx_id, int) and not isinstance(ctx_id, bool):
            ctx_id = str(ctx_id)  # CTX ids are decimal; TensorRT-LLM's wire writes them as ints
        if not isinstance(ctx_id, str) or not isinstance(state, str):
            raise InvalidRequestError("'ctx_request_id' must be a string or an int, 'encoded_opaque_state' a string")
        try:
            raw_state = pybase64.b64decode(state, validate=True)
        except ValueError as exc:
            raise InvalidRequestError("encoded_opaque_state is not valid base64",
                                      param="encoded_opaque_state") from exc
        released = isinstance(engine, KVHandoffStore) and await engine.release_handoff(ctx_id, raw_state)
        service.handoff_counts.released()  # (an engine without a store: the worker's own ledger)
        return json_response({"released": released})

    install_lifecycle_routes(app, settings, service.lifecycle, service.board)
    install_messages_routes(app, service, settings, metrics, serve)

    def model_card() -> dict[str, Any]:
        info = engine.info
        card: dict[str, Any] = {
            "id": info.model,
            "object": "model",
            "created": _STARTED,
            "owned_by": "disagg-serve",
            "max_model_len": info.max_context,
            # The orchestrator's guardrail reads GEN's engine facts from here, never from its own config.
            "engine_info": {
                "engine": info.engine,
                "role": settings.role,
                "vocab_size": info.vocab_size,
                "kv_block_reuse": info.kv_block_reuse,
                "prompt_tokens_in_handoff": info.prompt_tokens_in_handoff,
                "model_hash": info.model_hash,
                # The wires this worker answers (orchestrator.protocols.registry reads it): both orchestrators.
                "disagg_protocols": ["native", "trtllm"],
            },
        }
        if kv_events.card is not None:  # what this worker's engine holds, for cache-aware routing
            card["engine_info"]["kv_events"] = kv_events.card
        capacity = kv_capacity_tokens(engine)
        if capacity is not None:  # bounds an orchestrator's model of this cache where it reads no events
            card["engine_info"]["kv_capacity_tokens"] = capacity
        return card

    @app.get("/v1/models")
    async def models() -> Response:
        return json_response({"object": "list", "data": [model_card()]})

    @app.get("/v1/models/{model_id:path}")
    async def model(model_id: str) -> Response:
        service.require_model(model_id)
        return json_response(model_card())

    @app.get("/health")
    async def health(request: Request) -> Response:
        # Who checks, and what they were told: a drain waits until those who watch this worker have seen it.
        checker = request.client.host if request.client else None
        if drain.draining:  # a 503 of its own: an orchestrator stops routing here at once, without a failure
            drain.checked(checker, healthy=False)
            return json_response({"status": "draining", "role": settings.role, "inflight": service.inflight},
                                 status_code=503)
        healthy = ready["engine"] and (not isinstance(engine, HealthCheck) or await engine.health())
        drain.checked(checker, healthy)
        return json_response({"status": "ok" if healthy else "unavailable", "role": settings.role,
                              "inflight": service.inflight}, status_code=200 if healthy else 503)

    @app.get("/metrics")
    async def metrics_endpoint() -> Response:
        if isinstance(engine, KVHandoffStore):
            entries, size = engine.kv_store_stats()
            metrics.kv_store_entries.set(entries)
            metrics.kv_store_bytes.set(size)
            counted.bring_up_to(engine.kv_handoff_totals())
        if service.holdings is not None:
            metrics.prefix_holdings_tokens.set(service.holdings.tokens)
        if ready["engine"] and isinstance(tokenizer := service.tokenizer, ReportsTokenizeStats):
            tokenized.bring_up_to(tokenizer.tokenize_stats())
        body = metrics.render()
        if isinstance(engine, ExposesMetrics):  # the engine's own metrics (vLLM's vllm:*), after ours
            body += engine.metrics_text()
        return Response(body, media_type=METRICS_CONTENT_TYPE)

    return app

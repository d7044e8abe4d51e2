"""The worker's HTTP front end: thin routes over ``WorkerService`` (parse -> call -> serialise)."""

from __future__ import annotations

import logging
import secrets
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Mapping
from contextlib import asynccontextmanager
from typing import Any, TypeVar

import pybase64
from fastapi import FastAPI, Request
from pydantic import BaseModel, ValidationError
from starlette.responses import Response, StreamingResponse

from frontend import tracing
from frontend.auth import require_bearer
from frontend.errors import InvalidRequestError, ModelNotFoundError, ServingError
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
from frontend.kv_events import PREFIX_CHAIN_TOPIC, EventPublisher
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
from frontend.prefix_chain import CHAIN_HEADER
from frontend.sse import SSE_HEADERS, SSE_MEDIA_TYPE
from frontend.trtllm_lifecycle import (
    CONTEXT_ARTIFACT_ABORT_PATH,
    CONTROL_UNAVAILABLE,
    GENERATION_GRANT_ABORT_PATH,
    GENERATION_GRANT_PATH,
    GENERATION_GRANT_RENEW_PATH,
    SERVER_INFO_PATH,
    ContextArtifactAbortRequest,
    GenerationGrantAbortRequest,
    GenerationGrantRenewRequest,
    GenerationGrantRequest,
)
from workers import worker_tracing
from workers.engines.base import (
    HANDOFF_TOTALS,
    Engine,
    ExposesMetrics,
    HealthCheck,
    KVHandoffStore,
    ReportsKvCapacity,
)
from workers.engines.request import Phase, PromptPath
from workers.generation_first import HANDOFF_PATH
from workers.lifecycle_entries import LifecycleConflict
from workers.prefix_holdings import PrefixHoldings
from workers.registration import Registration
from workers.request_body import parse_request_body
from workers.serving import Role, WorkerService, WorkerSettings

Body = TypeVar("Body", bound=BaseModel)  # a lifecycle control call's body model

logger = logging.getLogger(__name__)

_STARTED = int(time.time())


def create_worker_app(
    engine: Engine, settings: WorkerSettings, metrics: Metrics | None = None, *,
    registration: Registration | None = None,
) -> FastAPI:
    metrics = metrics or Metrics()
    service = WorkerService(engine, settings, metrics)
    lag_monitor = LoopLagMonitor(metrics.event_loop_lag)
    trimmer = IdleMemoryTrimmer(lambda: service.inflight == 0)
    ready = {"engine": False}
    counted = _LedgerCounts(metrics)
    _export_known_series(metrics, engine, settings.role)
    span_names = {e: f"{settings.role} {e}" for e in ("chat", "completions", "responses")}  # not per request
    bodies = BodyBudget(settings.max_body_bytes_reading)
    kv_events = _KvEvents(engine, settings, service)

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
    install_error_handlers(app)
    install_request_ids(app)
    install_body_schemas(app, [ChatCompletionRequest, CompletionRequest, ResponsesRequest])

    async def serve(request: Request, wire_model: type[GenerationWireRequest], endpoint: str) -> Response:
        status = 500
        # A child of the orchestrator's call when it sent a traceparent (None when tracing is off).
        span = tracing.start(span_names[endpoint], request.headers, server=True)
        try:
            # The body before the limit: a client that sends it slowly holds its connection (for at most the front
            # end's body timeout, entrypoints/http_protocol.py), never one of the limit's slots.
            reserved = bodies.reserve(request.headers.get("content-length"), settings.max_body_bytes)
            try:
                raw = await read_body(request, settings.max_body_bytes)
            finally:
                bodies.release(reserved)
            service.admit()
        except BaseException as exc:
            status = answered_status(exc)
            metrics.requests.labels(role=settings.role, endpoint=endpoint, status=str(status)).inc()
            tracing.end(span, {"http.status_code": status}, exc if isinstance(exc, ServingError) else None)
            raise
        released = False

        def release_stream() -> None:
            service.release()
            tracing.end(span, {"http.status_code": 200})

        try:
            body = parse_request_body(raw, request.headers)
            # Under the disconnect watch too: a generation-first GEN waits here for its hand-off (up to
            # generation_first_wait_s), and one whose orchestrator left must free its slot and stop asking for it.
            prepared = await cancel_on_disconnect(
                request, lambda: service.prepare(body, wire_model, request.headers.get(CHAIN_HEADER)))
            worker_tracing.prepared(span, prepared)
            # CTX always answers whole: the orchestrator needs its hand-off fields, not a stream.
            if prepared.wire.stream and prepared.request.phase is not Phase.CONTEXT_ONLY:
                # Up to the first token (a whole prefill, or a KV fetch) a gone client must stop the work too.
                with tracing.span("first_token", span) as first, tracing.use(first):
                    frames = await cancel_on_disconnect(request, lambda: service.open_stream(prepared))
                status, released = 200, True
                return StreamingResponse(then_call(tracing.traced_frames("stream", span, frames), release_stream),
                                         media_type=SSE_MEDIA_TYPE, headers=SSE_HEADERS)
            with tracing.span(worker_tracing.engine_step(prepared), span) as step, tracing.use(step):
                result = await cancel_on_disconnect(request, lambda: service.complete(prepared))
                worker_tracing.completed(step, result)
            if prepared.request.phase is Phase.CONTEXT_ONLY and await request.is_disconnected():
                # The orchestrator left while the KV was being parked: no GEN will ever ask for this hand-off.
                await release_parked(result)
                raise ClientDisconnected()
            status = 200
            return json_response(result)
        except BaseException as exc:
            status = answered_status(exc)  # a client that went away is a 499, not a failure of ours
            raise
        finally:
            if not released:
                service.release()
                tracing.end(span, {"http.status_code": status}, f"status {status}" if status >= 500 else None)
            metrics.requests.labels(role=settings.role, endpoint=endpoint, status=str(status)).inc()

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
        return json_response({"released": released})

    # -- TensorRT-LLM's lifecycle protocol v1 (workers/lifecycle.py) -------------------------------------------
    control = service.lifecycle

    @app.get(SERVER_INFO_PATH)
    async def server_info(request: Request) -> Response:
        """What TensorRT-LLM's router reads of a worker before sending it anything: where CTX's hand-offs are
        asked for (generation first) and, in v1 only, the lifecycle advertisement."""
        params: dict[str, Any] = {"ctx_dp_rank": 0, "ctx_info_endpoint": [str(request.base_url).rstrip("/")]}
        if control.advertisement is not None:
            params["context_transceiver_lifecycle"] = control.advertisement.to_dict()
        return json_response({"disaggregated_params": params,
                              "max_batch_size": settings.lifecycle.max_live_grants})

    def control_route(path: str, model: type[Body], call: Callable[[Body, Request], Awaitable[Any]]) -> None:
        """A control call's route: its body read as ``model`` (TensorRT-LLM's 400 ``{"error": ...}`` for a bad
        one, its 404 with v1 off), ``call``'s answer as JSON, a ``LifecycleConflict`` its 409."""
        async def route(request: Request) -> Response:
            if not control.enabled:
                return json_response({"detail": CONTROL_UNAVAILABLE}, status_code=404)
            try:
                body = model.model_validate(parse_json_object(await read_body(request, 64 * 1024)))
            except (ValidationError, InvalidRequestError) as error:
                return json_response({"error": str(error)}, status_code=400)
            try:
                answer = await call(body, request)
            except LifecycleConflict as error:
                return json_response({"detail": str(error)}, status_code=409)
            return json_response(answer.model_dump(mode="json") if isinstance(answer, BaseModel) else answer)

        app.post(path, name=path.removeprefix("/_internal/").replace("/", "_"))(route)

    async def issue(body: GenerationGrantRequest, request: Request) -> Any:
        return control.issue(body, request.url.netloc)

    async def renew(body: GenerationGrantRenewRequest, _: Request) -> Any:
        return control.renew(body)

    async def abort(body: GenerationGrantAbortRequest, _: Request) -> Any:
        return control.abort(body)

    async def abort_artifact(body: ContextArtifactAbortRequest, _: Request) -> Any:
        return await control.abort_artifact(body)

    if settings.role == "generation":
        control_route(GENERATION_GRANT_PATH, GenerationGrantRequest, issue)
        control_route(GENERATION_GRANT_RENEW_PATH, GenerationGrantRenewRequest, renew)
        control_route(GENERATION_GRANT_ABORT_PATH, GenerationGrantAbortRequest, abort)

    if settings.role == "context":
        control_route(CONTEXT_ARTIFACT_ABORT_PATH, ContextArtifactAbortRequest, abort_artifact)

        @app.get(HANDOFF_PATH)
        async def generation_first_handoff(request: Request, disagg_request_id: int,
                                           wait_s: float = 30.0) -> Response:
            """Generation first: a GEN that came first asks here for the hand-off of its request; answered as
            soon as this CTX has parked it (404 if that does not happen within ``wait_s``). A GEN that hangs up
            stops waiting here too: the hand-off is then left on the board for a GEN that asks again."""
            params = await cancel_on_disconnect(
                request, lambda: service.board.claim(disagg_request_id, min(max(wait_s, 0.0), 300.0)))
            if params is None:
                return json_response({"detail": "no hand-off for this request"}, status_code=404)
            return json_response(params)

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
        return card

    @app.get("/v1/models")
    async def models() -> Response:
        return json_response({"object": "list", "data": [model_card()]})

    @app.get("/v1/models/{model_id:path}")
    async def model(model_id: str) -> Response:
        if model_id != engine.info.model:
            raise ModelNotFoundError(f"the model '{model_id}' does not exist; this worker serves "
                                     f"'{engine.info.model}'", param="model")
        return json_response(model_card())

    @app.get("/health")
    async def health() -> Response:
        healthy = ready["engine"] and (not isinstance(engine, HealthCheck) or await engine.health())
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
        body = metrics.render()
        if isinstance(engine, ExposesMetrics):  # the engine's own metrics (vLLM's vllm:*), after ours
            body += engine.metrics_text()
        return Response(body, media_type=METRICS_CONTENT_TYPE)

    return app


def _export_known_series(metrics: Metrics, engine: Engine, role: Role) -> None:
    """Create the child of every label combination this worker can count, so each series is exported at 0 from
    start-up: left to its first event, a fresh worker's hand-off ledger and GEN prompt paths are absent, and a
    dashboard shows "No data" where the truth is "none so far"."""
    if isinstance(engine, KVHandoffStore):  # only a store that parks hand-offs counts how they leave it
        for outcome in HANDOFF_TOTALS:
            metrics.kv_handoffs.labels(outcome=outcome)
    if role != "context":  # the roles that take generation_only requests, the ones counted by prompt path
        for path in PromptPath:
            metrics.gen_prompt_path.labels(path=path.value)


class _KvEvents:
    """The worker's KV events: while the app runs, a publisher and the record of what the engine holds
    (``workers.prefix_holdings``), for an engine that reuses KV across requests (``ReportsKvCapacity`` with a
    positive capacity); for any other engine, or with the endpoint off, nothing."""

    def __init__(self, engine: Engine, settings: WorkerSettings, service: WorkerService) -> None:
        self.engine = engine
        self.settings = settings
        self.service = service
        self.publisher: EventPublisher | None = None
        self.card: dict[str, Any] | None = None  # engine_info["kv_events"] while publishing

    def start(self) -> None:
        endpoint = self.settings.kv_events_endpoint
        if endpoint is None or not isinstance(self.engine, ReportsKvCapacity):
            return
        capacity = self.engine.kv_capacity_tokens()
        if not capacity or capacity <= 0:
            return  # the engine reuses no KV: there is nothing to route by
        service = self.service
        publisher = EventPublisher(endpoint, self.settings.kv_events_replay_endpoint,
                                   snapshot=lambda: service.holdings.snapshot() if service.holdings else [])
        publisher.start()
        self.publisher = publisher
        self.service.holdings = PrefixHoldings(capacity, publisher)
        # A new incarnation each start: a subscriber that sees it change knows the picture starts again.
        self.card = {"endpoint": publisher.endpoint, "replay_endpoint": publisher.replay_endpoint,
                     "topic": PREFIX_CHAIN_TOPIC.decode(), "incarnation": secrets.token_hex(8),
                     "capacity_tokens": capacity}
        logger.info("KV events on %s (replay %s): up to %d tokens of prompt KV", publisher.endpoint,
                    publisher.replay_endpoint, capacity)

    async def aclose(self) -> None:
        self.service.holdings = None
        self.card = None
        publisher, self.publisher = self.publisher, None
        if publisher is not None:
            await publisher.aclose()


class _LedgerCounts:
    """Moves the engine's running totals into the Prometheus counters: each scrape adds what is new. A restarted
    engine core starts its totals again from zero; what it counts then is new too."""

    def __init__(self, metrics: Metrics) -> None:
        self.metrics = metrics
        self.seen: dict[str, int] = {}

    def bring_up_to(self, totals: Mapping[str, int]) -> None:
        for outcome, total in totals.items():
            before = self.seen.get(outcome, 0)
            added = total - before if total >= before else total
            if added:
                self.metrics.kv_handoffs.labels(outcome=outcome).inc(added)
            self.seen[outcome] = total

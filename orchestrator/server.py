"""The orchestrator's HTTP front end: thin routes over ``DisaggFlow``, plus health, models and metrics."""

from __future__ import annotations

import time
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager

from fastapi import FastAPI, Request
from starlette.responses import Response, StreamingResponse

from frontend.config import OrchestratorConfig
from frontend.errors import OverloadedError, ServingError, UpstreamError, UpstreamUnavailableError
from frontend.http import (
    JSONBytesResponse,
    cancel_on_disconnect,
    install_error_handlers,
    json_response,
    parse_json_object,
    read_body,
)
from frontend.metrics import METRICS_CONTENT_TYPE, Metrics
from frontend.openai_output import Endpoint
from frontend.sse import SSE_HEADERS, SSE_MEDIA_TYPE
from orchestrator.disagg_flow import DisaggFlow, RelayedError, StreamedAnswer, check_client_body
from orchestrator.pool import HealthMonitor, RoundRobinRouter, WorkerPool
from orchestrator.upstream import WorkerClient

ROLE = "orchestrator"


def _pool(name: str, urls: list[str], config: OrchestratorConfig) -> WorkerPool:
    clients = [
        WorkerClient(url, request_timeout_s=config.request_timeout_s, connect_timeout_s=config.connect_timeout_s)
        for url in urls
    ]
    return WorkerPool(name, clients, RoundRobinRouter())


def create_orchestrator_app(config: OrchestratorConfig, metrics: Metrics | None = None) -> FastAPI:
    metrics = metrics or Metrics()
    ctx_pool = _pool("ctx", config.context_servers.urls, config)
    gen_pool = _pool("gen", config.generation_servers.urls, config)
    flow = DisaggFlow(config, ctx_pool, gen_pool, metrics)
    monitor = HealthMonitor([ctx_pool, gen_pool], config.health_check_interval_s,
                            timeout_s=min(config.connect_timeout_s, 5.0))
    inflight = {"count": 0}

    @asynccontextmanager
    async def lifespan(_: FastAPI) -> AsyncIterator[None]:
        await monitor.check_now()
        monitor.start()
        try:
            yield
        finally:
            await monitor.stop()
            await ctx_pool.aclose()
            await gen_pool.aclose()

    app = FastAPI(title="disagg-serve orchestrator", lifespan=lifespan)
    app.state.flow = flow
    app.state.metrics = metrics
    install_error_handlers(app)

    def release(endpoint: Endpoint, status: int, started: float) -> None:
        inflight["count"] -= 1
        metrics.engine_inflight.labels(role=ROLE).dec()
        metrics.requests.labels(role=ROLE, endpoint=endpoint, status=str(status)).inc()
        metrics.request_latency.labels(endpoint=endpoint).observe(time.perf_counter() - started)

    async def handle(request: Request, endpoint: Endpoint) -> Response:
        started = time.perf_counter()
        if inflight["count"] >= config.max_concurrent_requests:
            metrics.requests.labels(role=ROLE, endpoint=endpoint, status="429").inc()
            raise OverloadedError(f"the orchestrator is at its limit of {config.max_concurrent_requests} requests")
        inflight["count"] += 1
        metrics.engine_inflight.labels(role=ROLE).inc()
        status, streaming = 500, False
        try:
            body = parse_json_object(await read_body(request, config.max_body_bytes))
            check_client_body(body)
            answer = await cancel_on_disconnect(request, lambda: flow.run(endpoint, body, started))
            if isinstance(answer, StreamedAnswer):
                status, streaming = 200, True
                frames = _finally(answer.frames, lambda: release(endpoint, 200, started))
                return StreamingResponse(frames, media_type=SSE_MEDIA_TYPE, headers=SSE_HEADERS)
            status = answer.status_code
            return JSONBytesResponse(answer.content, status_code=answer.status_code)
        except RelayedError as exc:
            status = exc.reply.status_code
            return JSONBytesResponse(exc.reply.content, status_code=status)
        except ServingError as exc:
            status = exc.status_code
            raise
        finally:
            if not streaming:
                release(endpoint, status, started)

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request) -> Response:
        return await handle(request, "chat")

    @app.post("/v1/completions")
    async def completions(request: Request) -> Response:
        return await handle(request, "completions")

    @app.post("/v1/responses")
    async def responses(request: Request) -> Response:
        return await handle(request, "responses")

    @app.get("/v1/models")
    async def models() -> Response:
        last_error: UpstreamError = UpstreamUnavailableError("no healthy CTX worker to list models from")
        for worker in [w for w in ctx_pool.workers if w.healthy]:
            try:
                reply = await worker.get("/v1/models", config.connect_timeout_s)
            except UpstreamError as exc:
                last_error = exc
                continue
            return JSONBytesResponse(reply.content, status_code=reply.status_code)
        raise last_error

    @app.get("/health")
    async def health() -> Response:
        ready = ctx_pool.has_healthy and gen_pool.has_healthy
        body = {
            "status": "ok" if ready else "unavailable",
            "context_servers": {w.url: w.healthy for w in ctx_pool.workers},
            "generation_servers": {w.url: w.healthy for w in gen_pool.workers},
        }
        return json_response(body, status_code=200 if ready else 503)

    @app.get("/metrics")
    async def metrics_endpoint() -> Response:
        return Response(metrics.render(), media_type=METRICS_CONTENT_TYPE)

    return app


async def _finally(frames: AsyncIterator[bytes], done: Callable[[], None]) -> AsyncIterator[bytes]:
    try:
        async for frame in frames:
            yield frame
    finally:
        done()
        await frames.aclose()  # type: ignore[attr-defined]

"""The two-step flow, top to bottom: admit -> CTX -> hand-off -> GEN (whole or streamed).

The orchestrator never decodes the prompt. It parses CTX's answer once with orjson and puts the very
``prompt_token_ids_b64`` string object it got into GEN's body, which it encodes once with orjson.
Short prompts (``max_local_prefill_length``) skip the split and go to a GEN worker alone.
"""

from __future__ import annotations

import asyncio
import functools
import logging
import random
import time
from collections.abc import AsyncIterator, Callable
from contextlib import AbstractAsyncContextManager
from dataclasses import dataclass, field
from typing import Any

import httpx
import orjson

from frontend.config import OrchestratorConfig
from frontend.errors import InvalidRequestError, UpstreamError, UpstreamUnavailableError
from frontend.guardrail import metadata_only_decision
from frontend.metrics import Metrics
from frontend.openai_output import Endpoint, replay_as_stream, stream_error_frames
from frontend.sse import DONE_FRAME, FrameSplitter
from orchestrator.pool import WorkerPool
from orchestrator.routers import RoutingKey, routing_key
from orchestrator.upstream import UpstreamReply, WorkerClient, translate_http_error

logger = logging.getLogger(__name__)

# Metadata-only GEN bodies carry no token ids; and no prompt text when GEN reads the prompt from the hand-off.
TOKEN_FIELDS = ("prompt_token_ids", "prompt_token_ids_b64")
PROMPT_TEXT_FIELDS = ("messages", "prompt", "input", "instructions")
PROMPT_FIELDS = (*TOKEN_FIELDS, *PROMPT_TEXT_FIELDS)

PATHS: dict[Endpoint, str] = {
    "chat": "/v1/chat/completions",
    "completions": "/v1/completions",
    "responses": "/v1/responses",
}
_STREAM_ENDS = (DONE_FRAME, b"event: response.completed", b"event: response.incomplete", b"event: error")


@dataclass(frozen=True, slots=True)
class WholeAnswer:
    status_code: int
    content: bytes


@dataclass(frozen=True, slots=True)
class StreamedAnswer:
    frames: AsyncIterator[bytes]


Answer = WholeAnswer | StreamedAnswer


@dataclass(slots=True)
class FlowRequest:
    """One client request as the flow carries it from step to step."""

    endpoint: Endpoint
    body: dict[str, Any]
    key: RoutingKey
    started: float
    headers: dict[str, str] = field(default_factory=dict)  # forwarded to both workers (X-Request-Id)
    ctx_worker: str | None = None
    gen_worker: str | None = None
    ctx: ContextResult | None = None  # the latest CTX answer: the hand-off to release if GEN never takes it
    ctx_redone: bool = False
    fallback_counted: bool = False  # a metadata-only fallback is counted once, however many GEN attempts

    @property
    def path(self) -> str:
        return PATHS[self.endpoint]

    @property
    def streaming(self) -> bool:
        return self.body.get("stream") is True


@dataclass(frozen=True, slots=True)
class ContextResult:
    response: dict[str, Any]
    params: dict[str, Any]  # choices[0].disaggregated_params (or top-level for /v1/responses)
    finished: bool


class DisaggFlow:
    def __init__(self, config: OrchestratorConfig, ctx_pool: WorkerPool, gen_pool: WorkerPool, metrics: Metrics):
        self.config = config
        self.ctx_pool = ctx_pool
        self.gen_pool = gen_pool
        self.metrics = metrics
        self._background: set[asyncio.Task[None]] = set()

    def new_request(self, endpoint: Endpoint, body: dict[str, Any], started: float,
                    headers: dict[str, str] | None = None) -> FlowRequest:
        prefix_chars = self.config.context_servers.router.prefix_chars
        return FlowRequest(endpoint, body, routing_key(body, prefix_chars), started, headers or {})

    async def run(self, request: FlowRequest) -> Answer:
        if request.key.prompt_tokens < self.config.max_local_prefill_length:
            self.metrics.local_prefill.inc()
            return await self.run_on_gen_alone(request)
        ctx = await self.run_context_step(request)
        if ctx.finished:
            self.metrics.ctx_finished.inc()
            return self.answer_from_context(request, ctx)
        try:
            if request.streaming:
                return StreamedAnswer(await self.stream_generation(request, ctx))
            answer = await self.generate_whole(request, ctx)
            if answer.status_code != 200:
                self._release_in_background(request)  # GEN refused the request: it took no KV
            return answer
        except BaseException:
            # The client left, or no GEN could take the request: free CTX's parked KV now, not at its expiry.
            self._release_in_background(request)
            raise

    # -- step 1: CTX --------------------------------------------------------------------------------------
    async def run_context_step(self, request: FlowRequest) -> ContextResult:
        ctx_body = dict(request.body)
        ctx_body["stream"] = False
        ctx_body.pop("stream_options", None)
        ctx_body["disaggregated_params"] = {
            "request_type": "context_only",
            "disagg_request_id": random.getrandbits(63),
            "return_prompt_token_ids_b64": self._wants_prompt_tokens(request),
        }
        started = time.perf_counter()
        reply, worker = await self._post_with_retries(self.ctx_pool, "ctx", request, orjson.dumps(ctx_body))
        request.ctx_worker = worker.url
        self.metrics.ctx_latency.labels(worker=worker.url).observe(time.perf_counter() - started)
        if reply.status_code != 200:
            raise RelayedError(reply)
        try:
            response = orjson.loads(reply.content)
            params = response["choices"][0]["disaggregated_params"] if "choices" in response \
                else response["disaggregated_params"]
        except (orjson.JSONDecodeError, KeyError, IndexError, TypeError) as exc:
            raise UpstreamError("the CTX step failed: its answer has no disaggregated_params") from exc
        request.ctx = ContextResult(response, params, finished=params.get("encoded_opaque_state") is None)
        return request.ctx

    def _wants_prompt_tokens(self, request: FlowRequest) -> bool:
        """Ask CTX for the b64 prompt only if GEN may need it: in metadata-only mode, only if some healthy GEN
        worker would make this request fall back (a 131k-token prompt is ~700 KB that would be parsed and
        dropped)."""
        if not self.config.gen_tokids_metadata_only:
            return self.config.gen_tokids_ctxbytes
        return any(metadata_only_decision(request.body, 1, w.engine_facts) is not None
                   for w in self.gen_pool.workers if w.healthy) or not self.gen_pool.has_healthy

    def answer_from_context(self, request: FlowRequest, ctx: ContextResult) -> Answer:
        """CTX finished the request by itself (EOS, a stop string, or max_tokens at the first token)."""
        response = ctx.response
        for name in ("prompt_token_ids_b64", "prompt_token_ids", "disaggregated_params"):
            response.pop(name, None)
        for choice in response.get("choices", ()):
            choice.pop("disaggregated_params", None)
        if not request.streaming:
            return WholeAnswer(200, orjson.dumps(response))
        options = request.body.get("stream_options")
        include_usage = isinstance(options, dict) and options.get("include_usage") is True
        return StreamedAnswer(_iterate(replay_as_stream(request.endpoint, response, include_usage)))

    # -- step 2: GEN --------------------------------------------------------------------------------------
    def generation_body(self, request: FlowRequest, ctx: ContextResult, gen_worker: WorkerClient) -> bytes:
        body = request.body
        gen_body = dict(body)
        params = dict(ctx.params)
        params["request_type"] = "generation_only"
        gen_body["disaggregated_params"] = params
        if self.config.gen_tokids_metadata_only:
            facts = gen_worker.engine_facts
            reason = metadata_only_decision(body, params.get("prompt_len"), facts)
            if reason is None:
                # Only prompt_len travels. If GEN's hand-off carries the real tokens, the prompt text need not
                # travel either: the body stops growing with the prompt.
                for name in PROMPT_FIELDS if facts.prompt_tokens_in_handoff else TOKEN_FIELDS:
                    gen_body.pop(name, None)
                return orjson.dumps(gen_body)
            if not request.fallback_counted:
                request.fallback_counted = True
                self.metrics.metadata_only_fallback.labels(reason=reason.value).inc()
        encoded = ctx.response.get("prompt_token_ids_b64")
        if (self.config.gen_tokids_ctxbytes or self.config.gen_tokids_metadata_only) and encoded is not None:
            gen_body["prompt_token_ids_b64"] = encoded  # the same str object CTX's answer held
            for name in PROMPT_TEXT_FIELDS:  # GEN takes the array path and never reads the text
                gen_body.pop(name, None)
        elif "prompt_token_ids" not in body:
            params.pop("prompt_len", None)  # no tokens travel: GEN tokenizes the text itself (the baseline)
        return orjson.dumps(gen_body)

    def _gen_key(self, request: FlowRequest, ctx: ContextResult) -> RoutingKey:
        prompt_len = ctx.params.get("prompt_len")
        exact = prompt_len if isinstance(prompt_len, int) else request.key.prompt_tokens
        return RoutingKey(request.key.prompt_prefix, exact)

    async def generate_whole(self, request: FlowRequest, ctx: ContextResult) -> WholeAnswer:
        key = self._gen_key(request, ctx)
        tried: list[WorkerClient] = []
        while True:
            worker = self.gen_pool.pick(key, tried)
            tried.append(worker)
            request.gen_worker = worker.url
            try:
                reply = await self._post(worker, request, self.generation_body(request, ctx, worker), key)
            except UpstreamError as exc:
                self._give_up_or_count("gen", tried, exc, f"the GEN step failed: {exc.message}")
                continue
            if reply.status_code >= 500 and not self._give_up("gen", tried, None):
                continue
            if self._handoff_lost(request, reply, tried):
                ctx = await self.redo_context(request)
                if ctx.finished:
                    answer = self.answer_from_context(request, ctx)
                    assert isinstance(answer, WholeAnswer)
                    return answer
                tried.clear()
                continue
            return WholeAnswer(reply.status_code, reply.content)

    async def stream_generation(self, request: FlowRequest, ctx: ContextResult) -> AsyncIterator[bytes]:
        """Open GEN's stream (retrying another GEN before the first byte) and return the relay."""
        key = self._gen_key(request, ctx)
        tried: list[WorkerClient] = []
        while True:
            started = time.perf_counter()
            worker, stream, opened = await self._open_gen_stream(
                request, key, functools.partial(self.generation_body, request, ctx), tried
            )
            if isinstance(opened, UpstreamReply):
                if not self._handoff_lost(request, opened, tried):
                    raise RelayedError(opened)
                ctx = await self.redo_context(request)
                if ctx.finished:
                    answer = self.answer_from_context(request, ctx)
                    assert isinstance(answer, StreamedAnswer)
                    return answer.frames
                tried.clear()
                continue
            self.metrics.gen_first_byte.labels(worker=worker.url).observe(time.perf_counter() - started)
            return self._relay(request, worker, stream, opened, key)

    async def _open_gen_stream(
        self,
        request: FlowRequest,
        key: RoutingKey,
        body_for: Callable[[WorkerClient], bytes],
        tried: list[WorkerClient],
    ) -> tuple[WorkerClient, AbstractAsyncContextManager[httpx.Response], httpx.Response | UpstreamReply]:
        """Open a stream on a GEN worker, moving to another one on a refused connection or a 5xx before the
        first byte. An answer that is not a stream (and is not retried) comes back as an ``UpstreamReply``."""
        while True:
            worker = self.gen_pool.pick(key, tried)
            tried.append(worker)
            request.gen_worker = worker.url
            stream = worker.stream(request.path, body_for(worker), request.headers)
            try:
                response = await stream.__aenter__()
            except UpstreamError as exc:
                self._mark(worker, exc)
                self._give_up_or_count("gen", tried, exc, f"the GEN step failed: {exc.message}")
                continue
            if response.status_code == 200:
                return worker, stream, response
            try:
                reply = UpstreamReply(response.status_code, await response.aread())
            except httpx.HTTPError as exc:
                self._give_up_or_count("gen", tried, translate_http_error(exc, worker.url),
                                       f"the GEN step failed: reading its {response.status_code} answer broke")
                continue
            finally:
                await stream.__aexit__(None, None, None)
            if response.status_code >= 500 and not self._give_up("gen", tried, None):
                continue
            return worker, stream, reply

    def _release_in_background(self, request: FlowRequest) -> None:
        ctx = request.ctx  # the latest hand-off: after a CTX redo, the first one is already gone
        worker = next((w for w in self.ctx_pool.workers if w.url == request.ctx_worker), None)
        if ctx is None or worker is None:
            return
        state, ctx_id = ctx.params.get("encoded_opaque_state"), ctx.params.get("ctx_request_id")
        if not isinstance(state, str) or ctx_id is None:
            return
        body = orjson.dumps({"ctx_request_id": str(ctx_id), "encoded_opaque_state": state})

        async def release() -> None:
            try:
                await asyncio.wait_for(worker.post("/v1/disagg/release", body, request.headers), timeout=10)
            except (UpstreamError, TimeoutError) as exc:
                logger.info("could not release a hand-off on %s (%s); it expires on its own", worker.url, exc)

        task = asyncio.get_running_loop().create_task(release())
        self._background.add(task)
        task.add_done_callback(self._background.discard)

    def _handoff_lost(self, request: FlowRequest, reply: UpstreamReply, tried: list[WorkerClient]) -> bool:
        """A retried GEN found the hand-off gone (an earlier GEN took it before failing): CTX must run again.
        Once: a second loss is answered as it is, so a flapping GEN pool cannot make CTX prefill forever."""
        if reply.status_code != 400 or len(tried) < 2 or request.ctx_redone:
            return False
        try:
            return bool(orjson.loads(reply.content)["error"]["code"] == "invalid_handoff")
        except (orjson.JSONDecodeError, KeyError, TypeError):
            return False

    async def redo_context(self, request: FlowRequest) -> ContextResult:
        request.ctx_redone = True
        self.metrics.retries.labels(step="ctx", reason="handoff_lost").inc()
        logger.warning("the KV hand-off was lost with a failed GEN; running CTX again")
        return await self.run_context_step(request)

    async def run_on_gen_alone(self, request: FlowRequest) -> Answer:
        """Conditional disaggregation: a short prompt is cheaper to prefill where it is decoded."""
        body = orjson.dumps(request.body)
        if not request.streaming:
            reply, worker = await self._post_with_retries(self.gen_pool, "gen", request, body)
            request.gen_worker = worker.url
            if reply.status_code != 200:
                raise RelayedError(reply)
            return WholeAnswer(reply.status_code, reply.content)
        worker, stream, opened = await self._open_gen_stream(request, request.key, lambda _: body, [])
        if isinstance(opened, UpstreamReply):
            raise RelayedError(opened)
        return StreamedAnswer(self._relay(request, worker, stream, opened, request.key))

    async def _relay(
        self,
        request: FlowRequest,
        worker: WorkerClient,
        stream: AbstractAsyncContextManager[httpx.Response],
        response: httpx.Response,
        key: RoutingKey,
    ) -> AsyncIterator[bytes]:
        splitter = FrameSplitter()
        seen_end = False
        last: float | None = None
        self._count_in(worker, key)
        try:
            async for chunk in response.aiter_raw():
                now = time.perf_counter()
                if last is None:
                    self.metrics.time_to_first_token.observe(now - request.started)
                else:
                    self.metrics.inter_token_latency.observe(now - last)
                last = now
                # Relay bytes as they come; only watch for the end marker to detect a truncated stream.
                for frame in splitter.feed(chunk):
                    if frame.startswith(_STREAM_ENDS):
                        seen_end = True
                yield chunk
        except httpx.HTTPError as exc:
            error = translate_http_error(exc, worker.url)
            logger.warning("GEN stream broke mid-way: %s", error.message)
            for frame in stream_error_frames(request.endpoint, UpstreamError(f"the GEN stream broke: {error.message}")):
                yield frame
            return
        finally:
            self._count_out(worker, key)
            await stream.__aexit__(None, None, None)
        if not seen_end:
            for frame in stream_error_frames(request.endpoint,
                                             UpstreamError("the GEN stream ended before it was complete")):
                yield frame

    # -- retries and load accounting ----------------------------------------------------------------------
    async def _post_with_retries(
        self, pool: WorkerPool, step: str, request: FlowRequest, body: bytes
    ) -> tuple[UpstreamReply, WorkerClient]:
        tried: list[WorkerClient] = []
        while True:
            worker = pool.pick(request.key, tried)
            tried.append(worker)
            try:
                reply = await self._post(worker, request, body, request.key)
            except UpstreamError as exc:
                self._give_up_or_count(step, tried, exc,
                                       f"the {step.upper()} step failed after {len(tried)} attempt(s): {exc.message}")
                continue
            if reply.status_code >= 500 and not self._give_up(step, tried, None):
                continue
            return reply, worker

    async def _post(self, worker: WorkerClient, request: FlowRequest, body: bytes, key: RoutingKey
                    ) -> UpstreamReply:
        self._count_in(worker, key)
        try:
            return await worker.post(request.path, body, request.headers)
        except UpstreamError as exc:
            self._mark(worker, exc)
            raise
        finally:
            self._count_out(worker, key)

    @staticmethod
    def _count_in(worker: WorkerClient, key: RoutingKey) -> None:
        worker.inflight += 1
        worker.inflight_prompt_tokens += key.prompt_tokens

    @staticmethod
    def _count_out(worker: WorkerClient, key: RoutingKey) -> None:
        worker.inflight -= 1
        worker.inflight_prompt_tokens -= key.prompt_tokens

    def _give_up(self, step: str, tried: list[WorkerClient], error: UpstreamError | None) -> bool:
        if len(tried) > self.config.max_retries:
            return True
        reason = "status_5xx" if error is None else type(error).__name__
        self.metrics.retries.labels(step=step, reason=reason).inc()
        return False

    def _give_up_or_count(self, step: str, tried: list[WorkerClient], error: UpstreamError, message: str) -> None:
        if self._give_up(step, tried, error):
            raise type(error)(message) from error
        self.metrics.failovers.labels(step=step).inc()

    @staticmethod
    def _mark(worker: WorkerClient, error: UpstreamError) -> None:
        if isinstance(error, UpstreamUnavailableError):
            worker.mark_unreachable()


class RelayedError(Exception):
    """A worker's own error answer (4xx, or 5xx after retries), passed to the client as it came."""

    def __init__(self, reply: UpstreamReply) -> None:
        super().__init__(f"upstream answered {reply.status_code}")
        self.reply = reply


async def _iterate(frames: list[bytes]) -> AsyncIterator[bytes]:
    for frame in frames:
        yield frame


def check_client_body(body: dict[str, Any]) -> None:
    """The few checks the orchestrator needs to route; the CTX worker validates everything else."""
    if not isinstance(body.get("model"), str):
        raise InvalidRequestError("'model' is required and must be a string", param="model")
    if "stream" in body and not isinstance(body["stream"], bool):
        raise InvalidRequestError("'stream' must be a boolean", param="stream")
    if "disaggregated_params" in body:
        raise InvalidRequestError("disaggregated_params is set by the orchestrator, not by clients",
                                  param="disaggregated_params")

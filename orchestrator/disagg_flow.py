"""The two-step flow, top to bottom: admit -> CTX -> hand-off -> GEN (whole or streamed).

The orchestrator never decodes the prompt. It parses CTX's answer once with orjson and puts the very
``prompt_token_ids_b64`` string object it got into GEN's body, which it encodes once with orjson.
"""

from __future__ import annotations

import logging
import random
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass
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
from orchestrator.upstream import UpstreamReply, WorkerClient, translate_http_error

logger = logging.getLogger(__name__)

# Metadata-only GEN bodies carry no token ids; and no prompt text when GEN reads the prompt from the hand-off.
TOKEN_FIELDS = ("prompt_token_ids", "prompt_token_ids_b64")
PROMPT_FIELDS = (*TOKEN_FIELDS, "messages", "prompt", "input", "instructions")

PATHS: dict[Endpoint, str] = {
    "chat": "/v1/chat/completions",
    "completions": "/v1/completions",
    "responses": "/v1/responses",
}


@dataclass(frozen=True, slots=True)
class WholeAnswer:
    status_code: int
    content: bytes


@dataclass(frozen=True, slots=True)
class StreamedAnswer:
    frames: AsyncIterator[bytes]


Answer = WholeAnswer | StreamedAnswer


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

    async def run(self, endpoint: Endpoint, body: dict[str, Any], started: float) -> Answer:
        streaming = body.get("stream") is True
        ctx = await self.run_context_step(endpoint, body)
        if ctx.finished:
            self.metrics.ctx_finished.inc()
            return self.answer_from_context(endpoint, body, ctx, streaming)
        if streaming:
            return StreamedAnswer(await self.stream_generation(endpoint, body, ctx, started))
        return await self.generate_whole(endpoint, body, ctx)

    # -- step 1: CTX --------------------------------------------------------------------------------------
    async def run_context_step(self, endpoint: Endpoint, body: dict[str, Any]) -> ContextResult:
        ctx_body = dict(body)
        ctx_body["stream"] = False
        ctx_body.pop("stream_options", None)
        ctx_body["disaggregated_params"] = {
            "request_type": "context_only",
            "disagg_request_id": random.getrandbits(63),
            "return_prompt_token_ids_b64": self.config.gen_tokids_ctxbytes or self.config.gen_tokids_metadata_only,
        }
        started = time.perf_counter()
        reply = await self._post_with_retries(self.ctx_pool, "ctx", PATHS[endpoint], orjson.dumps(ctx_body))
        self.metrics.ctx_latency.observe(time.perf_counter() - started)
        if reply.status_code != 200:
            raise _RelayedError(reply)
        try:
            response = orjson.loads(reply.content)
            params = response["choices"][0]["disaggregated_params"] if "choices" in response \
                else response["disaggregated_params"]
        except (orjson.JSONDecodeError, KeyError, IndexError, TypeError) as exc:
            raise UpstreamError("the CTX step failed: its answer has no disaggregated_params") from exc
        finished = params.get("encoded_opaque_state") is None
        return ContextResult(response, params, finished)

    def answer_from_context(
        self, endpoint: Endpoint, body: dict[str, Any], ctx: ContextResult, streaming: bool
    ) -> Answer:
        """CTX finished the request by itself (EOS, a stop string, or max_tokens at the first token)."""
        response = ctx.response
        response.pop("prompt_token_ids_b64", None)
        response.pop("prompt_token_ids", None)
        response.pop("disaggregated_params", None)
        for choice in response.get("choices", ()):
            choice.pop("disaggregated_params", None)
        if not streaming:
            return WholeAnswer(200, orjson.dumps(response))
        options = body.get("stream_options")
        include_usage = isinstance(options, dict) and options.get("include_usage") is True
        frames = replay_as_stream(endpoint, response, include_usage)
        return StreamedAnswer(_iterate(frames))

    # -- step 2: GEN --------------------------------------------------------------------------------------
    def generation_body(self, body: dict[str, Any], ctx: ContextResult, gen_worker: WorkerClient) -> bytes:
        gen_body = dict(body)
        params = dict(ctx.params)
        params["request_type"] = "generation_only"
        gen_body["disaggregated_params"] = params
        if self.config.gen_tokids_metadata_only:
            reason = metadata_only_decision(body, params.get("prompt_len"), gen_worker.facts)
            if reason is None:
                # Only prompt_len travels. If GEN's hand-off carries the real tokens, the prompt text need not
                # travel either: the body stops growing with the prompt.
                dropped = PROMPT_FIELDS if gen_worker.facts.prompt_tokens_in_handoff else TOKEN_FIELDS
                for name in dropped:
                    gen_body.pop(name, None)
                return orjson.dumps(gen_body)
            self.metrics.metadata_only_fallback.labels(reason=reason.value).inc()
        encoded = ctx.response.get("prompt_token_ids_b64")
        if (self.config.gen_tokids_ctxbytes or self.config.gen_tokids_metadata_only) and encoded is not None:
            gen_body["prompt_token_ids_b64"] = encoded  # the same str object CTX's answer held
        elif "prompt_token_ids" not in body:
            params.pop("prompt_len", None)  # no tokens travel: GEN tokenizes the text itself (the baseline)
        return orjson.dumps(gen_body)

    async def generate_whole(self, endpoint: Endpoint, body: dict[str, Any], ctx: ContextResult) -> WholeAnswer:
        tried: list[WorkerClient] = []
        while True:
            worker = self.gen_pool.pick(tried)
            tried.append(worker)
            try:
                reply = await self._post(worker, PATHS[endpoint], self.generation_body(body, ctx, worker))
            except UpstreamError as exc:
                if self._give_up("gen", tried, exc):
                    raise UpstreamUnavailableError(f"the GEN step failed: {exc.message}") from exc
                continue
            if reply.status_code >= 500 and not self._give_up("gen", tried, None):
                continue
            return WholeAnswer(reply.status_code, reply.content)

    async def stream_generation(
        self, endpoint: Endpoint, body: dict[str, Any], ctx: ContextResult, started: float
    ) -> AsyncIterator[bytes]:
        """Open GEN's stream (retrying another GEN before the first byte) and return the relay."""
        tried: list[WorkerClient] = []
        while True:
            worker = self.gen_pool.pick(tried)
            tried.append(worker)
            stream = worker.stream(PATHS[endpoint], self.generation_body(body, ctx, worker))
            try:
                response = await stream.__aenter__()
            except UpstreamError as exc:
                self._mark_down(worker, exc)
                if self._give_up("gen", tried, exc):
                    raise UpstreamUnavailableError(f"the GEN step failed: {exc.message}") from exc
                continue
            if response.status_code != 200:
                content = await response.aread()
                await stream.__aexit__(None, None, None)
                if response.status_code >= 500 and not self._give_up("gen", tried, None):
                    continue
                raise _RelayedError(UpstreamReply(response.status_code, content))
            return self._relay(endpoint, stream, response, started)

    async def _relay(
        self, endpoint: Endpoint, stream: Any, response: httpx.Response, started: float
    ) -> AsyncIterator[bytes]:
        splitter = FrameSplitter()
        seen_end = False
        first = True
        try:
            async for chunk in response.aiter_raw():
                if first:
                    self.metrics.time_to_first_token.observe(time.perf_counter() - started)
                    first = False
                # Relay bytes as they come; only watch for the end marker to detect a truncated stream.
                for frame in splitter.feed(chunk):
                    if frame == DONE_FRAME or frame.startswith((b"event: response.completed",
                                                                b"event: response.incomplete", b"event: error")):
                        seen_end = True
                yield chunk
        except httpx.HTTPError as exc:
            error = translate_http_error(exc, str(response.url))
            logger.warning("GEN stream broke mid-way: %s", error.message)
            for frame in stream_error_frames(endpoint, UpstreamError(f"the GEN stream broke: {error.message}")):
                yield frame
            return
        finally:
            await stream.__aexit__(None, None, None)
        if not seen_end:
            for frame in stream_error_frames(endpoint, UpstreamError("the GEN stream ended before it was complete")):
                yield frame

    # -- retries ------------------------------------------------------------------------------------------
    async def _post_with_retries(self, pool: WorkerPool, step: str, path: str, body: bytes) -> UpstreamReply:
        tried: list[WorkerClient] = []
        while True:
            worker = pool.pick(tried)
            tried.append(worker)
            try:
                reply = await self._post(worker, path, body)
            except UpstreamError as exc:
                if self._give_up(step, tried, exc):
                    raise type(exc)(f"the {step.upper()} step failed after {len(tried)} attempt(s): "
                                    f"{exc.message}") from exc
                continue
            if reply.status_code in (502, 503, 504) and not self._give_up(step, tried, None):
                continue
            return reply

    async def _post(self, worker: WorkerClient, path: str, body: bytes) -> UpstreamReply:
        worker.inflight += 1
        try:
            return await worker.post(path, body)
        except UpstreamError as exc:
            self._mark_down(worker, exc)
            raise
        finally:
            worker.inflight -= 1

    def _give_up(self, step: str, tried: list[WorkerClient], error: UpstreamError | None) -> bool:
        if len(tried) > self.config.max_retries:
            return True
        reason = "status_5xx" if error is None else type(error).__name__
        self.metrics.retries.labels(step=step, reason=reason).inc()
        return False

    @staticmethod
    def _mark_down(worker: WorkerClient, error: UpstreamError) -> None:
        # Passive health: a worker that refused a connection leaves routing until the monitor sees it back.
        if isinstance(error, UpstreamUnavailableError):
            worker.healthy = False


class _RelayedError(Exception):
    """A worker's own error answer (4xx, or 5xx after retries), passed to the client as it came."""

    def __init__(self, reply: UpstreamReply) -> None:
        super().__init__(f"upstream answered {reply.status_code}")
        self.reply = reply


RelayedError = _RelayedError


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

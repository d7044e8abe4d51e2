"""Anthropic's Messages API on a worker: ``/v1/messages`` where the worker serves clients itself (role ``both``),
as the chat request it translates to (``frontend.anthropic``), its answer written back in Anthropic's shape; and
``/v1/messages/count_tokens`` on every role, which the orchestrator asks of a CTX worker: the prompt is rendered
and tokenized as the chat request's would be, and no engine runs. Every error is answered in Anthropic's shape, an
unexpected one too (logged with the request id and its cause, which its 500 does not say)."""

from __future__ import annotations

import logging
from collections.abc import Awaitable, Callable
from typing import Any

import orjson
from fastapi import FastAPI, Request
from starlette.responses import Response, StreamingResponse
from starlette.types import Message

from frontend.anthropic.errors import AnthropicError, as_anthropic
from frontend.anthropic.models import CountTokensRequest, MessagesRequest
from frontend.anthropic.stream import messages_events
from frontend.anthropic.translate import count_tokens_request, message_from_chat, messages_request
from frontend.errors import ServingError
from frontend.http import (
    ClientDisconnected,
    JSONBytesResponse,
    answered_status,
    parse_json_object,
    read_body,
    validate_wire,
)
from frontend.metrics import Metrics
from frontend.openai_models import ChatCompletionRequest, GenerationWireRequest
from frontend.openapi import json_body
from frontend.structured_output import output_constraint
from workers.request_builder import prepare_prompt, sampling_params_from
from workers.service import WorkerService
from workers.settings import WorkerSettings

Serve = Callable[[Request, type[GenerationWireRequest], str], Awaitable[Response]]

logger = logging.getLogger("disagg_serve.messages")


def install_messages_routes(app: FastAPI, service: WorkerService, settings: WorkerSettings, metrics: Metrics,
                            serve: Serve) -> None:
    """``serve``: the worker's chat route (read -> admit -> prepare -> answer), counted and traced as
    ``messages``."""

    if settings.role == "both":
        @app.post("/v1/messages", openapi_extra=json_body(MessagesRequest))
        async def messages(request: Request) -> Response:
            try:
                raw = await read_body(request, settings.max_body_bytes)
                translated = messages_request(parse_json_object(raw))
            except ClientDisconnected:
                raise
            except Exception as exc:
                error = as_anthropic(exc) if isinstance(exc, ServingError) else _unexpected(request, exc)
                metrics.requests.labels(role=settings.role, endpoint="messages",
                                        status=str(answered_status(error))).inc()
                raise error from exc
            try:
                answer = await serve(_with_body(request, orjson.dumps(translated.chat)), ChatCompletionRequest,
                                     "messages")
            except ServingError as exc:
                raise as_anthropic(exc) from exc
            except ClientDisconnected:
                raise
            except Exception as exc:
                raise _unexpected(request, exc) from exc
            return _in_anthropic_shape(answer, translated.stop_sequences)

    @app.post("/v1/messages/count_tokens", openapi_extra=json_body(CountTokensRequest))
    async def count_tokens(request: Request) -> Response:
        try:
            chat = count_tokens_request(parse_json_object(await read_body(request, settings.max_body_bytes)))
            return JSONBytesResponse(orjson.dumps({"input_tokens": await prompt_tokens(service, chat)}))
        except ServingError as exc:
            raise as_anthropic(exc) from exc
        except ClientDisconnected:
            raise
        except Exception as exc:
            raise _unexpected(request, exc) from exc


def _unexpected(request: Request, exc: Exception) -> AnthropicError:
    """An exception no layer expected: logged with its cause, answered as Anthropic's 500."""
    logger.exception("request %s failed on %s: %s: %s", getattr(request.state, "request_id", "-"), request.url.path,
                     type(exc).__name__, exc)
    return AnthropicError(ServingError("internal server error"))


async def prompt_tokens(service: WorkerService, chat: dict[str, Any]) -> int:
    """How many tokens the chat request's prompt is, tools and output format included, as the engine would get it."""
    wire = validate_wire(ChatCompletionRequest, chat)
    service.require_model(wire.model)
    info = service.engine.info
    constraint = output_constraint(wire)
    sampling = sampling_params_from(wire, info, constraint)
    prompt = await prepare_prompt(wire, sampling, info, service.tokenizer, service.tool_calling(wire, constraint),
                                  service.tool_format())
    return int(prompt.tokens.size)


def _with_body(request: Request, body: bytes) -> Request:
    """``request`` with ``body`` as its body; what it receives after that (a disconnect) is the client's."""
    sent = False

    async def receive() -> Message:
        nonlocal sent
        if not sent:
            sent = True
            return {"type": "http.request", "body": body, "more_body": False}
        return await request.receive()

    scope = dict(request.scope)
    scope["headers"] = [(k, v) for k, v in request.scope["headers"] if k != b"content-length"]
    return Request(scope, receive)


def _in_anthropic_shape(answer: Response, stop_sequences: tuple[str, ...]) -> Response:
    if isinstance(answer, StreamingResponse):
        answer.body_iterator = messages_events(answer.body_iterator,  # type: ignore[arg-type]  # bytes frames
                                               stop_sequences)
        return answer
    return JSONBytesResponse(orjson.dumps(message_from_chat(orjson.loads(answer.body), stop_sequences)))

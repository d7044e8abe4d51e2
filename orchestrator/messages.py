"""Anthropic's Messages API on the orchestrator: the request is translated at the edge into the chat request the
flow already runs (``frontend.anthropic.translate``), and the chat answer, whole or streamed, is written back in
Anthropic's shape on its way out. So everything the flow does for chat applies to ``/v1/messages`` as it is:
placement and conditional disaggregation, cache-aware routing (``metadata.user_id`` as the session key), the b64
prompt relay and metadata-only, retries, cancellation of both legs, admission classes and tenants, traces; only the
metrics' ``endpoint`` label and the span's name say ``messages``.

Translated here, not by the GEN worker: the relay, a tenant's token count, a CTX-finished answer's replay and
TensorRT-LLM's wire all read the chat answer as it is, so rendering at the edge changes none of them; it costs one
parse per streamed chunk, on this route only. ``count_tokens`` asks a CTX worker's tokenizer (no engine runs)."""

from __future__ import annotations

import logging
from collections.abc import AsyncIterator, Awaitable, Callable, Iterable

import orjson
from starlette.datastructures import Headers

from frontend.anthropic.errors import AnthropicError, anthropic_status, as_anthropic
from frontend.anthropic.stream import messages_events
from frontend.anthropic.translate import message_from_chat, messages_request
from frontend.asgi_fast_path import Exchange, PushedStream, RawHeaders
from frontend.errors import RelayedError, ServingError
from frontend.http import REQUEST_ID_HEADER, ClientDisconnected, parse_json_object
from orchestrator.flow.retry import RetryPolicy
from orchestrator.pool import WorkerPool
from orchestrator.routers import RoutingKey

MESSAGES_PATH = "/v1/messages"
COUNT_TOKENS_PATH = "/v1/messages/count_tokens"
COUNT_TOKENS_STEP = "count_tokens"  # asked of a CTX worker, like /v1/models
API_KEY_HEADER = b"x-api-key"

logger = logging.getLogger("disagg_serve.messages")


def authorization(header: Callable[[bytes], str | None]) -> str | None:
    """The request's credentials: ``Authorization`` as everywhere, else Anthropic's ``x-api-key`` as a bearer."""
    sent = header(b"authorization")
    if sent is None and (key := header(API_KEY_HEADER)) is not None:
        return f"Bearer {key}"
    return sent


class MessagesExchange(Exchange):
    """The client's exchange as the chat route's handler sees it: the body it reads is the translated chat request,
    and what it answers (a whole chat answer or its stream) reaches the client in Anthropic's shape. Errors are the
    route's to translate (``serve_messages``): they are answered by the client's own exchange."""

    def __init__(self, client: Exchange) -> None:
        super().__init__(client.scope, None)
        self.client = client
        self.request_id = client.request_id
        self.stop_sequences: tuple[str, ...] = ()  # the request's, once its body is read
        self.streaming = False  # its stream has begun: an error after that cuts the connection

    def header(self, name: bytes) -> str | None:
        if name == b"authorization":
            return authorization(self.client.header)
        return self.client.header(name)

    @property
    def headers(self) -> Headers:
        return self.client.headers

    async def read_body(self, max_bytes: int) -> bytes:
        translated = messages_request(parse_json_object(await self.client.read_body(max_bytes)))
        self.stop_sequences = translated.stop_sequences
        return orjson.dumps(translated.chat)

    async def answer(self, body: bytes, status: int = 200, headers: Iterable[tuple[bytes, bytes]] = ()) -> None:
        if status == 200:
            body = orjson.dumps(message_from_chat(orjson.loads(body), self.stop_sequences))
        await self.client.answer(body, status, headers)

    async def stream(self, frames: AsyncIterator[bytes], headers: RawHeaders) -> None:
        self.streaming = True
        await self.client.stream(messages_events(frames, self.stop_sequences), headers)

    async def push(self, pushed: PushedStream, headers: RawHeaders) -> None:
        # Each chunk is read and rewritten: iterated, not pushed.
        self.streaming = True
        await self.client.stream(messages_events(pushed.frames(), self.stop_sequences), headers)

    def status_of(self, exc: BaseException) -> int:
        if isinstance(exc, ServingError):
            return anthropic_status(exc)
        return self.client.status_of(exc)


async def serve_messages(exchange: Exchange, handle: Callable[[Exchange], Awaitable[None]]) -> None:
    """``handle`` (the chat route's, on a ``MessagesExchange``), its errors raised in Anthropic's shape. What the
    exchange answers is logged there (every 5xx, with the request id and cause); logged here: an unexpected error,
    whose cause the client's 500 does not say, and an error once the stream has begun, which cuts the connection."""
    messages = MessagesExchange(exchange)
    try:
        await handle(messages)
    except ClientDisconnected:
        raise
    except ServingError as exc:
        if messages.streaming:
            logger.error("request %s: its stream was cut on %s: %s", exchange.request_id, MESSAGES_PATH, exc.message)
        raise as_anthropic(exc) from exc
    except Exception as exc:
        logger.exception("request %s failed on %s: %s: %s", exchange.request_id, MESSAGES_PATH,
                         type(exc).__name__, exc)
        raise AnthropicError(ServingError("internal server error")) from exc


async def count_tokens(retry: RetryPolicy, ctx_pool: WorkerPool, raw: bytes, headers: dict[str, str]) -> bytes:
    """``/v1/messages/count_tokens``: the body, checked by a CTX worker, which counts its prompt with its
    tokenizer; its answer as it came, its error in Anthropic's shape (an unexpected one logged with its cause)."""
    parse_json_object(raw)  # a body that is no JSON object is refused here, not sent on
    try:
        answered = await retry.run(COUNT_TOKENS_STEP, ctx_pool, RoutingKey(),
                                   lambda ctx: ctx.transport.post(COUNT_TOKENS_PATH, raw, headers),
                                   judges_workers=False)
    except ServingError:
        raise
    except Exception as exc:
        logger.exception("request %s failed on %s: %s: %s", headers.get(REQUEST_ID_HEADER, "-"), COUNT_TOKENS_PATH,
                         type(exc).__name__, exc)
        raise AnthropicError(ServingError("internal server error")) from exc
    reply = answered.answer
    if reply.status_code != 200:
        raise AnthropicError(RelayedError(reply.status_code, reply.content))
    return reply.content


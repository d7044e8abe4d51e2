"""HTTP glue shared by every server: body reading with a size limit, orjson responses, the error handlers.

FastAPI's own body parsing would run the stdlib ``json`` over 500 KB prompts and build pydantic models of every
field; the handlers here read raw bytes, parse once with orjson, and validate with the wire models.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import re
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any, TypeVar

import orjson
from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from pydantic import BaseModel, ValidationError
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.requests import ClientDisconnect
from starlette.responses import Response
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from frontend.errors import (
    InvalidRequestError,
    OverloadedError,
    PayloadTooLargeError,
    ServingError,
    WorkerDrainingError,
    error_body,
)
from frontend.logging_setup import request_id_var
from frontend.sse import close_frames

logger = logging.getLogger(__name__)

# A 290,000-token prompt is ~1.6 MB as base64 and ~2 MB as a JSON list of ids; leave ample head-room.
DEFAULT_MAX_BODY_BYTES = 64 * 1024 * 1024

ModelT = TypeVar("ModelT", bound=BaseModel)
T = TypeVar("T")


class JSONBytesResponse(Response):
    media_type = "application/json"


def json_response(payload: Any, status_code: int = 200, headers: dict[str, str] | None = None) -> Response:
    return JSONBytesResponse(orjson.dumps(payload), status_code=status_code, headers=headers)


def error_response(error: ServingError) -> Response:
    return JSONBytesResponse(error_body(error), status_code=error.status_code, headers=error.headers)


async def read_body(request: Request, max_bytes: int) -> bytes:
    declared = request.headers.get("content-length")
    if declared is not None and declared.isdigit() and int(declared) > max_bytes:
        raise too_large(max_bytes, declared)
    chunks: list[bytes] = []
    size = 0
    try:
        async for chunk in request.stream():
            size += len(chunk)
            if size > max_bytes:
                raise too_large(max_bytes)
            chunks.append(chunk)
    except ClientDisconnect as exc:  # gone before the body was read: nothing to answer, nothing to log
        raise ClientDisconnected() from exc
    return chunks[0] if len(chunks) == 1 else b"".join(chunks)


# The most bytes of request bodies a front end holds while they are read. Only bytes received count: a declared
# length costs nothing until its bytes come, so a few heads declaring huge bodies cannot take the whole budget.
# Requests are admitted only once their body is in, so without this any number of clients could each make it hold
# up to the body limit; the guarded protocol (entrypoints/http/protocol.py) charges each body's bytes as they
# arrive and gives them back once the body is whole (or abandoned).
DEFAULT_MAX_BODY_BYTES_READING = 1024 * 1024 * 1024
# The most request bodies one tenant may have being read at once (orchestrator/server.py; 0: no cap): past it, a
# 429 before its body is waited for, so that one tenant's slow uploads never hold what another's need.
DEFAULT_MAX_BODY_READS_PER_TENANT = 64


class BodyBudget:
    """Bytes of request bodies received and not yet whole, at most ``limit_bytes``: the body whose bytes would take
    it past the limit is refused with 429 (a body that is the only one holding bytes is always let in, so that a
    limit below the body limit does not refuse everything). A server keeps one, as ``app.state.body_budget``, for
    the protocol that reads its bodies."""

    __slots__ = ("limit_bytes", "reading")

    def __init__(self, limit_bytes: int) -> None:
        self.limit_bytes = limit_bytes
        self.reading = 0

    def take(self, size: int, own: int) -> bool:
        """Counts ``size`` more bytes received of a body that holds ``own`` already; False (nothing counted) if
        they do not fit."""
        reading = self.reading + size
        if reading > self.limit_bytes and self.reading > own:
            return False
        self.reading = reading
        return True

    def release(self, size: int) -> None:
        self.reading -= size

    def refusal(self) -> OverloadedError:
        return OverloadedError(f"this server holds {self.reading} bytes of request bodies being read, at its limit "
                               f"of {self.limit_bytes}")


class BodyReads:
    """Request bodies being read per key, at most ``limit`` a key (0: no cap): a tenant's, known from the request's
    head (the orchestrator's handler), or a client address's (the guarded protocol). A key reading none is
    forgotten."""

    __slots__ = ("limit", "reading")

    def __init__(self, limit: int) -> None:
        self.limit = limit
        self.reading: dict[str, int] = {}

    def try_begin(self, key: str) -> bool:
        """Count a body of ``key``'s about to be read (``end`` once it is in or failed); False, counting nothing, if
        ``key`` is at the limit."""
        count = self.reading.get(key, 0)
        if self.limit and count >= self.limit:
            return False
        self.reading[key] = count + 1
        return True

    def begin(self, tenant: str, request_id: str) -> None:
        """``try_begin`` for a tenant's body: over its limit, logged with the request id and raised as its 429."""
        if not self.try_begin(tenant):
            count = self.reading[tenant]
            logger.warning("request %s refused (429): tenant '%s' already has %d request bodies being read, its "
                           "limit", request_id, tenant, count)
            raise OverloadedError(f"tenant '{tenant}' already has {count} request bodies being read, at the limit "
                                  f"of {self.limit}")

    def end(self, key: str) -> None:
        count = self.reading[key] - 1
        if count:
            self.reading[key] = count
        else:
            del self.reading[key]


def too_large(max_bytes: int, declared: str | None = None) -> PayloadTooLargeError:
    """The 413 of a body over ``max_bytes`` (``declared``: its Content-Length, when that already says so)."""
    if declared is not None:
        return PayloadTooLargeError(f"request body of {declared} bytes exceeds the limit of {max_bytes} bytes")
    return PayloadTooLargeError(f"request body exceeds the limit of {max_bytes} bytes")


def parse_json_object(body: bytes) -> dict[str, Any]:
    try:
        parsed = orjson.loads(body)
    except orjson.JSONDecodeError as exc:
        raise InvalidRequestError(f"the request body is not valid JSON: {exc}") from exc
    if not isinstance(parsed, dict):
        raise InvalidRequestError("the request body must be a JSON object")
    return parsed


def validate_wire(model: type[ModelT], payload: dict[str, Any]) -> ModelT:
    try:
        return model.model_validate(payload)
    except ValidationError as exc:
        raise invalid_request_from(exc) from exc


def invalid_request_from(exc: ValidationError) -> InvalidRequestError:
    first = exc.errors(include_url=False)[0]
    # Drop the union-member tags pydantic inserts (e.g. 'str', 'list[...]') so param reads like the wire field.
    location = [str(p) for p in first["loc"] if not (isinstance(p, str) and ("[" in p or p in _TYPE_TAGS))]
    param = ".".join(location) or None
    if first["type"] == "extra_forbidden":
        message = f"unrecognized request argument supplied: {param}"
    else:
        message = f"{param}: {first['msg']}" if param else str(first["msg"])
    return InvalidRequestError(message, param=param)


_TYPE_TAGS = frozenset({"str", "int", "float", "bool", "list", "dict", "none", "function-after", "function-plain"})


def install_error_handlers(app: FastAPI) -> None:
    async def serving_error(request: Request, exc: Exception) -> Response:
        assert isinstance(exc, ServingError)
        if exc.status_code >= 500:
            log_server_error(getattr(request.state, "request_id", "-"), exc, request.method, request.url.path)
        return error_response(exc)

    async def http_error(request: Request, exc: Exception) -> Response:
        # Routing's own answers (no such route, wrong method) in OpenAI's shape, not FastAPI's {"detail": ...}.
        assert isinstance(exc, StarletteHTTPException)
        code, message = _ROUTING_ERRORS.get(exc.status_code, ("http_error", "{detail}"))
        text = message.format(method=request.method, path=request.url.path, detail=exc.detail)
        body = {"error": {"message": text, "type": "invalid_request_error", "param": None, "code": code}}
        # A 405 keeps its Allow header: it says which methods the route takes.
        return JSONBytesResponse(orjson.dumps(body), status_code=exc.status_code, headers=dict(exc.headers or {}))

    async def validation_error(_: Request, exc: Exception) -> Response:
        assert isinstance(exc, RequestValidationError)
        errors = exc.errors()
        param = ".".join(str(p) for p in errors[0]["loc"]) if errors else None
        return error_response(InvalidRequestError(str(errors[0]["msg"]) if errors else "invalid", param=param))

    async def client_disconnected(_: Request, exc: Exception) -> Response:
        return Response(status_code=answered_status(exc))  # nobody is listening: only the access log reads it

    app.add_exception_handler(ClientDisconnected, client_disconnected)
    app.add_exception_handler(ServingError, serving_error)
    app.add_exception_handler(RequestValidationError, validation_error)
    app.add_exception_handler(StarletteHTTPException, http_error)
    # Not an ``Exception`` handler: Starlette re-raises those after answering, and uvicorn then closes the
    # keep-alive connection, so the next request a pooled client sends on it fails with a connection reset.
    app.add_middleware(_AnswerUnexpectedErrors)


def log_server_error(request_id: str, error: ServingError, method: str, path: str) -> None:
    """Every 5xx is logged with its request id and its cause; a draining worker's refusals, which are expected and
    sent elsewhere, at info."""
    level = logging.INFO if isinstance(error, WorkerDrainingError) else logging.ERROR
    logger.log(level, "request %s answered %d on %s %s: %s", request_id, error.status_code, method, path,
               _cause(error))


def _cause(error: ServingError) -> str:
    # A relayed worker error's cause is the worker's own message, inside its body.
    fields = error.to_dict().get("error")
    message = fields.get("message") if isinstance(fields, dict) else None
    return message if isinstance(message, str) else error.message


_ROUTING_ERRORS = {
    404: ("not_found", "no route {method} {path}"),
    405: ("method_not_allowed", "method {method} is not allowed on {path}"),
}


class _AnswerUnexpectedErrors:
    """Pure ASGI middleware: an exception no handler took becomes a 500 in OpenAI's shape, logged once."""

    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        started = False

        async def tracking_send(message: Message) -> None:
            nonlocal started
            if message["type"] == "http.response.start":
                started = True
            await send(message)

        try:
            await self.app(scope, receive, tracking_send)
        except Exception as exc:
            if started:  # too late to answer: let the server drop the connection
                raise
            logger.exception("unhandled error", exc_info=exc)
            await error_response(ServingError("internal server error"))(scope, receive, send)


async def then_call(frames: AsyncIterator[bytes], done: Callable[[], None]) -> AsyncIterator[bytes]:
    """Relay ``frames`` and call ``done`` when the stream ends, however it ends (finished, failed, cancelled)."""
    try:
        async for frame in frames:
            yield frame
    finally:
        done()
        await close_frames(frames)


REQUEST_ID_HEADER = "X-Request-Id"
_REQUEST_ID_OK = re.compile(r"[A-Za-z0-9._:-]{1,128}")


def install_request_ids(app: FastAPI) -> None:
    app.add_middleware(_RequestIds)


class _RequestIds:
    """Every answer, errors included, carries ``X-Request-Id``: the client's (if sane) or a new one.

    The id is in ``request.state.request_id`` for handlers and in the log context for every line logged while
    the request is served. An id that is too long or has odd characters is replaced, so logs cannot be forged.
    """

    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        request_id = request_id_of(scope["headers"])
        scope.setdefault("state", {})["request_id"] = request_id
        token = request_id_var.set(request_id)

        async def send_with_id(message: Message) -> None:
            if message["type"] == "http.response.start":
                headers = [(k, v) for k, v in message.get("headers", []) if k.lower() != b"x-request-id"]
                headers.append((b"x-request-id", request_id.encode()))
                message = {**message, "headers": headers}
            await send(message)

        try:
            await self.app(scope, receive, send_with_id)
        finally:
            request_id_var.reset(token)


def request_id_of(headers: list[tuple[bytes, bytes]]) -> str:
    """The request's id: the client's ``X-Request-Id`` if sane, else a new one (``headers``: the ASGI scope's)."""
    for name, value in headers:
        if name == b"x-request-id":
            presented = value.decode("latin-1")
            if _REQUEST_ID_OK.fullmatch(presented):
                return presented
            break
    # 128 random bits as 32 hex digits, like ``uuid4().hex`` but without building a UUID (3.4 -> 0.5 us, on every
    # request that brings no id of its own).
    return os.urandom(16).hex()


async def cancel_on_disconnect(request: Request, work: Callable[[], Awaitable[T]]) -> T:
    """Run ``work`` but cancel it as soon as the client goes away (non-streaming handlers).

    Starlette does not cancel a plain handler when the client disconnects, so without this a dropped client
    would keep a prefill running on the engine. Cancellation propagates into the engine adapter, which aborts.
    """
    work_task = asyncio.ensure_future(work())
    disconnect_task = asyncio.ensure_future(_wait_for_disconnect(request))
    try:
        await asyncio.wait({work_task, disconnect_task}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        if not work_task.done():
            work_task.cancel()
        disconnect_task.cancel()
    if not work_task.done() or work_task.cancelled():
        with contextlib.suppress(asyncio.CancelledError):
            await work_task
        raise ClientDisconnected()
    return work_task.result()


class ClientDisconnected(Exception):
    """The client went away; nothing is sent back."""


# nginx's "client closed request": a request the client abandoned is not a 500 of ours.
CLIENT_CLOSED_REQUEST = 499


def answered_status(exc: BaseException) -> int:
    """The status the handlers above answer ``exc`` with, for a handler's request metrics and log line.

    A handler that counts its requests by status writes ``except BaseException as exc: status =
    answered_status(exc); raise``, so its count and the answer cannot drift apart.
    """
    if isinstance(exc, ServingError):
        return exc.status_code
    if isinstance(exc, ClientDisconnected):
        return CLIENT_CLOSED_REQUEST
    return 500


async def _wait_for_disconnect(request: Request) -> None:
    while True:
        message = await request.receive()
        if message["type"] == "http.disconnect":
            return

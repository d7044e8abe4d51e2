"""Errors in Anthropic's shape: ``{"type": "error", "error": {"type", "message"}}``, with Anthropic's status codes.

Every error a Messages route raises, ours or a worker's relayed one, is re-raised as ``AnthropicError`` at the
route's edge, so the one place that answers errors (``frontend.http`` / ``frontend.asgi_fast_path``) writes
Anthropic's body; a stream that fails after its first byte ends with the same error as an ``error`` event."""

from __future__ import annotations

from typing import ClassVar

import orjson

from frontend.errors import OverloadedError, RelayedError, ServingError
from frontend.sse import event_frame

OVERLOADED_STATUS = 529  # Anthropic's "overloaded": the SDK retries it
# Anthropic's error type for each status it answers with.
ERROR_TYPES: dict[int, str] = {
    400: "invalid_request_error",
    401: "authentication_error",
    403: "permission_error",
    404: "not_found_error",
    408: "timeout_error",
    413: "request_too_large",
    429: "rate_limit_error",
    431: "invalid_request_error",
    504: "timeout_error",
    OVERLOADED_STATUS: "overloaded_error",
}


class AnthropicError(ServingError):
    """``cause`` in Anthropic's shape; its status is Anthropic's for it (``anthropic_status``)."""

    error_type: ClassVar[str] = "api_error"

    def __init__(self, cause: ServingError) -> None:
        param, message = _param_and_message(cause)
        if param and not message.startswith(param):  # Anthropic's shape has no 'param': the message says it first
            message = f"{param}: {message}"
        super().__init__(message, param=param, code=cause.code)
        self.cause = cause
        self.status_code = anthropic_status(cause)
        self.kind = ERROR_TYPES.get(self.status_code, "api_error")

    @property
    def headers(self) -> dict[str, str]:
        return self.cause.headers

    def to_dict(self) -> dict[str, object]:
        return {"type": "error", "error": {"type": self.kind, "message": self.message}}


def anthropic_status(error: ServingError) -> int:
    """The status Anthropic answers ``error`` with: the admission queue's shedding (and a pool with no worker to
    take the request) is its 529 "overloaded"; a tenant's rate limit stays a 429; the rest keep theirs."""
    if isinstance(error, OverloadedError) and error.code != "tenant_rate_limited":
        return OVERLOADED_STATUS
    if error.status_code == 503:
        return OVERLOADED_STATUS
    return error.status_code


def as_anthropic(error: ServingError) -> AnthropicError:
    return error if isinstance(error, AnthropicError) else AnthropicError(error)


def error_event(error: ServingError) -> bytes:
    """The ``error`` event a Messages stream ends with when it fails after its first byte."""
    return event_frame("error", as_anthropic(error).to_dict())


def error_event_from_openai(payload: dict[str, object]) -> bytes:
    """The ``error`` event for an OpenAI-shaped error a chat stream ended with (``frontend.errors.sse_error_event``)."""
    return event_frame("error", {"type": "error", "error": {"type": _type_of_openai(payload),
                                                            "message": _openai_message(payload)}})


def _param_and_message(error: ServingError) -> tuple[str | None, str]:
    if isinstance(error, RelayedError):  # a worker's own answer, in OpenAI's shape
        try:
            relayed = orjson.loads(error.content)
        except orjson.JSONDecodeError:
            return None, error.message
        inner = relayed.get("error") if isinstance(relayed, dict) else None
        if isinstance(inner, dict):
            param = inner.get("param")
            return (param if isinstance(param, str) else None), _openai_message(relayed)
        return None, error.message
    return error.param, error.message


def _openai_message(payload: dict[str, object]) -> str:
    inner = payload.get("error")
    if isinstance(inner, dict) and isinstance(inner.get("message"), str):
        return str(inner["message"])
    return "the request failed"


def _type_of_openai(payload: dict[str, object]) -> str:
    inner = payload.get("error")
    kind = inner.get("type") if isinstance(inner, dict) else None
    if kind in ("invalid_request_error", "authentication_error", "permission_error", "rate_limit_error"):
        return str(kind)
    if kind == "timeout":
        return "timeout_error"
    if kind == "service_unavailable":
        return "overloaded_error"
    return "api_error"

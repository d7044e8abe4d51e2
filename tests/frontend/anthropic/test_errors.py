"""Errors in Anthropic's shape and with its status codes."""

from __future__ import annotations

import orjson
import pytest

from frontend.anthropic.errors import AnthropicError, error_event
from frontend.errors import (
    AuthenticationError,
    InvalidRequestError,
    ModelNotFoundError,
    OverloadedError,
    RelayedError,
    ServingError,
    UpstreamTimeoutError,
    UpstreamUnavailableError,
    error_body,
)


class TenantLimit(OverloadedError):
    default_code = "tenant_rate_limited"


@pytest.mark.parametrize(("error", "status", "kind"), [
    (InvalidRequestError("bad", param="max_tokens"), 400, "invalid_request_error"),
    (AuthenticationError("who?"), 401, "authentication_error"),
    (ModelNotFoundError("no such model"), 404, "not_found_error"),
    (OverloadedError("the queue is full"), 529, "overloaded_error"),
    (TenantLimit("slow down"), 429, "rate_limit_error"),
    (UpstreamUnavailableError("no worker"), 529, "overloaded_error"),
    (UpstreamTimeoutError("too slow"), 504, "timeout_error"),
    (ServingError("boom"), 500, "api_error"),
])
def test_status_and_type(error: ServingError, status: int, kind: str) -> None:
    translated = AnthropicError(error)
    assert translated.status_code == status
    body = orjson.loads(error_body(translated))
    assert body == {"type": "error", "error": {"type": kind, "message": body["error"]["message"]}}


def test_the_message_names_the_field() -> None:
    assert AnthropicError(InvalidRequestError("must be >= 1", param="max_tokens")).message == \
        "max_tokens: must be >= 1"


def test_a_relayed_worker_error_is_rewritten() -> None:
    relayed = RelayedError(400, orjson.dumps({"error": {"message": "too long", "type": "invalid_request_error",
                                                        "param": "messages", "code": "context_length_exceeded"}}))
    assert AnthropicError(relayed).to_dict() == {"type": "error", "error": {"type": "invalid_request_error",
                                                                           "message": "messages: too long"}}


def test_retry_after_is_kept_and_the_stream_event_has_the_same_shape() -> None:
    assert AnthropicError(OverloadedError("full", retry_after_s=3)).headers == {"Retry-After": "3"}
    frame = error_event(OverloadedError("full"))
    assert frame == b'event: error\ndata: {"type":"error","error":{"type":"overloaded_error","message":"full"}}\n\n'

from __future__ import annotations

import orjson
import pytest
from openai.types import ErrorObject

from frontend import errors
from frontend.errors import (
    AuthenticationError,
    ContextLengthError,
    EngineError,
    HandoffError,
    InvalidRequestError,
    ModelNotFoundError,
    OverloadedError,
    PayloadTooLargeError,
    ServingError,
    TokenCodecError,
    UnsupportedParameterError,
    UpstreamError,
    UpstreamTimeoutError,
    UpstreamUnavailableError,
    error_body,
    sse_error_event,
)

TABLE: list[tuple[type[ServingError], int, str, str | None]] = [
    (ServingError, 500, "server_error", None),
    (InvalidRequestError, 400, "invalid_request_error", None),
    (TokenCodecError, 400, "invalid_request_error", "invalid_prompt_tokens"),
    (UnsupportedParameterError, 400, "invalid_request_error", "unsupported_parameter"),
    (ContextLengthError, 400, "invalid_request_error", "context_length_exceeded"),
    (HandoffError, 400, "invalid_request_error", "invalid_handoff"),
    (AuthenticationError, 401, "authentication_error", "invalid_api_key"),
    (ModelNotFoundError, 404, "invalid_request_error", "model_not_found"),
    (PayloadTooLargeError, 413, "invalid_request_error", "payload_too_large"),
    (EngineError, 500, "server_error", "engine_error"),
    (UpstreamError, 502, "upstream_error", "upstream_error"),
    (UpstreamUnavailableError, 503, "service_unavailable", "upstream_unavailable"),
    (UpstreamTimeoutError, 504, "timeout", "upstream_timeout"),
]


def test_the_table_covers_every_error_class() -> None:
    defined = {v for v in vars(errors).values() if isinstance(v, type) and issubclass(v, ServingError)}
    assert defined == {row[0] for row in TABLE} | {OverloadedError}


@pytest.mark.parametrize(("cls", "status", "error_type", "code"), TABLE, ids=[row[0].__name__ for row in TABLE])
def test_each_error_maps_to_its_status_and_openai_shape(
    cls: type[ServingError], status: int, error_type: str, code: str | None
) -> None:
    error = cls("went wrong", param="field")
    assert error.status_code == status
    body = orjson.loads(error_body(error))
    assert body == {"error": {"message": "went wrong", "type": error_type, "param": "field", "code": code}}
    parsed = ErrorObject.model_validate(body["error"])
    assert parsed.message == "went wrong"
    assert parsed.param == "field"
    assert error.headers == {}


def test_explicit_code_overrides_the_default() -> None:
    error = InvalidRequestError("no", param="p", code="metadata_only_refused")
    assert orjson.loads(error_body(error))["error"]["code"] == "metadata_only_refused"


def test_overloaded_is_429_with_retry_after() -> None:
    error = OverloadedError("busy", retry_after_s=7)
    assert error.status_code == 429
    assert error.headers == {"Retry-After": "7"}
    assert orjson.loads(error_body(error))["error"]["type"] == "rate_limit_error"


def test_sse_error_event_is_one_data_frame_with_the_same_body() -> None:
    error = UpstreamError("the GEN stream broke")
    frame = sse_error_event(error)
    assert frame.startswith(b"data: ")
    assert frame.endswith(b"\n\n")
    assert frame.count(b"\n\n") == 1
    assert orjson.loads(frame[len(b"data: "):]) == orjson.loads(error_body(error))


def test_errors_are_exceptions_with_their_message() -> None:
    with pytest.raises(InvalidRequestError, match="bad thing"):
        raise TokenCodecError("bad thing")

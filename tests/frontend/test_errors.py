from __future__ import annotations

import orjson
import pytest
from openai.types import ErrorObject

from frontend import errors
from frontend.errors import (
    AdminDisabledError,
    AuthenticationError,
    ContextLengthError,
    EngineError,
    EngineRequestError,
    HandoffError,
    HeadTooLargeError,
    InvalidRequestError,
    ModelNotFoundError,
    OverloadedError,
    PayloadTooLargeError,
    RelayedError,
    RequestTimeoutError,
    ResponseNotFoundError,
    ResponseStoreUnavailableError,
    ServingError,
    TokenCodecError,
    UnsupportedParameterError,
    UpstreamError,
    UpstreamTimeoutError,
    UpstreamUnavailableError,
    WorkerDrainingError,
    error_body,
    responses_error_event,
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
    (AdminDisabledError, 403, "permission_error", "admin_disabled"),
    (ModelNotFoundError, 404, "invalid_request_error", "model_not_found"),
    (ResponseNotFoundError, 404, "invalid_request_error", "response_not_found"),
    (PayloadTooLargeError, 413, "invalid_request_error", "payload_too_large"),
    (RequestTimeoutError, 408, "invalid_request_error", "request_timeout"),
    (HeadTooLargeError, 431, "invalid_request_error", "request_header_fields_too_large"),
    (EngineError, 500, "server_error", "engine_error"),
    (EngineRequestError, 500, "server_error", "engine_request_failed"),
    (UpstreamError, 502, "upstream_error", "upstream_error"),
    (UpstreamUnavailableError, 503, "service_unavailable", "upstream_unavailable"),
    (UpstreamTimeoutError, 504, "timeout", "upstream_timeout"),
]


def test_the_table_covers_every_error_class() -> None:
    defined = {v for v in vars(errors).values() if isinstance(v, type) and issubclass(v, ServingError)}
    assert defined == {row[0] for row in TABLE} | {
        OverloadedError, RelayedError, ResponseStoreUnavailableError, WorkerDrainingError}


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


def test_an_unavailable_response_store_is_503_with_retry_after() -> None:
    error = ResponseStoreUnavailableError("down")
    assert (error.status_code, error.headers) == (503, {"Retry-After": "1"})
    assert orjson.loads(error_body(error))["error"] == {"message": "down", "type": "service_unavailable",
                                                       "param": None, "code": "response_store_unavailable"}


def test_a_draining_worker_is_503_with_retry_after() -> None:
    error = WorkerDrainingError("draining")
    assert (error.status_code, error.headers) == (503, {"Retry-After": "1"})
    assert orjson.loads(error_body(error))["error"] == {"message": "draining", "type": "service_unavailable",
                                                       "param": None, "code": "worker_draining"}


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


def test_a_relayed_error_answers_the_workers_status_and_bytes_untouched() -> None:
    content = b'{"error": {"message": "no such model", "type": "invalid_request_error", "param": "model",' \
              b' "code": "model_not_found"}}'
    error = RelayedError(404, content)
    assert isinstance(error, ServingError)
    assert not isinstance(error, UpstreamError)  # a worker's 4xx is the request's fault, not the worker's
    assert error.status_code == 404
    assert error_body(error) is content
    assert error.headers == {}
    # In a stream (after the first byte) it is the worker's own error object.
    assert orjson.loads(sse_error_event(error)[len(b"data: "):]) == orjson.loads(content)


def test_a_relayed_answer_that_is_not_an_error_object_still_makes_a_well_formed_event() -> None:
    error = RelayedError(502, b"<html>bad gateway</html>")
    assert error_body(error) == b"<html>bad gateway</html>"
    body = orjson.loads(sse_error_event(error)[len(b"data: "):])
    assert body["error"]["message"] == "the worker answered 502"
    ErrorObject.model_validate(body["error"])


def test_responses_error_event_carries_the_same_fields_at_the_top_level() -> None:
    error = UpstreamTimeoutError("GEN timed out", param="x")
    frame = responses_error_event(error, sequence_number=9)
    head, _, data = frame.partition(b"\n")
    assert head == b"event: error"
    assert data.startswith(b"data: ") and data.endswith(b"\n\n")
    assert orjson.loads(data[len(b"data: "):]) == {"type": "error", "sequence_number": 9, "code": "upstream_timeout",
                                                   "message": "GEN timed out", "param": "x"}

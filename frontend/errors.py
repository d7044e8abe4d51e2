"""The one error hierarchy of the project, and its one mapping to HTTP.

    ServingError                      500 server_error
    ├── InvalidRequestError           400 invalid_request_error (names the offending field in ``param``)
    │   ├── TokenCodecError           400 (prompt_token_ids_b64 / prompt_len)
    │   ├── UnsupportedParameterError 400 code=unsupported_parameter
    │   ├── ContextLengthError        400 code=context_length_exceeded
    │   └── HandoffError              400 code=invalid_handoff (unknown, expired, replayed or mismatched KV)
    ├── AuthenticationError           401
    ├── AdminDisabledError            403 code=admin_disabled (no admin key configured: the admin API is shut)
    ├── ModelNotFoundError            404 code=model_not_found
    ├── ResponseNotFoundError         404 (no stored response of that id: unknown, evicted, expired or deleted)
    ├── RequestTimeoutError           408 code=request_timeout (a request's body did not arrive in time)
    ├── PayloadTooLargeError          413
    ├── HeadTooLargeError             431 code=request_header_fields_too_large
    ├── OverloadedError               429 with Retry-After (the admission queue; a tenant's limit:
    │                                 code=tenant_rate_limited, orchestrator/tenants.py)
    ├── ResponseStoreUnavailableError 503 with Retry-After code=response_store_unavailable (a shared store that
    │                                 does not answer)
    ├── EngineError                   500 (the engine failed; foreign errors are wrapped at the adapter)
    │   └── EngineRequestError        500 code=engine_request_failed (this request fails the engine on any
    │                                 worker: the orchestrator does not retry it)
    ├── RelayedError                  the worker's own status (a worker's 4xx, or 5xx after retries, whose
    │                                 body the orchestrator passes on byte for byte)
    └── UpstreamError                 502 (a worker answered badly; says which step failed)
        ├── UpstreamUnavailableError  503 (no worker reachable after retries)
        └── UpstreamTimeoutError      504

Handlers raise; they never return error values. ``error_body``, ``sse_error_event`` (chat and completion streams)
and ``responses_error_event`` (the Responses API stream) are the only places that turn an error into bytes, so the
HTTP and SSE shapes cannot drift apart. ``frontend.http`` is the one place that turns an error into a response.
"""

from __future__ import annotations

from typing import ClassVar

import orjson

from frontend.sse import event_frame


class ServingError(Exception):
    # Not a ClassVar: a relayed error carries the status the worker answered with.
    status_code: int = 500
    error_type: ClassVar[str] = "server_error"
    default_code: ClassVar[str | None] = None

    def __init__(self, message: str, *, param: str | None = None, code: str | None = None) -> None:
        super().__init__(message)
        self.message = message
        self.param = param
        self.code = code if code is not None else self.default_code

    @property
    def headers(self) -> dict[str, str]:
        return {}

    def to_dict(self) -> dict[str, object]:
        return {"error": {"message": self.message, "type": self.error_type, "param": self.param, "code": self.code}}


class InvalidRequestError(ServingError):
    status_code = 400
    error_type = "invalid_request_error"


class TokenCodecError(InvalidRequestError):
    default_code = "invalid_prompt_tokens"


class UnsupportedParameterError(InvalidRequestError):
    default_code = "unsupported_parameter"


class ContextLengthError(InvalidRequestError):
    default_code = "context_length_exceeded"


class HandoffError(InvalidRequestError):
    default_code = "invalid_handoff"


class AuthenticationError(ServingError):
    status_code = 401
    error_type = "authentication_error"
    default_code = "invalid_api_key"


class AdminDisabledError(ServingError):
    status_code = 403
    error_type = "permission_error"
    default_code = "admin_disabled"


class ModelNotFoundError(ServingError):
    status_code = 404
    error_type = "invalid_request_error"
    default_code = "model_not_found"


class ResponseNotFoundError(ServingError):
    status_code = 404
    error_type = "invalid_request_error"
    default_code = "response_not_found"


class PayloadTooLargeError(ServingError):
    status_code = 413
    error_type = "invalid_request_error"
    default_code = "payload_too_large"


class RequestTimeoutError(ServingError):
    status_code = 408
    error_type = "invalid_request_error"
    default_code = "request_timeout"


class HeadTooLargeError(ServingError):
    status_code = 431
    error_type = "invalid_request_error"
    default_code = "request_header_fields_too_large"


class OverloadedError(ServingError):
    status_code = 429
    error_type = "rate_limit_error"
    default_code = "overloaded"

    def __init__(self, message: str, *, retry_after_s: int = 1) -> None:
        super().__init__(message)
        self.retry_after_s = retry_after_s

    @property
    def headers(self) -> dict[str, str]:
        return {"Retry-After": str(self.retry_after_s)}


class EngineError(ServingError):
    default_code = "engine_error"


class EngineRequestError(EngineError):
    """The engine failed on this request in a way that would repeat on any worker (deterministic)."""

    default_code = "engine_request_failed"


# A worker's 5xx with one of these ``code``s is a deterministic failure: retrying it elsewhere cannot help.
DETERMINISTIC_FAILURE_CODES: frozenset[str] = frozenset({EngineRequestError.default_code})


class RelayedError(ServingError):
    """A worker's own error answer, passed to the client as it came: its status and its very bytes.

    Not an ``UpstreamError``: a worker's 400 says the request is bad, not that the worker failed.
    """

    def __init__(self, status_code: int, content: bytes) -> None:
        super().__init__(f"the worker answered {status_code}")
        self.status_code = status_code
        self.content = content

    def to_dict(self) -> dict[str, object]:
        # Only for an SSE error event; the HTTP answer is ``content`` itself (see ``error_body``).
        try:
            relayed = orjson.loads(self.content)
        except orjson.JSONDecodeError:
            relayed = None
        if isinstance(relayed, dict) and isinstance(relayed.get("error"), dict):
            return relayed
        return super().to_dict()


class ResponseStoreUnavailableError(ServingError):
    """The shared Responses store did not answer (unreachable, or slower than its timeout): only requests that
    read it get this; everything else is served."""

    status_code = 503
    error_type = "service_unavailable"
    default_code = "response_store_unavailable"

    @property
    def headers(self) -> dict[str, str]:
        return {"Retry-After": "1"}


class WorkerDrainingError(ServingError):
    """A worker that is draining (SIGTERM, workers/drain.py) takes no new request. Nothing of it ran, so the
    orchestrator sends it to another worker and does not count it against this one."""

    status_code = 503
    error_type = "service_unavailable"
    default_code = "worker_draining"

    @property
    def headers(self) -> dict[str, str]:
        return {"Retry-After": "1"}


class UpstreamError(ServingError):
    status_code = 502
    error_type = "upstream_error"
    default_code = "upstream_error"


class UpstreamUnavailableError(UpstreamError):
    status_code = 503
    error_type = "service_unavailable"
    default_code = "upstream_unavailable"


class UpstreamTimeoutError(UpstreamError):
    status_code = 504
    error_type = "timeout"
    default_code = "upstream_timeout"


def error_body(error: ServingError) -> bytes:
    if isinstance(error, RelayedError):
        return error.content  # relayed untouched: never parsed and re-encoded
    return orjson.dumps(error.to_dict())


def sse_error_event(error: ServingError) -> bytes:
    """The SSE frame a chat or completion stream ends with when it fails after its first byte (then
    ``data: [DONE]``)."""
    return b"data: " + orjson.dumps(error.to_dict()) + b"\n\n"


def responses_error_event(error: ServingError, sequence_number: int) -> bytes:
    """The ``error`` event a Responses API stream ends with when it fails after its first byte (OpenAI's
    ``ResponseErrorEvent``: the error's fields at the top level, no ``[DONE]`` after it)."""
    fields = error.to_dict()["error"]
    assert isinstance(fields, dict)
    return event_frame("error", {"type": "error", "sequence_number": sequence_number, "code": fields.get("code"),
                                 "message": fields.get("message"), "param": fields.get("param")})

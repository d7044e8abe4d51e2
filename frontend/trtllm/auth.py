"""TensorRT-LLM's own internal authentication of its disaggregated server: the ``x-trtllm-disagg-auth`` HMAC.

Facts from TensorRT-LLM's source (``tensorrt_llm/serve/disagg_auth.py``, PR #16002 "Authenticate disagg request to
verify encoded_opaque_state and ctx_info_endpoint", and the stored later revisions of that file), not its code:

- one key shared by the disaggregated server and every worker, ``internal_request_auth_key`` in each one's YAML
  config (TensorRT-LLM reads no environment variable for it; ours is ``TRTLLM_AUTH_KEY_ENV``);
- header ``x-trtllm-disagg-auth``, value ``"sha256=" + hex(HMAC-SHA256(key, payload))``, payload a canonical JSON
  text (keys sorted, separators ``,`` and ``:``, Python's ``json.dumps`` escaping, UTF-8);
- a completion request is signed when its ``disaggregated_params`` carry ``encoded_opaque_state`` or
  ``ctx_info_endpoint`` (what would make a worker fetch KV from, or ask, a place the caller names): the server signs
  the request it sends to GEN, and the worker refuses such a request without a valid signature. The payload is
  ``{"ctx_info_endpoint": the endpoint (a list's first element), "encoded_opaque_state": the state}``;
- a later revision also signs the lifecycle v1 control calls: payload ``{"body": the call's JSON body, "route":
  its path}``, so a signature is bound to one route and one body.

Not found in its source, so not done: any timestamp or nonce (a signature is replayable for the same fields, as in
TensorRT-LLM). Where revisions differ (a later one signs more of ``disaggregated_params`` for v1 requests), the
merged PR's payload is the one sent, and both that and the later one are accepted.
"""

from __future__ import annotations

import hashlib
import hmac
import json
import os
from collections.abc import Mapping
from typing import Any

TRTLLM_AUTH_HEADER = "x-trtllm-disagg-auth"
TRTLLM_AUTH_KEY_ENV = "DISAGG_TRTLLM_AUTH_KEY"  # ours: the value of TensorRT-LLM's internal_request_auth_key
_PREFIX = "sha256="
PROTECTED_FIELDS = ("encoded_opaque_state", "ctx_info_endpoint")
# The later revision's signed fields for a request: the lifecycle identity too, and what places the request.
_LATER_SIGNED_FIELDS = (
    *PROTECTED_FIELDS, "logical_request_id", "prefill_artifact_id", "artifact_version", "handoff_attempt_uuid",
    "consumer_grant_id", "transfer_session_id", "generation_endpoint_name", "generation_endpoint_rank",
    "generation_endpoint_incarnation", "context_control_endpoint", "context_transceiver_lifecycle",
    "request_type", "ctx_dp_rank", "schedule_style",
)


def trtllm_auth_key_from_env(environ: Mapping[str, str] | None = None) -> str | None:
    """TensorRT-LLM's ``internal_request_auth_key`` as this deployment gives it to our processes; None when unset."""
    return (os.environ if environ is None else environ).get(TRTLLM_AUTH_KEY_ENV) or None


def _canonical(payload: Mapping[str, Any]) -> bytes:
    return json.dumps(payload, sort_keys=True, separators=(",", ":")).encode("utf-8")


def _signature(key: str, payload: Mapping[str, Any]) -> str:
    return _PREFIX + hmac.new(key.encode("utf-8"), _canonical(payload), hashlib.sha256).hexdigest()


def _first(endpoint: Any) -> Any:
    if isinstance(endpoint, list):
        return endpoint[0] if endpoint else None
    return endpoint


def needs_request_signature(params: Mapping[str, Any] | None) -> bool:
    """Whether a request with these ``disaggregated_params`` (JSON form) must be signed."""
    return params is not None and any(params.get(name) is not None for name in PROTECTED_FIELDS)


def request_signature(key: str, params: Mapping[str, Any]) -> str:
    """The signature TensorRT-LLM's disaggregated server sends with a request carrying protected fields."""
    return _signature(key, {"ctx_info_endpoint": _first(params.get("ctx_info_endpoint")),
                            "encoded_opaque_state": params.get("encoded_opaque_state")})


def request_signed(key: str, params: Mapping[str, Any], presented: str | None) -> bool:
    """Whether ``presented`` signs these params, in either revision's payload. Constant time per comparison."""
    if presented is None:
        return False
    later = {name: _first(params.get(name)) if name == "ctx_info_endpoint" else params.get(name)
             for name in _LATER_SIGNED_FIELDS}
    candidates = (request_signature(key, params), _signature(key, later))
    return any(hmac.compare_digest(presented.encode(), expected.encode()) for expected in candidates)


def control_signature(key: str, route: str, body: Mapping[str, Any]) -> str:
    """The signature of one lifecycle control call: its route and its JSON body."""
    return _signature(key, {"body": body, "route": route})


def control_signed(key: str, route: str, body: Mapping[str, Any], presented: str | None) -> bool:
    return presented is not None and hmac.compare_digest(presented.encode(),
                                                         control_signature(key, route, body).encode())

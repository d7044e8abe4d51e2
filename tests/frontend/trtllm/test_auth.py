"""TensorRT-LLM's ``x-trtllm-disagg-auth`` (frontend/trtllm/auth.py): the signatures, checked against HMACs computed
here from the canonical JSON texts TensorRT-LLM's source describes, written out by hand."""

from __future__ import annotations

import hashlib
import hmac

from frontend.trtllm.auth import (
    control_signature,
    control_signed,
    needs_request_signature,
    request_signature,
    request_signed,
)

KEY = "a-shared-internal-request-auth-key"


def _hmac(text: str) -> str:
    return "sha256=" + hmac.new(KEY.encode(), text.encode(), hashlib.sha256).hexdigest()


def test_a_request_signature_covers_the_endpoint_and_the_opaque_state() -> None:
    params = {"request_type": "generation_only", "ctx_info_endpoint": ["http://10.0.0.1:8001"],
              "encoded_opaque_state": "b3BhcXVl", "conversation_id": "c1"}
    expected = _hmac('{"ctx_info_endpoint":"http://10.0.0.1:8001","encoded_opaque_state":"b3BhcXVl"}')
    assert request_signature(KEY, params) == expected
    assert request_signed(KEY, params, expected)
    assert request_signed(KEY, {**params, "conversation_id": "other"}, expected)  # not a signed field
    assert not request_signed(KEY, {**params, "encoded_opaque_state": "dGFtcGVyZWQ="}, expected)
    assert not request_signed(KEY, {**params, "ctx_info_endpoint": "http://10.0.0.2:8001"}, expected)
    assert not request_signed(KEY, params, None)
    assert not request_signed("another-key-of-some-length", params, expected)


def test_only_requests_with_protected_fields_need_a_signature() -> None:
    assert not needs_request_signature(None)
    assert not needs_request_signature({"request_type": "context_only", "disagg_request_id": 7})
    assert needs_request_signature({"encoded_opaque_state": "x"})
    assert needs_request_signature({"ctx_info_endpoint": "http://ctx:1"})


def test_a_control_signature_is_bound_to_its_route_and_body() -> None:
    body = {"lifecycle_protocol_version": 1, "logical_request_id": 17}
    signature = control_signature(KEY, "/_internal/disagg_lifecycle/context_artifact/abort", body)
    assert signature == _hmac('{"body":{"lifecycle_protocol_version":1,"logical_request_id":17},'
                              '"route":"/_internal/disagg_lifecycle/context_artifact/abort"}')
    assert control_signed(KEY, "/_internal/disagg_lifecycle/context_artifact/abort", body, signature)
    assert not control_signed(KEY, "/_internal/disagg_lifecycle/generation_grant/abort", body, signature)
    assert not control_signed(KEY, "/_internal/disagg_lifecycle/context_artifact/abort",
                              {**body, "logical_request_id": 18}, signature)

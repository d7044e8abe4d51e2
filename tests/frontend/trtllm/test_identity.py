"""The lifecycle v1 attempt identity (frontend/trtllm/identity.py): checked as TensorRT-LLM checks it, with its
messages."""

from __future__ import annotations

import uuid
from typing import Any

import pytest

from frontend.trtllm.identity import validate_identity_fields


def uid() -> str:
    return str(uuid.uuid4())


def identity() -> dict[str, Any]:
    return {"logical_request_id": 7, "prefill_artifact_id": uid(), "artifact_version": 0,
            "handoff_attempt_uuid": uid(), "consumer_grant_id": uid(), "transfer_session_id": uid()}


@pytest.mark.parametrize(("change", "message"), [
    ({"prefill_artifact_id": "6F9619FF-8B86-D011-B42D-00C04FC964FF"}, "canonical non-nil UUID"),
    ({"consumer_grant_id": "00000000-0000-0000-0000-000000000000"}, "canonical non-nil UUID"),
    ({"logical_request_id": -1}, "non-negative integer"),
    ({"artifact_version": True}, "non-negative integer"),
    ({"transfer_session_id": None}, "must be provided together; missing: transfer_session_id"),
])
def test_identity_validation_has_tensorrt_llms_messages(change: dict[str, Any], message: str) -> None:
    with pytest.raises(ValueError, match=message):
        validate_identity_fields({**identity(), **change})


def test_identity_uuids_must_be_distinct() -> None:
    same = uid()
    with pytest.raises(ValueError, match="must be distinct"):
        validate_identity_fields({**identity(), "prefill_artifact_id": same, "consumer_grant_id": same})

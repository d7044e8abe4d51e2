"""A worker's body: JSON unless TensorRT-LLM's X-TRTLLM-Msgpack header says msgpack; either way the same dict."""

from __future__ import annotations

import msgspec
import orjson
import pytest

from frontend.errors import InvalidRequestError
from workers.trtllm.body import parse_request_body

BODY = {"model": "m", "messages": [{"role": "user", "content": "hi"}], "disaggregated_params": {"request_type":
        "context_only", "disagg_request_id": 2**62, "schedule_style": 0, "conversation_id": None}}


@pytest.mark.parametrize("headers", [{}, {"x-trtllm-msgpack": "0"}, {"x-trtllm-msgpack": ""}],
                         ids=["no-header", "header-off", "header-empty"])
def test_json_without_the_header(headers: dict[str, str]) -> None:
    assert parse_request_body(orjson.dumps(BODY), headers) == BODY


def test_msgpack_with_the_header_gives_the_same_dict() -> None:
    assert parse_request_body(msgspec.msgpack.encode(BODY), {"x-trtllm-msgpack": "1"}) == BODY


@pytest.mark.parametrize("raw", [b"\xc1", msgspec.msgpack.encode([1, 2]), orjson.dumps(BODY)],
                         ids=["not-msgpack", "not-a-map", "json-under-the-header"])
def test_a_bad_msgpack_body_is_a_400(raw: bytes) -> None:
    with pytest.raises(InvalidRequestError, match="msgpack"):
        parse_request_body(raw, {"x-trtllm-msgpack": "1"})

"""A worker's request body as one dict: msgpack when TensorRT-LLM's orchestrator flags it with ``X-TRTLLM-Msgpack``
(its ``TRTLLM_SERVE_ENABLE_MSGSPEC=1``; the Content-Type still says JSON), JSON otherwise. Nothing after this
knows the encoding.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import msgspec

from frontend.errors import InvalidRequestError
from frontend.http import parse_json_object

MSGPACK_HEADER = "x-trtllm-msgpack"
_decoder: msgspec.msgpack.Decoder[Any] = msgspec.msgpack.Decoder()


def parse_request_body(body: bytes, headers: Mapping[str, str]) -> dict[str, Any]:
    if headers.get(MSGPACK_HEADER, "0") in ("", "0"):
        return parse_json_object(body)
    try:
        parsed = _decoder.decode(body)
    except msgspec.DecodeError as exc:
        raise InvalidRequestError(f"the request body is not valid msgpack (X-TRTLLM-Msgpack is set): {exc}") from exc
    if not isinstance(parsed, dict):
        raise InvalidRequestError("the request body must be a msgpack map")
    return parsed

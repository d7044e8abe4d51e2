"""The b64 prompt cut out of CTX's answer bytes and spliced into GEN's body: the very bytes, never a str."""

from __future__ import annotations

import tracemalloc
from typing import Any

import orjson
import pytest

from orchestrator.b64_splice import cut_b64_span, parse_with_b64_span, splice_b64_span
from orchestrator.protocols.base import PromptCarriage
from orchestrator.protocols.native import NativeProtocol
from orchestrator.upstream.base import body_bytes

B64 = "QUJDRA==" * 25_000  # 200 KB: big enough that a copy or a str of it shows in tracemalloc


def ctx_answer(**top: Any) -> bytes:
    params = {"request_type": "context_only", "ctx_request_id": 1, "first_gen_tokens": [7],
              "encoded_opaque_state": "c3RhdGU=", "prompt_len": 50_000}
    return orjson.dumps({"id": "c", "choices": [{"index": 0, "finish_reason": "length",
                                                 "disaggregated_params": params}], **top})


def test_the_span_is_a_view_of_the_answer_and_the_rest_parses_with_an_empty_value() -> None:
    content = ctx_answer(prompt_token_ids_b64=B64, usage={"prompt_tokens": 3})
    cut = cut_b64_span(content)
    assert cut is not None
    rest, span = cut
    assert span.obj is content and span.tobytes() == B64.encode()
    assert orjson.loads(rest) == {**orjson.loads(content), "prompt_token_ids_b64": ""}


@pytest.mark.parametrize("content", [
    ctx_answer(),  # no b64 at all
    # the key's text inside a string value is escaped, so it is not found as a key
    ctx_answer(note='"prompt_token_ids_b64":"QUJD"'),
    b'{"prompt_token_ids_b64": "QUJD", "id": "c"}',  # another writer's spacing: parsed whole
    b'{"prompt_token_ids_b64":"QU\\u004aD"}',  # an escape is not plain base64: parsed whole
])
def test_answers_without_a_plain_top_level_span_are_parsed_whole(content: bytes) -> None:
    parsed, span = parse_with_b64_span(content)
    assert span is None and parsed == orjson.loads(content)


def test_a_span_nested_below_the_top_level_is_not_taken_for_the_prompt() -> None:
    content = orjson.dumps({"choices": [{"prompt_token_ids_b64": "QUJD"}], "id": "c"})
    parsed, span = parse_with_b64_span(content)
    assert span is None and parsed == orjson.loads(content)


def test_the_gen_body_splices_ctxs_bytes_between_the_quotes() -> None:
    content = ctx_answer(prompt_token_ids_b64=B64)
    protocol = NativeProtocol()
    ctx = protocol.read_context_answer(content)
    client = {"model": "m", "messages": [{"role": "user", "content": "hi"}], "prompt_token_ids_b64": "client's",
              "max_tokens": 5}
    body = protocol.generation_request(client, ctx, PromptCarriage.CTX_TOKENS)
    assert isinstance(body, tuple) and isinstance(body[1], memoryview)
    assert body[1].obj is content  # CTX's very bytes, not a copy
    sent = orjson.loads(body_bytes(body))
    assert sent["prompt_token_ids_b64"] == B64 and "messages" not in sent
    assert sent["disaggregated_params"]["request_type"] == "generation_only"


def test_no_str_or_copy_of_the_span_is_made_between_ctx_and_gen() -> None:
    content = ctx_answer(prompt_token_ids_b64=B64)
    protocol = NativeProtocol()
    client = {"model": "m", "prompt": "hi", "max_tokens": 5}
    protocol.generation_request(client, protocol.read_context_answer(content), PromptCarriage.CTX_TOKENS)  # warm
    tracemalloc.start()
    try:
        ctx = protocol.read_context_answer(content)
        body = protocol.generation_request(client, ctx, PromptCarriage.CTX_TOKENS)
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert len(body_bytes(body)) > len(B64)
    assert peak < len(B64) // 4  # a str or a bytes copy of the 200 KB span would be at least its size


def test_a_body_that_does_not_end_with_the_empty_field_cannot_be_spliced() -> None:
    with pytest.raises(ValueError, match="must end with an empty"):
        splice_b64_span(b'{"prompt_token_ids_b64":"","model":"m"}', memoryview(b"QUJD"))

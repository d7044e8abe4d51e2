"""The native worker protocol, unit by unit: the CTX request, reading CTX's answer, and the GEN request for each
way the prompt can travel (the b64 string relayed as the very bytes CTX sent)."""

from __future__ import annotations

from typing import Any

import orjson
import pytest

from frontend.errors import UpstreamError
from orchestrator.protocols.base import ContextAnswer, PromptCarriage, WorkerProtocol
from orchestrator.protocols.native import NativeProtocol
from orchestrator.upstream.base import Reply, body_bytes

PROTOCOL: WorkerProtocol = NativeProtocol()
B64 = "SGVsbG8sIHdvcmxkIQAAAA=="  # what CTX sent: opaque to the orchestrator
HANDOFF = {"request_type": "context_only", "ctx_request_id": "c1", "first_gen_tokens": [7],
           "encoded_opaque_state": "c3RhdGU=", "prompt_len": 4}


def chat_body(**extra: Any) -> dict[str, Any]:
    return {"model": "m", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 5, **extra}


def ctx_answer(handoff: dict[str, Any] | None = None, *, top_level: bool = False, **extra: Any) -> bytes:
    params = HANDOFF if handoff is None else handoff
    if top_level:  # /v1/responses
        return orjson.dumps({"id": "resp_1", "object": "response", "disaggregated_params": params, **extra})
    return orjson.dumps({"id": "c", "choices": [{"index": 0, "message": {"role": "assistant", "content": "T"},
                                                 "finish_reason": None, "disaggregated_params": params}],
                         **extra})


# -- CTX --------------------------------------------------------------------------------------------------------
def test_the_ctx_request_is_context_only_whole_and_leaves_the_client_body_alone() -> None:
    body = chat_body(stream=True, stream_options={"include_usage": True})
    sent = orjson.loads(body_bytes(PROTOCOL.context_request(body, return_prompt_tokens=True)))
    params = sent.pop("disaggregated_params")
    assert params == {"request_type": "context_only", "disagg_request_id": params["disagg_request_id"],
                      "return_prompt_token_ids_b64": True, "native_extensions": True}
    assert 0 <= params["disagg_request_id"] < 2**63
    assert sent == {**chat_body(), "stream": False}
    assert body == chat_body(stream=True, stream_options={"include_usage": True})
    again = orjson.loads(body_bytes(PROTOCOL.context_request(body, return_prompt_tokens=False)))["disaggregated_params"]
    assert again["return_prompt_token_ids_b64"] is False
    assert again["disagg_request_id"] != params["disagg_request_id"]


@pytest.mark.parametrize("top_level", [False, True], ids=["choices", "responses"])
def test_reading_a_ctx_answer(top_level: bool) -> None:
    ctx = PROTOCOL.read_context_answer(ctx_answer(top_level=top_level, prompt_token_ids_b64=B64))
    assert ctx.handoff == HANDOFF
    assert ctx.finished is False
    assert ctx.prompt_len == 4
    assert isinstance(ctx.prompt_b64, memoryview)  # cut out of CTX's bytes, never made a str
    assert ctx.prompt_b64.tobytes() == B64.encode()


def test_a_ctx_answer_without_a_hand_off_state_is_finished() -> None:
    ctx = PROTOCOL.read_context_answer(ctx_answer({"ctx_request_id": "c1", "first_gen_tokens": [2]}))
    assert ctx.finished is True
    assert ctx.prompt_len is None
    assert ctx.prompt_b64 is None


@pytest.mark.parametrize("content", [b"not json", b"{}", b'{"choices": []}', b'{"choices": [{}]}',
                                     b'{"disaggregated_params": 3}'])
def test_an_unreadable_ctx_answer_is_an_upstream_error(content: bytes) -> None:
    with pytest.raises(UpstreamError, match="the CTX step failed"):
        PROTOCOL.read_context_answer(content)


def test_a_finished_answer_loses_every_hand_off_field() -> None:
    ctx = PROTOCOL.read_context_answer(ctx_answer(prompt_token_ids_b64=B64, prompt_token_ids=None))
    response = PROTOCOL.finished_response(ctx)
    assert set(response) == {"id", "choices"}
    assert "disaggregated_params" not in response["choices"][0]


# -- GEN --------------------------------------------------------------------------------------------------------
def gen_request(body: dict[str, Any], carriage: PromptCarriage) -> tuple[bytes, dict[str, Any], ContextAnswer]:
    ctx = PROTOCOL.read_context_answer(ctx_answer(prompt_token_ids_b64=B64))
    raw = body_bytes(PROTOCOL.generation_request(body, ctx, carriage))
    return raw, orjson.loads(raw), ctx


def test_the_gen_request_relays_ctxs_b64_string_as_it_came_and_drops_the_text() -> None:
    raw, sent, ctx = gen_request(chat_body(), PromptCarriage.CTX_TOKENS)
    assert b'"prompt_token_ids_b64":"' + B64.encode() + b'"' in raw
    assert sent["disaggregated_params"] == {**HANDOFF, "request_type": "generation_only"}
    assert "messages" not in sent
    assert ctx.handoff["request_type"] == "context_only"  # CTX's answer is not changed


def test_length_only_sends_the_length_and_the_text_but_no_token_ids() -> None:
    _, sent, _ = gen_request(chat_body(prompt_token_ids=[1, 2]), PromptCarriage.LENGTH_ONLY)
    assert sent["messages"] == chat_body()["messages"]
    assert "prompt_token_ids" not in sent and "prompt_token_ids_b64" not in sent
    assert sent["disaggregated_params"]["prompt_len"] == 4


def test_nothing_sends_neither_text_nor_token_ids() -> None:
    _, sent, _ = gen_request(chat_body(instructions="be brief"), PromptCarriage.NOTHING)
    assert not {"messages", "prompt", "input", "prompt_token_ids", "prompt_token_ids_b64"} & set(sent)
    assert sent["instructions"] == "be brief"  # to repeat in a Response object, not read as prompt
    assert sent["disaggregated_params"]["prompt_len"] == 4


def test_the_client_prompt_goes_as_it_came_and_the_length_only_with_the_clients_own_ids() -> None:
    _, text, _ = gen_request(chat_body(), PromptCarriage.CLIENT_PROMPT)
    assert text["messages"] == chat_body()["messages"]
    assert "prompt_token_ids_b64" not in text
    assert "prompt_len" not in text["disaggregated_params"]  # GEN tokenizes the text itself
    _, ids, _ = gen_request(chat_body(prompt_token_ids=[1, 2, 3, 4]), PromptCarriage.CLIENT_PROMPT)
    assert ids["prompt_token_ids"] == [1, 2, 3, 4]
    assert ids["disaggregated_params"]["prompt_len"] == 4


# -- follow-ups ---------------------------------------------------------------------------------------------------
@pytest.mark.parametrize(
    ("reply", "lost"),
    [
        (Reply(400, b'{"error": {"code": "invalid_handoff", "message": "gone"}}'), True),
        (Reply(400, b'{"error": {"code": "invalid_request", "message": "bad"}}'), False),
        (Reply(503, b'{"error": {"code": "invalid_handoff", "message": "gone"}}'), False),
        (Reply(400, b"not json"), False),
        (Reply(400, b'{"error": "flat"}'), False),
    ],
)
def test_a_lost_hand_off_is_told_by_its_error_code(reply: Reply, lost: bool) -> None:
    assert PROTOCOL.handoff_lost(reply) is lost


def test_the_release_request_names_the_hand_off() -> None:
    ctx = PROTOCOL.read_context_answer(ctx_answer({**HANDOFF, "ctx_request_id": 12}))
    request = PROTOCOL.release_request(ctx)
    assert request is not None
    path, body = request
    assert path == "/v1/disagg/release"
    assert orjson.loads(body) == {"ctx_request_id": "12", "encoded_opaque_state": "c3RhdGU="}
    finished = PROTOCOL.read_context_answer(ctx_answer({"ctx_request_id": "c1"}))
    assert PROTOCOL.release_request(finished) is None

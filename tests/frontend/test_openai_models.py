from __future__ import annotations

from typing import Any

import pytest

from frontend.errors import InvalidRequestError, UnsupportedParameterError
from frontend.http import validate_wire
from frontend.openai_models import (
    UNSUPPORTED_PARAMETERS,
    ChatCompletionRequest,
    CompletionRequest,
    ResponsesRequest,
    refuse_unsupported_parameters,
)

CHAT: dict[str, Any] = {"model": "m", "messages": [{"role": "user", "content": "hi"}]}
GEN_ONLY = {"disaggregated_params": {"request_type": "generation_only", "prompt_len": 3}}


@pytest.mark.parametrize("name", sorted(UNSUPPORTED_PARAMETERS))
def test_every_unsupported_parameter_is_refused_by_name(name: str) -> None:
    with pytest.raises(UnsupportedParameterError) as caught:
        refuse_unsupported_parameters({**CHAT, name: {"x": 1}})
    assert caught.value.param == name
    assert caught.value.code == "unsupported_parameter"
    assert name in caught.value.message


def test_unsupported_parameters_set_to_null_are_ignored() -> None:
    refuse_unsupported_parameters({**CHAT, "tools": None, "response_format": None})


@pytest.mark.parametrize(
    ("model", "body", "param"),
    [
        (ResponsesRequest, {"model": "m", "input": "a", "n": 3}, "n"),
        (CompletionRequest, {"model": "m", "prompt": "a", "suffix": "z"}, "suffix"),
        (CompletionRequest, {"model": "m", "prompt": "a", "best_of": 2}, "best_of"),
        (CompletionRequest, {"model": "m", "prompt": ["a", "b"]}, "prompt"),
        (CompletionRequest, {"model": "m", "prompt": [[1], [2]]}, "prompt"),
        (ResponsesRequest, {"model": "m", "input": "a", "previous_response_id": "resp_1"}, "previous_response_id"),
    ],
)
def test_recognised_but_unimplemented_values_are_refused(
    model: type[ChatCompletionRequest | CompletionRequest | ResponsesRequest], body: dict[str, Any], param: str
) -> None:
    with pytest.raises(UnsupportedParameterError) as caught:
        validate_wire(model, body)
    assert caught.value.param == param
    assert caught.value.status_code == 400


@pytest.mark.parametrize(
    ("model", "field"),
    [(ChatCompletionRequest, "messages"), (CompletionRequest, "prompt"), (ResponsesRequest, "input")],
)
def test_the_prompt_is_required_except_on_generation_only(
    model: type[ChatCompletionRequest | CompletionRequest | ResponsesRequest], field: str
) -> None:
    with pytest.raises(InvalidRequestError) as caught:
        validate_wire(model, {"model": "m"})
    assert caught.value.param == field
    assert caught.value.status_code == 400
    assert validate_wire(model, {"model": "m", **GEN_ONLY}).is_generation_only


@pytest.mark.parametrize(
    "body",
    [
        {"model": "m", "prompt": "text"},
        {"model": "m", "prompt": [1, 2, 3]},
        {"model": "m", "prompt": ["text"]},
        {"model": "m", "prompt": [[1, 2, 3]]},
    ],
)
def test_completion_prompt_shapes(body: dict[str, Any]) -> None:
    assert validate_wire(CompletionRequest, body).prompt == body["prompt"]


def test_strict_types_on_the_wire() -> None:
    for bad in ({**CHAT, "stream": 1}, {**CHAT, "prompt_token_ids": [1.0]}, {**CHAT, "prompt_token_ids": [True]}):
        with pytest.raises(InvalidRequestError):
            validate_wire(ChatCompletionRequest, bad)


def test_models_are_frozen() -> None:
    wire = validate_wire(ChatCompletionRequest, CHAT)
    with pytest.raises(ValueError, match="frozen"):
        wire.model = "other"


def test_max_tokens_aliases() -> None:
    chat = validate_wire(ChatCompletionRequest, {**CHAT, "max_tokens": 5, "max_completion_tokens": 7})
    assert chat.requested_max_tokens == 7
    assert validate_wire(CompletionRequest, {"model": "m", "prompt": "a"}).requested_max_tokens == 16
    assert validate_wire(ResponsesRequest, {"model": "m", "input": "a",
                                            "max_output_tokens": 9}).requested_max_tokens == 9


def test_responses_input_becomes_chat_messages() -> None:
    wire = validate_wire(ResponsesRequest, {
        "model": "m", "instructions": "Be terse.",
        "input": [{"type": "message", "role": "user", "content": [{"type": "input_text", "text": "a"},
                                                                   {"type": "input_text", "text": "b"}]}],
    })
    messages = wire.chat_messages()
    assert [(m.role, m.text()) for m in messages] == [("system", "Be terse."), ("user", "ab")]

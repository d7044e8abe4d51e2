"""Responses input items: every field the SDK can put in one is modelled (and accepted when null), each item type
this server renders becomes the chat turn it means, and any other item type is a 400 naming ``input.N``."""

from __future__ import annotations

from typing import Any

import pytest
from openai.types.responses import (
    EasyInputMessageParam,
    ResponseFunctionToolCallParam,
    ResponseInputFileParam,
    ResponseInputImageParam,
    ResponseInputTextParam,
    ResponseOutputMessageParam,
    ResponseOutputRefusalParam,
    ResponseOutputTextParam,
)
from openai.types.responses.response_input_item_param import FunctionCallOutput, Message
from pydantic import BaseModel

from frontend.errors import InvalidRequestError, UnsupportedParameterError
from frontend.http import validate_wire
from frontend.openai_models import ResponsesRequest
from frontend.responses_items import (
    FunctionCallItem,
    FunctionCallOutputItem,
    InputFile,
    InputImage,
    InputText,
    MessageItem,
    OutputText,
    Refusal,
)

SDK_SHAPES: list[tuple[type, type[BaseModel]]] = [
    (EasyInputMessageParam, MessageItem), (Message, MessageItem), (ResponseOutputMessageParam, MessageItem),
    (ResponseFunctionToolCallParam, FunctionCallItem), (FunctionCallOutput, FunctionCallOutputItem),
    (ResponseInputTextParam, InputText), (ResponseOutputTextParam, OutputText),
    (ResponseOutputRefusalParam, Refusal), (ResponseInputImageParam, InputImage), (ResponseInputFileParam, InputFile),
]


@pytest.mark.parametrize(("sdk", "ours"), SDK_SHAPES, ids=[s.__name__ for s, _ in SDK_SHAPES])
def test_every_field_the_sdk_can_put_in_an_item_is_modelled(sdk: type, ours: type[BaseModel]) -> None:
    ours_on_the_wire = {field.alias or name for name, field in ours.model_fields.items()}
    assert set(sdk.__annotations__) - ours_on_the_wire == set()


def request(*items: Any) -> ResponsesRequest:
    return validate_wire(ResponsesRequest, {"model": "m", "input": list(items)})


def test_the_servers_own_output_items_with_every_optional_field_null_are_accepted() -> None:
    output: dict[str, Any] = {
        "id": "msg_1", "type": "message", "status": "completed", "role": "assistant", "phase": None,
        "content": [{"type": "output_text", "text": "Hi.", "annotations": [], "logprobs": None}],
    }
    call = {"type": "function_call", "call_id": "c1", "name": "f", "arguments": "{}", "id": None, "status": None,
            "namespace": None, "caller": None, "async": None}
    answer = {"type": "function_call_output", "call_id": "c1", "output": "12 C", "id": None, "status": None,
              "name": None, "namespace": None, "caller": None}
    wire = request({"role": "user", "content": "hello", "type": None}, output, call, answer)
    assert [m.role for m in wire.chat_messages()] == ["user", "assistant", "tool"]


def test_items_become_the_chat_turns_they_mean() -> None:
    wire = validate_wire(ResponsesRequest, {"model": "m", "instructions": "Be brief.", "input": [
        {"type": "message", "role": "developer", "content": [{"type": "input_text", "text": "rules"}]},
        {"role": "user", "content": [{"type": "input_text", "text": "a"}, {"type": "input_text", "text": "b"}]},
        {"role": "assistant", "content": [{"type": "output_text", "text": "Let me look.", "annotations": []}]},
        {"type": "function_call", "call_id": "c1", "name": "weather", "arguments": '{"city": "Oslo"}'},
        {"type": "function_call", "call_id": "c2", "name": "time", "arguments": "{}"},
        {"type": "function_call_output", "call_id": "c1", "output": [{"type": "input_text", "text": "12 C"}]},
        {"role": "assistant", "content": [{"type": "refusal", "refusal": "No."}]},
    ]})
    messages = wire.chat_messages()
    assert [(m.role, m.text()) for m in messages] == [
        ("system", "Be brief."), ("developer", "rules"), ("user", "ab"), ("assistant", "Let me look."),
        ("tool", "12 C"), ("assistant", "No."),
    ]
    # The calls join the assistant turn before them, as one chat assistant message carries text and calls.
    assert [(c.name, c.arguments) for c in messages[3].calls()] == [("weather", '{"city": "Oslo"}'), ("time", "{}")]
    assert messages[4].tool_call_id == "c1"


def test_a_call_with_no_assistant_turn_before_it_is_an_assistant_turn_of_its_own() -> None:
    wire = request({"role": "user", "content": "x"},
                   {"type": "function_call", "call_id": "c1", "name": "f", "arguments": "{}"})
    assert [(m.role, m.content, len(m.calls())) for m in wire.chat_messages()] == [("user", "x", 0),
                                                                                   ("assistant", None, 1)]


def test_media_parts_stay_media_so_a_text_only_model_can_refuse_them() -> None:
    wire = request({"role": "user", "content": [{"type": "input_image", "image_url": "http://x/i.png",
                                                 "detail": "auto"}]})
    assert wire.chat_messages()[0].has_media


@pytest.mark.parametrize("kind", ["reasoning", "item_reference", "web_search_call", "mcp_call"])
def test_an_item_type_this_server_does_not_render_is_refused_naming_it(kind: str) -> None:
    with pytest.raises(UnsupportedParameterError) as caught:
        request({"role": "user", "content": "x"}, {"type": kind, "id": "x"})
    assert caught.value.param == "input.1"
    assert kind in caught.value.message


@pytest.mark.parametrize(("item", "param"), [
    ({"role": "user", "content": 5}, "input.0.content"),
    ({"role": "user", "content": "x", "bogus": 1}, "input.0.bogus"),
    ({"role": "tool", "content": "x"}, "input.0.role"),
    ({"type": "function_call", "name": "f", "arguments": "{}"}, "input.0.call_id"),
])
def test_a_bad_item_is_a_400_naming_its_field(item: dict[str, Any], param: str) -> None:
    with pytest.raises(InvalidRequestError) as caught:
        request(item)
    assert caught.value.param == param

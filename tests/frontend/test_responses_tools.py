"""The Responses API's ``tools`` and ``tool_choice`` on the wire: function tools read, built-in tools and other
tool choices refused by name."""

from __future__ import annotations

from typing import Any

import pytest

from frontend.errors import ServingError, UnsupportedParameterError
from frontend.http import validate_wire
from frontend.openai_models import ChatTool, NamedToolChoice, ResponsesRequest

WEATHER = {"type": "function", "name": "weather", "description": "Now.", "parameters": {"type": "object"},
           "strict": True}


def request(**fields: Any) -> ResponsesRequest:
    return validate_wire(ResponsesRequest, {"model": "m", "input": "hi", **fields})


def test_a_function_tool_is_chats_tool_and_is_echoed_as_sent() -> None:
    wire = request(tools=[WEATHER], tool_choice={"type": "function", "name": "weather"}, parallel_tool_calls=False)
    (tool,) = wire.chat_tools()
    assert tool == ChatTool.model_validate({"type": "function", "function": {
        "name": "weather", "description": "Now.", "parameters": {"type": "object"}, "strict": True}})
    assert wire.chat_tool_choice() == NamedToolChoice.model_validate({"type": "function",
                                                                      "function": {"name": "weather"}})
    assert wire.tools is not None and wire.tools[0].echoed() == WEATHER
    assert request(tool_choice="required").chat_tool_choice() == "required"
    # Fields the SDK can send for OpenAI's own runtime, unset.
    assert request(tools=[{**WEATHER, "defer_loading": False, "output_schema": None, "async": None}]).tools


@pytest.mark.parametrize(("tools", "param", "kind"), [
    ([{"type": "web_search"}], "tools.0.type", "web_search"),
    ([WEATHER, {"type": "file_search", "vector_store_ids": ["vs"]}], "tools.1.type", "file_search"),
    ([{"type": "code_interpreter", "container": {"type": "auto"}}], "tools.0.type", "code_interpreter"),
    ([{"type": "mcp", "server_label": "x"}], "tools.0.type", "mcp"),
])
def test_a_built_in_tool_is_refused_by_its_type(tools: list[Any], param: str, kind: str) -> None:
    with pytest.raises(UnsupportedParameterError) as caught:
        request(tools=tools)
    assert caught.value.param == param and repr(kind) in str(caught.value)


@pytest.mark.parametrize(("choice", "param"), [
    ({"type": "web_search_preview"}, "tool_choice"),
    ({"type": "allowed_tools", "mode": "auto", "tools": []}, "tool_choice"),
    ({"type": "custom", "name": "x"}, "tool_choice"),
    ("sometimes", "tool_choice"),
    ({"type": "function"}, "tool_choice.function.name"),
])
def test_another_tool_choice_is_refused_naming_it(choice: Any, param: str) -> None:
    with pytest.raises(ServingError) as caught:
        request(tools=[WEATHER], tool_choice=choice)
    assert caught.value.status_code == 400 and caught.value.param is not None
    assert caught.value.param.startswith("tool_choice")


def test_chats_nested_tool_shape_is_refused_saying_the_fields_are_flat() -> None:
    with pytest.raises(ServingError) as caught:
        request(tools=[{"type": "function", "function": {"name": "f"}}])
    assert caught.value.param == "tools.0.name" and "flat" in str(caught.value)


@pytest.mark.parametrize(("fields", "param"), [
    ({"tools": [{"type": "function"}]}, "tools.0.name"),
    ({"tools": [{"type": "function", "name": ""}]}, "tools.0.name"),
    ({"tools": [{**WEATHER, "defer_loading": True}]}, "tools.0.defer_loading"),
    ({"tools": [{"type": "function", "function": {"name": "f"}}]}, "tools.0.name"),
    ({"parallel_tool_calls": "yes"}, "parallel_tool_calls"),
])
def test_a_malformed_tools_field_is_a_400_naming_it(fields: dict[str, Any], param: str) -> None:
    with pytest.raises(ServingError) as caught:
        request(**fields)
    assert caught.value.status_code == 400 and caught.value.param == param

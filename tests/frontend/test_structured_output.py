"""A request's structured output reduced to one JSON schema: response_format, text.format and forced tool calls,
and the 400s that name the field at fault."""

from __future__ import annotations

from typing import Any

import orjson
import pytest

from frontend.errors import InvalidRequestError
from frontend.openai_models import ChatCompletionRequest, ResponsesRequest
from frontend.structured_output import OutputConstraint, output_constraint, tools_in_prompt

USER = [{"role": "user", "content": "hi"}]
SCHEMA = {"type": "object", "properties": {"b": {"type": "integer"}, "a": {"type": "string"}}}
TOOLS = [{"type": "function", "function": {"name": "f", "parameters": SCHEMA}},
         {"type": "function", "function": {"name": "g"}}]


def chat(**fields: Any) -> OutputConstraint | None:
    return output_constraint(ChatCompletionRequest.model_validate({"model": "m", "messages": USER, **fields}))


def test_free_text_has_no_constraint() -> None:
    assert chat() is None
    assert chat(response_format={"type": "text"}) is None
    assert chat(tools=TOOLS) is None and chat(tools=TOOLS, tool_choice="none") is None


def test_json_object_and_json_schema_keep_the_clients_key_order() -> None:
    assert chat(response_format={"type": "json_object"}) == OutputConstraint('{"type":"object"}', False,
                                                                             "response_format")
    constraint = chat(response_format={"type": "json_schema", "json_schema": {"name": "s", "schema": SCHEMA}})
    assert constraint is not None and list(orjson.loads(constraint.json_schema)["properties"]) == ["b", "a"]


def test_responses_text_format_is_response_format_flattened() -> None:
    wire = ResponsesRequest.model_validate({"model": "m", "input": "hi", "text": {"format": {
        "type": "json_schema", "name": "s", "schema": SCHEMA, "strict": True}}})
    constraint = output_constraint(wire)
    assert constraint is not None and orjson.loads(constraint.json_schema) == SCHEMA
    assert constraint.param == "text.format"


def test_a_forced_call_is_name_and_arguments() -> None:
    named = chat(tools=TOOLS, tool_choice={"type": "function", "function": {"name": "f"}})
    assert named is not None and named.tool_call
    schema = orjson.loads(named.json_schema)
    assert schema["properties"] == {"name": {"const": "f"}, "arguments": SCHEMA}
    required = chat(tools=TOOLS, tool_choice="required")
    assert required is not None
    options = orjson.loads(required.json_schema)["anyOf"]
    assert [o["properties"]["name"]["const"] for o in options] == ["f", "g"]
    assert options[1]["properties"]["arguments"]["additionalProperties"] is False  # no parameters: no arguments


@pytest.mark.parametrize(("fields", "param"), [
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "s", "schema": {"type": 3}}}},
     "response_format"),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "s"}}}, "response_format"),
    ({"tool_choice": "required"}, "tool_choice"),
    ({"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "h"}}}, "tool_choice"),
    ({"tools": [{"type": "function", "function": {"name": "f", "parameters": {"$ref": "#/x"}}}],
      "tool_choice": "required"}, "tools.0.function.parameters"),
])
def test_a_request_that_cannot_be_served_is_a_400_naming_the_field(fields: dict[str, Any], param: str) -> None:
    with pytest.raises(InvalidRequestError) as caught:
        chat(**fields)
    assert caught.value.param == param


def test_the_prompt_describes_the_tools_unless_none() -> None:
    wire = ChatCompletionRequest.model_validate({"model": "m", "messages": USER, "tools": TOOLS})
    assert [t.function.name for t in tools_in_prompt(wire)] == ["f", "g"]
    none = ChatCompletionRequest.model_validate({"model": "m", "messages": USER, "tools": TOOLS,
                                                 "tool_choice": "none"})
    assert tools_in_prompt(none) == []


# -- the Responses API's function tools: chat's, their fields flat ------------------------------------------------
RESPONSES_TOOLS = [{"type": "function", "name": "f", "parameters": SCHEMA}, {"type": "function", "name": "g"}]


def responses(**fields: Any) -> ResponsesRequest:
    return ResponsesRequest.model_validate({"model": "m", "input": "hi", **fields})


def test_a_responses_forced_call_is_chats() -> None:
    for choice, chat_choice in (("required", "required"), ({"type": "function", "name": "g"},
                                                           {"type": "function", "function": {"name": "g"}})):
        constraint = output_constraint(responses(tools=RESPONSES_TOOLS, tool_choice=choice))
        assert constraint is not None and constraint.tool_call
        assert constraint == chat(tools=TOOLS, tool_choice=chat_choice)
    assert output_constraint(responses(tools=RESPONSES_TOOLS)) is None
    assert output_constraint(responses(tools=RESPONSES_TOOLS, tool_choice="auto")) is None


def test_the_responses_prompt_describes_the_tools_unless_none() -> None:
    assert tools_in_prompt(responses(tools=RESPONSES_TOOLS)) == tools_in_prompt(
        ChatCompletionRequest.model_validate({"model": "m", "messages": USER, "tools": TOOLS}))
    assert tools_in_prompt(responses(tools=RESPONSES_TOOLS, tool_choice="none")) == []
    assert tools_in_prompt(responses()) == []


@pytest.mark.parametrize(("fields", "param"), [
    ({"tool_choice": "required"}, "tool_choice"),
    ({"tools": RESPONSES_TOOLS, "tool_choice": {"type": "function", "name": "h"}}, "tool_choice"),
    ({"tools": [{"type": "function", "name": "f", "parameters": {"$ref": "#/x"}}], "tool_choice": "required"},
     "tools.0.parameters"),
    ({"tools": RESPONSES_TOOLS, "tool_choice": "required", "text": {"format": {"type": "json_object"}}},
     "text.format"),
])
def test_a_responses_request_that_cannot_be_served_is_a_400_naming_the_field(fields: dict[str, Any],
                                                                             param: str) -> None:
    with pytest.raises(InvalidRequestError) as caught:
        output_constraint(responses(**fields))
    assert caught.value.param == param

"""Structured output: a request's ``response_format``, ``text.format`` or forced tool call (chat's or the Responses
API's), reduced to the one JSON schema an engine enforces token by token.

Schemas are compiled here, at the worker's edge, with the engine core's options (``json_grammar``), so a schema the
engine cannot compile is a 400 naming the field. The schema travels as compact JSON text in the client's key order:
that order is the output's, and the text keys the engine's grammar cache. See docs/engines.md, "Structured output"."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import llguidance
import orjson

from frontend.errors import InvalidRequestError
from frontend.openai_models import (
    ChatCompletionRequest,
    ChatTool,
    GenerationWireRequest,
    ResponseFormat,
    ResponsesRequest,
    ToolChoice,
)

# Compact separators and no free whitespace: a small model offered free whitespace may spend its whole budget on
# it. ", " and ": " are what json.dumps writes, so the output reads like the JSON models saw in training.
JSON_OPTIONS: dict[str, Any] = {
    "whitespace_flexible": False,
    "item_separator": ", ",
    "key_separator": ": ",
}
_ANY_OBJECT: dict[str, Any] = {"type": "object"}
_NO_ARGUMENTS: dict[str, Any] = {"type": "object", "properties": {}, "additionalProperties": False}


@dataclass(frozen=True, slots=True)
class OutputConstraint:
    json_schema: str  # compact JSON text, keys in the client's order
    tool_call: bool  # the answer is a tool call, rendered as ``message.tool_calls``
    param: str  # the request field that asked for it, for error messages


def json_grammar(schema_text: str) -> str:
    """The llguidance grammar for a JSON schema, with this server's JSON formatting options."""
    # Overrides, not defaults: a client's "x-guidance" options must not turn free whitespace back on.
    return llguidance.LLMatcher.grammar_from_json_schema(schema_text, overrides=JSON_OPTIONS)  # type: ignore[arg-type]


def check_json_schema(schema: dict[str, Any], param: str) -> str:
    """The schema as compact JSON text; a schema the grammar compiler refuses is a 400 naming ``param``."""
    text = orjson.dumps(schema).decode()
    try:
        error = llguidance.LLMatcher.validate_grammar(json_grammar(text))
    except ValueError as exc:
        error = str(exc)
    if error:
        raise InvalidRequestError(f"invalid JSON schema in '{param}': {error.splitlines()[0]}", param=param)
    return text


def output_constraint(wire: GenerationWireRequest) -> OutputConstraint | None:
    """The constraint a validated request asks for, or None for free text."""
    if isinstance(wire, ChatCompletionRequest):
        forced = _forced_tools(wire.tools or [], wire.tool_choice)
        if forced is not None:
            if wire.response_format is not None and wire.response_format.type != "text":
                raise InvalidRequestError("a forced tool call and a JSON response_format cannot be combined",
                                          param="response_format")
            return _tool_call_constraint(wire.tools or [], forced, "tools.{}.function.parameters")
        return _format_constraint(wire.response_format, "response_format")
    if isinstance(wire, ResponsesRequest):
        text_format = wire.text.format.as_response_format() if wire.text and wire.text.format else None
        tools = wire.chat_tools()  # the Responses API's function tools are chat's, their fields flat
        forced = _forced_tools(tools, wire.chat_tool_choice())
        if forced is not None:
            if text_format is not None and text_format.type != "text":
                raise InvalidRequestError("a forced tool call and a JSON text.format cannot be combined",
                                          param="text.format")
            return _tool_call_constraint(tools, forced, "tools.{}.parameters")
        return _format_constraint(text_format, "text.format")
    return None


def tools_in_prompt(wire: GenerationWireRequest) -> list[ChatTool]:
    """The tools the prompt describes: all of them unless the client chose ``none``."""
    if isinstance(wire, ResponsesRequest) and wire.tool_choice != "none":
        return wire.chat_tools()
    if not isinstance(wire, ChatCompletionRequest) or not wire.tools or wire.tool_choice == "none":
        return []
    return list(wire.tools)


def _format_constraint(response_format: ResponseFormat | None, param: str) -> OutputConstraint | None:
    if response_format is None or response_format.type == "text":
        return None
    if response_format.type == "json_object":
        return OutputConstraint(orjson.dumps(_ANY_OBJECT).decode(), tool_call=False, param=param)
    spec = response_format.json_schema
    if spec is None or spec.json_schema is None:
        raise InvalidRequestError(f"'{param}' of type json_schema needs a schema", param=param)
    return OutputConstraint(check_json_schema(spec.json_schema, param), tool_call=False, param=param)


def _forced_tools(tools: list[ChatTool], choice: ToolChoice | None) -> list[int] | None:
    """Indexes of the tools one of which must be called, or None when no call is forced."""
    if choice is None or (isinstance(choice, str) and choice in ("none", "auto")):
        return None
    if not tools:
        raise InvalidRequestError("tool_choice forces a tool call, but no tools were given", param="tool_choice")
    if choice == "required":
        return list(range(len(tools)))
    assert not isinstance(choice, str)
    named = [i for i, tool in enumerate(tools) if tool.function.name == choice.function.name]
    if not named:
        raise InvalidRequestError(f"tool_choice names the function '{choice.function.name}', which is not in tools",
                                  param="tool_choice")
    return named[:1]


def call_schema(tool: ChatTool) -> dict[str, Any]:
    """The JSON schema of a call of ``tool``: ``{"name": <its name>, "arguments": <valid against its parameters>}``,
    in that order."""
    function = tool.function
    parameters = function.parameters if function.parameters is not None else _NO_ARGUMENTS
    return {
        "type": "object",
        "properties": {"name": {"const": function.name}, "arguments": parameters},
        "required": ["name", "arguments"],
        "additionalProperties": False,
    }


def _tool_call_constraint(tools: list[ChatTool], forced: list[int], parameters_param: str) -> OutputConstraint:
    """``parameters_param``: where a tool's parameters are on the wire, ``{}`` its index."""
    options = []
    for index in forced:
        check_json_schema(call_schema(tools[index])["properties"]["arguments"], parameters_param.format(index))
        options.append(call_schema(tools[index]))
    schema = options[0] if len(options) == 1 else {"anyOf": options}
    return OutputConstraint(check_json_schema(schema, "tools"), tool_call=True, param="tool_choice")

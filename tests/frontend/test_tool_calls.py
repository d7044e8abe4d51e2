"""Tools into the prompt, how a request's answer is read for calls, and the calls read as OpenAI's ``tool_calls``."""

from __future__ import annotations

from typing import Any

import orjson
import pytest

from frontend.errors import InvalidRequestError
from frontend.openai_models import ChatCompletionRequest, ChatTool, ResponsesRequest
from frontend.structured_output import output_constraint
from frontend.tool_calls import (
    FORCED,
    as_tool_call_message,
    openai_tool_calls,
    tool_calling_for,
    with_tools_prompt,
)
from frontend.tool_parsers import FORMATS, forced, hermes
from frontend.tool_parsers.base import ParsedCall, parse_whole

TOOL = ChatTool.model_validate({"type": "function", "function": {
    "name": "f", "description": "does f", "parameters": {"type": "object", "properties": {"x": {"type": "integer"}}}}})
HERMES = FORMATS["hermes"]


def test_tools_join_an_existing_system_message_or_come_first() -> None:
    user = {"role": "user", "content": "hi"}
    added = with_tools_prompt([user], [TOOL])
    assert added[0]["role"] == "system" and added[1] == user
    described = orjson.loads(added[0]["content"].splitlines()[-1])
    assert described == {"name": "f", "description": "does f", "parameters": TOOL.function.parameters}
    joined = with_tools_prompt([{"role": "system", "content": "Be brief."}, user], [TOOL])
    assert joined[0]["content"].startswith("Be brief.\n\n") and len(joined) == 2
    assert with_tools_prompt([user], []) == [user]


def test_the_prompt_asks_for_a_call_the_way_the_answer_is_read() -> None:
    user = {"role": "user", "content": "hi"}
    assert with_tools_prompt([user], [TOOL])[0]["content"].startswith(forced.INSTRUCTIONS)
    in_tags = with_tools_prompt([user], [TOOL], HERMES.instructions)[0]["content"]
    assert in_tags.startswith(hermes.INSTRUCTIONS) and "<tool_call>" in in_tags


def chat(**body: Any) -> ChatCompletionRequest:
    return ChatCompletionRequest.model_validate({"model": "m", "messages": [{"role": "user", "content": "hi"}],
                                                 "tools": [TOOL.model_dump()], **body})


@pytest.mark.parametrize(("body", "parallel"), [({}, True), ({"tool_choice": "auto"}, True),
                                               ({"parallel_tool_calls": False}, False)])
def test_auto_reads_the_answer_in_the_models_format(body: dict[str, Any], parallel: bool) -> None:
    wire = chat(**body)
    calling = tool_calling_for(wire, output_constraint(wire), HERMES)
    assert calling is not None and calling.format is HERMES and calling.parallel is parallel
    assert calling.instructions == hermes.INSTRUCTIONS
    # Its reader takes calls to the offered tools only: a "call" to another name is the answer's text.
    assert calling.names == frozenset({"f"})
    assert parse_whole(calling.parser(), '<tool_call>{"name": "g", "arguments": {}}</tool_call>') is None


def test_a_forced_call_is_read_as_one_bare_call_whatever_the_format() -> None:
    wire = chat(tool_choice="required")
    assert tool_calling_for(wire, output_constraint(wire), HERMES) is FORCED
    assert FORCED.forced and FORCED.instructions == forced.INSTRUCTIONS


@pytest.mark.parametrize("body", [{"tool_choice": "none"}, {"tools": None},
                                  {"response_format": {"type": "json_object"}}])
def test_no_tools_none_or_a_json_format_is_text(body: dict[str, Any]) -> None:
    wire = chat(**body)
    assert tool_calling_for(wire, output_constraint(wire), HERMES) is None


def test_auto_without_a_parser_is_a_400_naming_the_flag_and_unset_is_text() -> None:
    with pytest.raises(InvalidRequestError) as caught:
        tool_calling_for(chat(tool_choice="auto"), None, None)
    assert caught.value.param == "tool_choice" and "--tool-call-parser" in caught.value.message
    responses = ResponsesRequest.model_validate({"model": "m", "input": "hi", "tool_choice": "auto", "tools": [
        {"type": "function", "name": "f"}]})
    with pytest.raises(InvalidRequestError):
        tool_calling_for(responses, None, None)
    assert tool_calling_for(chat(), None, None) is None


def test_calls_read_become_openais_tool_calls_after_the_text() -> None:
    calls = openai_tool_calls([ParsedCall("f", '{"x": 3}'), ParsedCall("g", "{}")], "call_1")
    assert calls == [{"id": "call_1", "type": "function", "function": {"name": "f", "arguments": '{"x": 3}'}},
                     {"id": "call_1-1", "type": "function", "function": {"name": "g", "arguments": "{}"}}]
    body = {"choices": [{"index": 0, "message": {"role": "assistant", "content": "..."}, "finish_reason": "stop"}]}
    as_tool_call_message(body, calls, "Let me see.")
    assert body["choices"][0] == {"index": 0, "finish_reason": "tool_calls",
                                  "message": {"role": "assistant", "content": "Let me see.", "tool_calls": calls}}

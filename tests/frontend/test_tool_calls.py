"""Tools into the prompt, and a generated call into OpenAI's ``tool_calls``."""

from __future__ import annotations

import orjson

from frontend.openai_models import ChatTool
from frontend.tool_calls import as_tool_call_message, tool_calls_from_text, with_tools_prompt

TOOL = ChatTool.model_validate({"type": "function", "function": {
    "name": "f", "description": "does f", "parameters": {"type": "object", "properties": {"x": {"type": "integer"}}}}})


def test_tools_join_an_existing_system_message_or_come_first() -> None:
    user = {"role": "user", "content": "hi"}
    added = with_tools_prompt([user], [TOOL])
    assert added[0]["role"] == "system" and added[1] == user
    described = orjson.loads(added[0]["content"].splitlines()[-1])
    assert described == {"name": "f", "description": "does f", "parameters": TOOL.function.parameters}
    joined = with_tools_prompt([{"role": "system", "content": "Be brief."}, user], [TOOL])
    assert joined[0]["content"].startswith("Be brief.\n\n") and len(joined) == 2
    assert with_tools_prompt([user], []) == [user]


def test_a_generated_call_becomes_openais_tool_calls() -> None:
    calls = tool_calls_from_text('{"name": "f", "arguments": {"x": 3}}', "call_1")
    assert calls == [{"id": "call_1", "type": "function", "function": {"name": "f", "arguments": '{"x":3}'}}]
    body = {"choices": [{"index": 0, "message": {"role": "assistant", "content": "..."}, "finish_reason": "stop"}]}
    as_tool_call_message(body, calls)
    assert body["choices"][0] == {"index": 0, "finish_reason": "tool_calls",
                                  "message": {"role": "assistant", "content": None, "tool_calls": calls}}


def test_text_that_is_not_a_whole_call_is_none() -> None:
    for text in ('{"name": "f", "argu', '[1]', '{"name": 1, "arguments": {}}', '{"name": "f", "arguments": 2}'):
        assert tool_calls_from_text(text, "call_1") is None

"""Tool calls: how tools reach the prompt, and how a generated call becomes OpenAI's ``message.tool_calls``.

SmolLM2's chat template has no notion of tools, so the tools are described in the system prompt, in the same
``{"name", "arguments"}`` shape the model is then asked (and, when a call is forced, constrained) to answer in;
earlier calls in the history are rendered that way too (``workers.request_builder.template_message``).
"""

from __future__ import annotations

from typing import Any

import orjson

from frontend.openai_models import ChatTool

# Short on purpose: every character is prompt, and small models have small contexts.
_INSTRUCTIONS = 'To call a function, answer only {"name": <function name>, "arguments": <its arguments>}. Functions:'


def tools_system_text(tools: list[ChatTool]) -> str:
    lines = [_INSTRUCTIONS]
    for tool in tools:
        function = tool.function
        described: dict[str, Any] = {"name": function.name}
        if function.description:
            described["description"] = function.description
        described["parameters"] = function.parameters or {"type": "object", "properties": {}}
        lines.append(orjson.dumps(described).decode())
    return "\n".join(lines)


def with_tools_prompt(messages: list[dict[str, str]], tools: list[ChatTool]) -> list[dict[str, str]]:
    """The template's messages with the tools described in the system message (added first when there is none)."""
    if not tools:
        return messages
    text = tools_system_text(tools)
    if messages and messages[0]["role"] == "system":
        first = dict(messages[0])
        first["content"] = f"{first['content']}\n\n{text}" if first["content"] else text
        return [first, *messages[1:]]
    return [{"role": "system", "content": text}, *messages]


def tool_calls_from_text(text: str, call_id: str) -> list[dict[str, Any]] | None:
    """OpenAI's ``tool_calls`` for a generated ``{"name", "arguments"}`` object; None when the text is not one
    (an answer cut short by ``max_tokens``)."""
    try:
        call = orjson.loads(text)
    except orjson.JSONDecodeError:
        return None
    if not isinstance(call, dict) or not isinstance(call.get("name"), str) or not isinstance(call.get("arguments"),
                                                                                             dict):
        return None
    arguments = orjson.dumps(call["arguments"]).decode()
    return [{"id": call_id, "type": "function", "function": {"name": call["name"], "arguments": arguments}}]


def as_tool_call_message(body: dict[str, Any], calls: list[dict[str, Any]], index: int = 0) -> None:
    """Turn the text of a whole chat answer's choice ``index`` into its tool calls, as OpenAI answers a call."""
    choice = body["choices"][index]
    choice["message"] = {"role": "assistant", "content": None, "tool_calls": calls}
    choice["finish_reason"] = "tool_calls"

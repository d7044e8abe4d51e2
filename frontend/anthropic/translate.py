"""A Messages request as the chat request the flow runs, and a whole chat answer as Anthropic's message object.

The translation is the whole of Anthropic's API here: the orchestrator's flow and the workers serve the chat
request it makes (so placement, routing, the KV hand-off, retries and metadata-only apply unchanged), and the
answer is written back at the same edge. Tools ride on the project's structured output: ``any`` and ``tool``
force a call held to the tool's ``input_schema``; ``auto`` describes the tools and lets the model answer freely,
its calls read out of its text by the worker's tool-call parser (``frontend.tool_parsers``) as chat's ``auto``
(``disable_parallel_tool_use``: chat's ``parallel_tool_calls: false``); ``output_config.format`` is
``response_format``. ``metadata.user_id`` becomes the chat
request's ``conversation_params``: the session key cache-aware routing keys on (orchestrator/conversation.py).
A chat answer says "stop" for a turn's end and a stop string alike, and leaves the string out of its text; with
``stop_sequences`` the chat request asks for logprobs, whose entries hold every generated token's bytes, the stop
string's too: what follows the text there says which stop sequence ended it (``matched_stop``)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, TypeVar

import orjson

from frontend.anthropic.models import (
    CountTokensRequest,
    MessagesRequest,
    TextBlock,
    ToolChoiceAny,
    ToolChoiceAuto,
    ToolChoiceNone,
    ToolChoiceTool,
    ToolResultBlock,
    ToolUseBlock,
    refuse_unservable,
)
from frontend.errors import InvalidRequestError, UnsupportedParameterError
from frontend.http import validate_wire

RequestT = TypeVar("RequestT", MessagesRequest, CountTokensRequest)
DEFAULT_TEMPERATURE = 1.0  # Anthropic's, where a request sets none
MESSAGE_ID_PREFIX = "msg_"
TOOL_USE_ID_PREFIX = "toolu_"
_CHAT_PREFIXES = ("chatcmpl-", "call_")
# The chat answer's finish reason, as Anthropic's stop reason.
STOP_REASONS = {"stop": "end_turn", "length": "max_tokens", "tool_calls": "tool_use", "abort": "end_turn"}


@dataclass(frozen=True, slots=True)
class Translated:
    """A Messages request as the chat request that serves it, and what its answer needs from it."""

    chat: dict[str, Any]
    streaming: bool
    stop_sequences: tuple[str, ...] = ()


def messages_request(body: dict[str, Any]) -> Translated:
    """A ``/v1/messages`` body, checked and translated; ``InvalidRequestError`` naming the field."""
    refuse_unservable(body)
    request = _validated(MessagesRequest, body)
    chat = _chat_prompt(request)
    chat["max_tokens"] = request.max_tokens
    chat["temperature"] = request.temperature if request.temperature is not None else DEFAULT_TEMPERATURE
    if request.top_p is not None:
        chat["top_p"] = request.top_p
    if request.top_k is not None:
        chat["top_k"] = request.top_k
    stops = tuple(request.stop_sequences or ())
    if stops:
        chat["stop"] = list(stops)
        chat["logprobs"] = True  # every token's bytes: which stop sequence ended the answer (``matched_stop``)
    if request.stream:
        chat["stream"] = True
        # Usage on every chunk: the first's (the prompt's) for message_start, the last's for message_delta.
        chat["stream_options"] = {"include_usage": True, "continuous_usage_stats": True}
    if request.metadata is not None and request.metadata.user_id and request.metadata.user_id.strip():
        chat["conversation_params"] = {"conversation_id": request.metadata.user_id}
    return Translated(chat, bool(request.stream), stops)


def count_tokens_request(body: dict[str, Any]) -> dict[str, Any]:
    """A ``/v1/messages/count_tokens`` body as the chat request whose prompt it counts."""
    refuse_unservable(body)
    return _chat_prompt(_validated(CountTokensRequest, body))


def _validated(model: type[RequestT], body: dict[str, Any]) -> RequestT:
    """``body`` as ``model``; an unknown field refused in Anthropic's words."""
    try:
        return validate_wire(model, body)
    except InvalidRequestError as exc:
        if exc.param is not None and exc.message.startswith("unrecognized request argument"):
            raise InvalidRequestError(f"{exc.param}: Extra inputs are not permitted", param=exc.param) from exc
        raise


def _chat_prompt(request: CountTokensRequest) -> dict[str, Any]:
    """What makes the prompt: the model, the messages (system first), the tools and the output's format."""
    chat: dict[str, Any] = {"model": request.model, "messages": _chat_messages(request)}
    if request.tools:
        chat["tools"] = [{"type": "function", "function": {
            "name": tool.name,
            **({"description": tool.description} if tool.description else {}),
            "parameters": tool.input_schema,
        }} for tool in request.tools]
    choice = request.tool_choice
    if isinstance(choice, ToolChoiceAny):
        chat["tool_choice"] = "required"
    elif isinstance(choice, ToolChoiceTool):
        chat["tool_choice"] = {"type": "function", "function": {"name": choice.name}}
    elif isinstance(choice, ToolChoiceNone) and request.tools:
        chat["tool_choice"] = "none"
    elif isinstance(choice, ToolChoiceAuto) and request.tools:
        chat["tool_choice"] = "auto"
        if choice.disable_parallel_tool_use:
            chat["parallel_tool_calls"] = False
    output = request.output_config
    if output is not None and output.format is not None:
        if isinstance(choice, ToolChoiceAny | ToolChoiceTool):
            raise InvalidRequestError("a forced tool call and output_config.format cannot be combined",
                                      param="output_config.format")
        chat["response_format"] = {"type": "json_schema",
                                   "json_schema": {"name": "output", "schema": output.format.schema_, "strict": True}}
    return chat


def _chat_messages(request: CountTokensRequest) -> list[dict[str, Any]]:
    messages: list[dict[str, Any]] = []
    system = request.system
    if system:
        text = system if isinstance(system, str) else "\n\n".join(block.text for block in system)
        messages.append({"role": "system", "content": text})
    last = request.messages[-1]
    if last.role == "assistant":
        # Prefill: Anthropic continues the final assistant turn; a chat template closes it and opens another.
        raise UnsupportedParameterError("a final assistant turn (prefill) is not supported: the chat templates "
                                        "here close an assistant turn; end with a user turn",
                                        param=f"messages.{len(request.messages) - 1}.role")
    for message in request.messages:
        content = message.content
        if isinstance(content, str):
            messages.append({"role": message.role, "content": content})
        elif message.role == "assistant":
            messages.append(_assistant_turn(content))
        else:
            messages.extend(_user_turns(content))
    return messages


def _assistant_turn(blocks: list[TextBlock | ToolUseBlock | ToolResultBlock]) -> dict[str, Any]:
    text = "".join(block.text for block in blocks if isinstance(block, TextBlock))
    calls = [{"id": block.id, "type": "function",
              "function": {"name": block.name, "arguments": orjson.dumps(block.input).decode()}}
             for block in blocks if isinstance(block, ToolUseBlock)]
    turn: dict[str, Any] = {"role": "assistant", "content": text if text or not calls else None}
    if calls:
        turn["tool_calls"] = calls
    return turn


def _user_turns(blocks: list[TextBlock | ToolUseBlock | ToolResultBlock]) -> list[dict[str, Any]]:
    """A user turn: its tool results as tool messages (in order), then its text as one user message."""
    turns: list[dict[str, Any]] = []
    texts: list[str] = []
    for index, block in enumerate(blocks):
        if isinstance(block, ToolResultBlock):
            result = block.text()
            turns.append({"role": "tool", "tool_call_id": block.tool_use_id,
                          "content": f"Error: {result}" if block.is_error else result})
        elif isinstance(block, TextBlock):
            texts.append(block.text)
        else:
            raise InvalidRequestError("a user turn cannot hold a tool_use block: tool calls are the assistant's",
                                      param=f"content.{index}.type")
    if texts or not turns:
        turns.append({"role": "user", "content": "".join(texts)})
    return turns


# -- the answer --------------------------------------------------------------------------------------------------
def message_id(chat_id: str) -> str:
    """The message's id for the chat answer's (the same request id: logs and traces read alike)."""
    return MESSAGE_ID_PREFIX + _unprefixed(chat_id)


def tool_use_id(call_id: str) -> str:
    return TOOL_USE_ID_PREFIX + _unprefixed(call_id)


def _unprefixed(chat_id: str) -> str:
    for prefix in _CHAT_PREFIXES:
        if chat_id.startswith(prefix):
            return chat_id[len(prefix):]
    return chat_id


def tool_use_block(call: dict[str, Any]) -> dict[str, Any]:
    function = call["function"]
    arguments = orjson.loads(function["arguments"]) if function.get("arguments") else {}
    return {"type": "tool_use", "id": tool_use_id(str(call["id"])), "name": function["name"], "input": arguments}


def stop_reason(finish_reason: str | None, stop_sequence: str | None = None) -> str:
    """Anthropic's ``stop_reason`` for a chat finish reason and the stop sequence that ended the answer, if one did."""
    if finish_reason == "stop" and stop_sequence is not None:
        return "stop_sequence"
    return STOP_REASONS.get(finish_reason or "stop", "end_turn")


def matched_stop(text: str, generated: bytes, stop_sequences: tuple[str, ...]) -> str | None:
    """The stop sequence that ended an answer whose text is ``text`` and whose tokens were ``generated`` (their
    bytes, from the logprobs): the one the generated bytes hold right where the text ends; None for none (the
    model ended its turn)."""
    if not stop_sequences:
        return None
    said = text.encode()
    if generated.startswith(said):
        rest = generated[len(said):]
    else:  # a token that is part of a character: compare as text
        rest = generated.decode("utf-8", "replace")[len(text):].encode()
    for stop in sorted(stop_sequences, key=len):  # the shortest is found first as the tokens come
        if rest.startswith(stop.encode()):
            return stop
    return None


def token_bytes(logprobs: dict[str, Any] | None) -> bytes:
    """The generated tokens' bytes, from a chat choice's (or delta's) ``logprobs``."""
    if not logprobs:
        return b""
    return b"".join(bytes(entry.get("bytes") or entry.get("token", "").encode())
                    for entry in logprobs.get("content") or ())


def usage(chat_usage: dict[str, Any] | None) -> dict[str, Any]:
    """Anthropic's usage: ``input_tokens`` are those not read from the prefix cache, as Anthropic counts them
    (the prompt is ``input_tokens + cache_read_input_tokens``)."""
    chat_usage = chat_usage or {}
    prompt = int(chat_usage.get("prompt_tokens") or 0)
    cached = int((chat_usage.get("prompt_tokens_details") or {}).get("cached_tokens") or 0)
    return {"input_tokens": prompt - cached, "output_tokens": int(chat_usage.get("completion_tokens") or 0),
            "cache_creation_input_tokens": 0, "cache_read_input_tokens": cached}


def message_from_chat(chat: dict[str, Any], stop_sequences: tuple[str, ...] = ()) -> dict[str, Any]:
    """A whole chat answer (one choice) as Anthropic's message object; ``stop_sequences``: the request's."""
    choice = chat["choices"][0]
    reply = choice.get("message") or {}
    content: list[dict[str, Any]] = []
    text = reply.get("content") or ""
    if text:
        content.append({"type": "text", "text": text})
    content += [tool_use_block(call) for call in reply.get("tool_calls") or ()]
    finish = choice.get("finish_reason")
    stop = matched_stop(text, token_bytes(choice.get("logprobs")), stop_sequences) if finish == "stop" else None
    return {"id": message_id(str(chat["id"])), "type": "message", "role": "assistant", "model": chat["model"],
            "content": content, "stop_reason": stop_reason(finish, stop), "stop_sequence": stop,
            "usage": usage(chat.get("usage"))}

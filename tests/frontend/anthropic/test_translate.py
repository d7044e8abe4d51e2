"""A Messages request as the chat request that serves it, and a chat answer as Anthropic's message."""

from __future__ import annotations

from typing import Any

import pytest
from anthropic.types import Message

from frontend.anthropic.translate import (
    count_tokens_request,
    matched_stop,
    message_from_chat,
    messages_request,
    usage,
)
from frontend.errors import InvalidRequestError

TOOL: dict[str, Any] = {"name": "get_weather", "description": "The weather.",
                        "input_schema": {"type": "object", "properties": {"city": {"type": "string"}}}}


def request(**fields: Any) -> dict[str, Any]:
    return {"model": "m", "max_tokens": 5, "messages": [{"role": "user", "content": "hi"}], **fields}


def test_a_plain_request_takes_anthropics_defaults() -> None:
    translated = messages_request(request())
    assert translated.chat == {"model": "m", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 5,
                               "temperature": 1.0}
    assert not translated.streaming


def test_sampling_stops_stream_and_session_carry_over() -> None:
    translated = messages_request(request(temperature=0.2, top_p=0.9, top_k=5, stop_sequences=["\n\n"], stream=True,
                                          metadata={"user_id": "u-1"}))
    chat = translated.chat
    assert (chat["temperature"], chat["top_p"], chat["top_k"], chat["stop"]) == (0.2, 0.9, 5, ["\n\n"])
    assert chat["logprobs"] is True  # the tokens' bytes say which stop sequence ended the answer
    assert translated.stop_sequences == ("\n\n",)
    assert chat["stream"] is True and chat["stream_options"] == {"include_usage": True, "continuous_usage_stats": True}
    assert chat["conversation_params"] == {"conversation_id": "u-1"}  # the session key of cache-aware routing
    assert translated.streaming


def test_system_blocks_and_turns_become_chat_messages() -> None:
    chat = messages_request(request(
        system=[{"type": "text", "text": "A"}, {"type": "text", "text": "B", "cache_control": {"type": "ephemeral"}}],
        messages=[
            {"role": "user", "content": [{"type": "text", "text": "x"}, {"type": "text", "text": "y"}]},
            {"role": "assistant", "content": [{"type": "text", "text": "Let me look."},
                                              {"type": "tool_use", "id": "toolu_1", "name": "get_weather",
                                               "input": {"city": "Rome"}}]},
            {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "toolu_1", "content": "sunny"},
                                         {"type": "tool_result", "tool_use_id": "toolu_2", "is_error": True,
                                          "content": [{"type": "text", "text": "down"}]},
                                         {"type": "text", "text": "so?"}]},
        ], tools=[TOOL])).chat
    assert chat["messages"] == [
        {"role": "system", "content": "A\n\nB"},
        {"role": "user", "content": "xy"},
        {"role": "assistant", "content": "Let me look.", "tool_calls": [
            {"id": "toolu_1", "type": "function",
             "function": {"name": "get_weather", "arguments": '{"city":"Rome"}'}}]},
        {"role": "tool", "tool_call_id": "toolu_1", "content": "sunny"},
        {"role": "tool", "tool_call_id": "toolu_2", "content": "Error: down"},
        {"role": "user", "content": "so?"},
    ]
    assert chat["tools"] == [{"type": "function", "function": {
        "name": "get_weather", "description": "The weather.",
        "parameters": {"type": "object", "properties": {"city": {"type": "string"}}}}}]
    assert "tool_choice" not in chat  # auto


@pytest.mark.parametrize(("choice", "chat_choice"), [
    ({"type": "auto"}, "auto"), ({"type": "any"}, "required"), ({"type": "none"}, "none"),
    ({"type": "tool", "name": "get_weather", "disable_parallel_tool_use": True},
     {"type": "function", "function": {"name": "get_weather"}}),
])
def test_tool_choice(choice: dict[str, Any], chat_choice: Any) -> None:
    assert messages_request(request(tools=[TOOL], tool_choice=choice)).chat.get("tool_choice") == chat_choice


@pytest.mark.parametrize(("choice", "parallel"), [
    ({"type": "auto"}, None), ({"type": "auto", "disable_parallel_tool_use": False}, None),
    ({"type": "auto", "disable_parallel_tool_use": True}, False),
])
def test_disable_parallel_tool_use_is_chats_parallel_tool_calls_false(choice: dict[str, Any],
                                                                      parallel: bool | None) -> None:
    assert messages_request(request(tools=[TOOL], tool_choice=choice)).chat.get("parallel_tool_calls") is parallel


def test_output_config_format_is_a_json_schema_response_format() -> None:
    schema = {"type": "object", "properties": {"ok": {"type": "boolean"}}}
    chat = messages_request(request(output_config={"format": {"type": "json_schema", "schema": schema},
                                                   "effort": "high"})).chat
    assert chat["response_format"] == {"type": "json_schema",
                                       "json_schema": {"name": "output", "schema": schema, "strict": True}}


@pytest.mark.parametrize(("fields", "param"), [
    ({"max_tokens": None}, "max_tokens"),
    ({"max_tokens": 0}, "max_tokens"),
    ({"temperature": 1.5}, "temperature"),
    ({"n": 2}, "n"),
    ({"messages": [{"role": "user", "content": [{"type": "image", "source": {}}]}]}, "messages.0.content.0.type"),
    ({"messages": [{"role": "user", "content": [{"type": "tool_result", "tool_use_id": "t", "content": [
        {"type": "image", "source": {}}]}]}]}, "messages.0.content.0.content.0.type"),
    ({"messages": [{"role": "user", "content": [{"type": "document", "source": {}}]}]}, "messages.0.content.0.type"),
    ({"system": [{"type": "image", "source": {}}]}, "system.0.type"),
    ({"thinking": {"type": "enabled", "budget_tokens": 2048}}, "thinking"),
    ({"thinking": {"type": "adaptive"}}, "thinking"),
    ({"tools": [{"type": "web_search_20250305", "name": "web_search"}]}, "tools.0.type"),
    ({"tools": [TOOL], "tool_choice": {"type": "tool", "name": "other"}}, "tool_choice.name"),
    ({"tool_choice": {"type": "any"}}, "tool_choice"),
    ({"container": "c"}, "container"),
    ({"messages": [{"role": "user", "content": "x"}, {"role": "assistant", "content": "The answer is ("}]},
     "messages.1.role"),
    ({"speed": "fast"}, "speed"),
    ({"tools": [TOOL], "tool_choice": {"type": "any"},
      "output_config": {"format": {"type": "json_schema", "schema": {"type": "object"}}}}, "output_config.format"),
])
def test_what_cannot_be_served_is_a_400_naming_the_field(fields: dict[str, Any], param: str) -> None:
    body = {key: value for key, value in request(**fields).items() if value is not None}
    with pytest.raises(InvalidRequestError) as refused:
        messages_request(body)
    assert refused.value.param == param


def test_accepted_and_ignored_fields() -> None:
    chat = messages_request(request(thinking={"type": "disabled"}, cache_control={"type": "ephemeral"},
                                    service_tier="auto", output_config={"effort": "low"})).chat
    assert set(chat) == {"model", "messages", "max_tokens", "temperature"}


def test_count_tokens_needs_no_max_tokens() -> None:
    chat = count_tokens_request({"model": "m", "messages": [{"role": "user", "content": "hi"}], "system": "s"})
    assert chat == {"model": "m", "messages": [{"role": "system", "content": "s"}, {"role": "user", "content": "hi"}]}


def chat_answer(**message: Any) -> dict[str, Any]:
    return {"id": "chatcmpl-abc", "object": "chat.completion", "created": 1, "model": "m",
            "choices": [{"index": 0, "message": {"role": "assistant", **message}, "logprobs": None,
                         "finish_reason": message.pop("finish_reason", "stop")}],
            "usage": {"prompt_tokens": 10, "completion_tokens": 3, "total_tokens": 13,
                      "prompt_tokens_details": {"cached_tokens": 4}}}


@pytest.mark.parametrize(("finish", "reason"), [("stop", "end_turn"), ("length", "max_tokens")])
def test_a_text_answer(finish: str, reason: str) -> None:
    message = message_from_chat(chat_answer(content="Hello", finish_reason=finish))
    assert message == {"id": "msg_abc", "type": "message", "role": "assistant", "model": "m",
                       "content": [{"type": "text", "text": "Hello"}], "stop_reason": reason, "stop_sequence": None,
                       "usage": {"input_tokens": 6, "output_tokens": 3, "cache_creation_input_tokens": 0,
                                 "cache_read_input_tokens": 4}}
    Message.model_validate(message)


def test_a_tool_call_answer() -> None:
    call = {"id": "call_abc", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "X"}'}}
    message = message_from_chat(chat_answer(content=None, tool_calls=[call], finish_reason="tool_calls"))
    assert message["content"] == [{"type": "tool_use", "id": "toolu_abc", "name": "get_weather",
                                   "input": {"city": "X"}}]
    assert message["stop_reason"] == "tool_use"
    Message.model_validate(message)


def test_usage_without_cache() -> None:
    assert usage({"prompt_tokens": 7, "completion_tokens": 1}) == {
        "input_tokens": 7, "output_tokens": 1, "cache_creation_input_tokens": 0, "cache_read_input_tokens": 0}


def logprobs(*tokens: bytes) -> dict[str, Any]:
    return {"content": [{"token": t.decode("utf-8", "replace"), "logprob": 0.0, "bytes": list(t), "top_logprobs": []}
                        for t in tokens], "refusal": None}


def test_the_stop_sequence_is_read_from_the_tokens_bytes() -> None:
    answer = chat_answer(content="It is")
    answer["choices"][0]["logprobs"] = logprobs(b"It", b" is", b" END", b"ING")
    message = message_from_chat(answer, ("\n", " END"))
    assert (message["stop_reason"], message["stop_sequence"]) == ("stop_sequence", " END")
    Message.model_validate(message)
    answer["choices"][0]["logprobs"] = logprobs(b"It", b" is", b"</s>")  # the model ended its turn
    assert message_from_chat(answer, (" END",))["stop_reason"] == "end_turn"


@pytest.mark.parametrize(("text", "generated", "stops", "matched"), [
    ("ab", b"abXYZ", ("XY", "Q"), "XY"),
    ("ab", b"abXYZ", ("XYZ", "X"), "X"),  # the shortest is the one the tokens reached first
    ("ab", b"ab", ("X",), None),
    ("\u00e9", "\u00e9!".encode(), ("!",), "!"),
    ("", b"STOP", ("STOP",), "STOP"),
    ("a\ufffd", b"a\xe9!", ("!",), "!"),  # a byte that is no character: compared as text
])
def test_matched_stop(text: str, generated: bytes, stops: tuple[str, ...], matched: str | None) -> None:
    assert matched_stop(text, generated, stops) == matched

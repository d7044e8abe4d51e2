"""Item 1: every field the official SDK can send is accepted when null or empty; a value we cannot honour is a 400
naming the parameter; an unknown field is still a 400; multi-turn chat with the SDK's own message dumps works."""

from __future__ import annotations

from typing import Any

import openai
import pytest
from openai.types import completion_create_params
from openai.types.chat import ChatCompletionMessageParam
from openai.types.chat import completion_create_params as chat_create_params
from openai.types.responses import response_create_params

from tests.workers.engines.reference.cluster import RefCluster

USER: list[ChatCompletionMessageParam] = [{"role": "user", "content": "Hello there"}]
# Fields each create() needs (given by the test itself) or that change the call's shape.
_GIVEN = {"model", "messages", "prompt", "input", "stream"}
CHAT_FIELDS = sorted(set(chat_create_params.CompletionCreateParamsBase.__annotations__) - _GIVEN)
COMPLETION_FIELDS = sorted(set(completion_create_params.CompletionCreateParamsBase.__annotations__) - _GIVEN)
RESPONSES_FIELDS = sorted(set(response_create_params.ResponseCreateParamsBase.__annotations__) - _GIVEN)


@pytest.mark.parametrize("field", CHAT_FIELDS)
def test_chat_accepts_every_sdk_field_as_null(conformance_cluster: RefCluster, field: str) -> None:
    extra: dict[str, Any] = {field: None} if field != "max_tokens" else {}
    with conformance_cluster.orchestrator.client() as client:
        reply = client.chat.completions.create(model="tiny", messages=USER, max_tokens=2, **extra)
    assert reply.choices[0].message.role == "assistant"


@pytest.mark.parametrize("field", COMPLETION_FIELDS)
def test_completions_accept_every_sdk_field_as_null(conformance_cluster: RefCluster, field: str) -> None:
    extra: dict[str, Any] = {field: None} if field != "max_tokens" else {}
    with conformance_cluster.orchestrator.client() as client:
        reply = client.completions.create(model="tiny", prompt="Hello", max_tokens=2, **extra)
    assert reply.choices[0].finish_reason in ("stop", "length")


@pytest.mark.parametrize("field", RESPONSES_FIELDS)
def test_responses_accept_every_sdk_field_as_null(conformance_cluster: RefCluster, field: str) -> None:
    extra: dict[str, Any] = {field: None} if field != "max_output_tokens" else {}
    with conformance_cluster.orchestrator.client() as client:
        reply = client.responses.create(model="tiny", input="Hello", max_output_tokens=2, **extra)
    assert reply.status in ("completed", "incomplete")


NEUTRAL_CHAT_VALUES: list[tuple[str, Any]] = [
    ("tools", []), ("tool_choice", "none"), ("tool_choice", "auto"), ("parallel_tool_calls", False),
    ("response_format", {"type": "text"}), ("modalities", ["text"]), ("store", False), ("metadata", {"k": "v"}),
    ("service_tier", "auto"), ("functions", []), ("prompt_cache_key", "session-1"), ("n", 1),
    ("stream_options", None), ("logprobs", False), ("seed", -1), ("user", "u-1"), ("safety_identifier", "s-1"),
]


@pytest.mark.parametrize(("field", "value"), NEUTRAL_CHAT_VALUES)
def test_chat_accepts_neutral_values(conformance_cluster: RefCluster, field: str, value: Any) -> None:
    with conformance_cluster.orchestrator.client() as client:
        reply = client.chat.completions.create(model="tiny", messages=USER, max_tokens=2,
                                               **{field: value})
    assert reply.object == "chat.completion"


REFUSED_CHAT_VALUES: list[tuple[str, Any]] = [
    ("tool_choice", "required"),  # a call forced with no tools to call (structured output: item 5)
    ("audio", {"voice": "alloy", "format": "wav"}), ("modalities", ["text", "audio"]),
    ("reasoning_effort", "high"), ("store", True), ("prediction", {"type": "content", "content": "x"}),
    ("web_search_options", {}), ("service_tier", "flex"), ("verbosity", "low"),
    ("functions", [{"name": "f", "parameters": {}}]), ("function_call", {"name": "f"}),
    ("moderation", {"model": "m"}), ("prompt_cache_retention", "24h"), ("prompt_cache_options", {"ttl": 1}),
]


@pytest.mark.parametrize(("field", "value"), REFUSED_CHAT_VALUES)
@pytest.mark.parametrize("stream", [False, True])
def test_chat_refuses_values_it_cannot_honour_by_name(
    conformance_cluster: RefCluster, field: str, value: Any, stream: bool
) -> None:
    with conformance_cluster.orchestrator.client() as client, pytest.raises(openai.BadRequestError) as caught:
        client.chat.completions.create(model="tiny", messages=USER, max_tokens=2, stream=stream,
                                       **{field: value})
    assert caught.value.status_code == 400
    assert caught.value.param == field


REFUSED_RESPONSES_VALUES: list[tuple[str, Any]] = [
    ("tool_choice", "required"),  # a call forced with no tools to call (built-in tools: test_responses_tools.py)
    ("background", True), ("truncation", "auto"), ("top_logprobs", 3),
    ("include", ["message.output_text.logprobs"]), ("reasoning", {"effort": "high"}),
    ("conversation", "conv_1"), ("prompt", {"id": "pmpt_1"}), ("max_tool_calls", 2), ("image", {"x": 1}),
    ("context_management", [{"type": "compaction"}]), ("background_options", {"x": 1}),
    ("access_programs", ["p"]), ("n", 2),
]
REFUSED_COMPLETIONS_VALUES: list[tuple[str, Any]] = [
    ("suffix", "z"), ("best_of", 2), ("no_repeat_ngram_size", 3), ("service_tier", "flex"),
    ("response_format", {"type": "json_object"}),  # structured output is on chat and the Responses API only
]


def _sdk_kwargs(field: str, value: Any, typed_fields: list[str]) -> dict[str, Any]:
    """``field`` as the SDK takes it: a keyword where the SDK types it, else through ``extra_body``."""
    return {field: value} if field in typed_fields else {"extra_body": {field: value}}


@pytest.mark.parametrize(("field", "value"), REFUSED_RESPONSES_VALUES)
def test_responses_refuse_values_they_cannot_honour_by_name(
    conformance_cluster: RefCluster, field: str, value: Any
) -> None:
    with conformance_cluster.orchestrator.client() as client, pytest.raises(openai.BadRequestError) as caught:
        client.responses.create(model="tiny", input="Hello", max_output_tokens=2,
                                **_sdk_kwargs(field, value, RESPONSES_FIELDS))
    assert caught.value.param == field


@pytest.mark.parametrize(("field", "value"), REFUSED_COMPLETIONS_VALUES)
def test_completions_refuse_values_they_cannot_honour_by_name(
    conformance_cluster: RefCluster, field: str, value: Any
) -> None:
    with conformance_cluster.orchestrator.client() as client, pytest.raises(openai.BadRequestError) as caught:
        client.completions.create(model="tiny", prompt="Hello", max_tokens=2,
                                  **_sdk_kwargs(field, value, COMPLETION_FIELDS))
    assert caught.value.param == field


def test_an_unknown_field_is_still_refused(conformance_cluster: RefCluster) -> None:
    with conformance_cluster.orchestrator.client() as client, pytest.raises(openai.BadRequestError) as caught:
        client.chat.completions.create(model="tiny", messages=USER, max_tokens=2, extra_body={"temprature": 1})
    assert "unrecognized request argument supplied: temprature" in caught.value.message


def test_multi_turn_with_the_sdks_own_message_dump(conformance_cluster: RefCluster) -> None:
    messages: list[Any] = [{"role": "system", "content": "Be brief.", "name": "rules"}, *USER]
    with conformance_cluster.orchestrator.client() as client:
        for turn in ("And then?", "Thanks"):
            reply = client.chat.completions.create(model="tiny", messages=messages, max_tokens=3, temperature=0)
            dumped = reply.choices[0].message.model_dump()
            assert dumped["refusal"] is None and dumped["tool_calls"] is None  # sent back as they came
            messages += [dumped, {"role": "user", "content": turn, "name": "ann"}]
        reply = client.chat.completions.create(model="tiny", messages=messages, max_tokens=3, temperature=0)
    assert reply.choices[0].message.content is not None


def test_tool_call_history_is_accepted_whole_and_streamed(conformance_cluster: RefCluster) -> None:
    call = {"id": "call_1", "type": "function", "function": {"name": "weather", "arguments": '{"city": "Oslo"}'}}
    messages: list[Any] = [
        *USER,
        {"role": "assistant", "content": None, "tool_calls": [call], "refusal": None, "audio": None,
         "function_call": None, "reasoning_content": None, "annotations": []},
        {"role": "tool", "tool_call_id": "call_1", "content": "12 C, cloudy"},
        {"role": "assistant", "content": "It is 12 C.", "tool_calls": []},
        {"role": "user", "content": "Thanks"},
    ]
    with conformance_cluster.orchestrator.client() as client:
        whole = client.chat.completions.create(model="tiny", messages=messages, max_tokens=3, temperature=0)
        chunks = list(client.chat.completions.create(model="tiny", messages=messages, max_tokens=3, temperature=0,
                                                     stream=True))
    streamed = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert streamed == whole.choices[0].message.content


def test_a_message_with_audio_is_refused_naming_it(conformance_cluster: RefCluster) -> None:
    messages: list[Any] = [*USER, {"role": "assistant", "content": "x", "audio": {"id": "audio_1"}}, *USER]
    with conformance_cluster.orchestrator.client() as client, pytest.raises(openai.BadRequestError) as caught:
        client.chat.completions.create(model="tiny", messages=messages, max_tokens=2)
    assert caught.value.param == "messages.1.audio"


def test_responses_input_items_this_server_cannot_render_are_refused(conformance_cluster: RefCluster) -> None:
    # Reasoning (and tool kinds other than function calls) are refused naming the item, never dropped.
    items: list[Any] = [{"role": "user", "content": "Hello"},
                        {"type": "reasoning", "id": "rs_1", "summary": [], "encrypted_content": None}]
    with conformance_cluster.orchestrator.client() as client, pytest.raises(openai.BadRequestError) as caught:
        client.responses.create(model="tiny", input=items, max_output_tokens=2)
    assert caught.value.param == "input.1"

"""Anthropic's Messages API through the orchestrator (CTX then GEN) on the tiny reference model, driven by the
official ``anthropic`` SDK: text, system, multi-turn, stop sequences, a tool-use round trip, streams assembled by
the SDK's own helpers, count_tokens and errors; each disaggregated answer equals the aggregated worker's token for
token, and every object and event we emit parses strictly with the SDK's own types (no field it does not know);
on workers with KV block reuse a repeated prompt is reported as read from the prefix cache."""

from __future__ import annotations

import contextlib
from typing import Any

import anthropic
import httpx
import jsonschema
import orjson
import pydantic
import pytest
from anthropic.types import ErrorResponse, Message, MessageTokensCount, RawMessageStreamEvent

from tests.conformance.sdk_strict import assert_strict, named_events
from tests.workers.engines.reference.cluster import RefCluster, RefNode, start_orchestrator
from workers.engines.reference.prefix_cache import BLOCK_TOKENS

GREEDY: dict[str, Any] = {"temperature": 0}  # the SDK sends no temperature; older clients do: as extra_body
USER: Any = [{"role": "user", "content": "What is the weather in Paris?"}]
WEATHER_TOOL: Any = {
    "name": "get_weather",
    "description": "The weather in a city.",
    "input_schema": {"type": "object",
                     "properties": {"city": {"enum": ["Paris", "Rome"]}, "unit": {"enum": ["C", "F"]}},
                     "required": ["city", "unit"], "additionalProperties": False},
}
EVENTS = pydantic.TypeAdapter(RawMessageStreamEvent)


def sdk(node: RefNode) -> anthropic.Anthropic:
    return anthropic.Anthropic(base_url=node.url, api_key="test", max_retries=0, timeout=120)


def nodes(cluster: RefCluster) -> tuple[RefNode, RefNode]:
    return cluster.orchestrator, cluster.aggregated


def raw_message(node: RefNode, **body: Any) -> Message:
    reply = httpx.post(node.url + "/v1/messages", json=body, timeout=120)
    assert reply.status_code == 200, reply.text
    message = Message.model_validate(reply.json())
    assert_strict(message)
    return message


def raw_events(node: RefNode, **body: Any) -> list[dict[str, Any]]:
    """The stream's events, each checked against the SDK's event types, its ``event:`` name its ``type``."""
    events = []
    with httpx.stream("POST", node.url + "/v1/messages", json={**body, "stream": True}, timeout=120) as reply:
        assert reply.status_code == 200
        assert reply.headers["content-type"].startswith("text/event-stream")
        for payload in named_events(reply):
            if payload["type"] == "ping":  # the SDK skips pings: it has no type for them
                assert payload == {"type": "ping"}
            else:
                event = (ErrorResponse.model_validate(payload) if payload["type"] == "error"
                         else EVENTS.validate_python(payload))
                assert isinstance(event, pydantic.BaseModel)
                assert_strict(event)
            events.append(payload)
    return events


def test_text_answer_equals_the_aggregated_workers(conformance_cluster: RefCluster) -> None:
    answers = [sdk(node).messages.create(model="tiny", max_tokens=12, messages=USER, extra_body=GREEDY)
               for node in nodes(conformance_cluster)]
    first, second = answers
    assert first.type == "message" and first.role == "assistant" and first.model == "tiny"
    assert first.id.startswith("msg_")
    assert first.content == second.content
    assert first.stop_reason == second.stop_reason == "max_tokens"
    assert first.usage.output_tokens == second.usage.output_tokens == 12
    prompt = first.usage.input_tokens + (first.usage.cache_read_input_tokens or 0)
    assert prompt == second.usage.input_tokens + (second.usage.cache_read_input_tokens or 0)
    assert_strict(first)


def test_system_and_multi_turn(conformance_cluster: RefCluster) -> None:
    body: dict[str, Any] = {
        "model": "tiny", "max_tokens": 8, **GREEDY,
        "system": [{"type": "text", "text": "Answer briefly.", "cache_control": {"type": "ephemeral"}}],
        "messages": [*USER, {"role": "assistant", "content": [{"type": "text", "text": "Sunny."}]},
                     {"role": "user", "content": [{"type": "text", "text": "And "},
                                                  {"type": "text", "text": "Rome?"}]}],
        "metadata": {"user_id": "conversation-7"},
    }
    first, second = (raw_message(node, **body) for node in nodes(conformance_cluster))
    assert first.content == second.content
    # The same conversation as a chat request: the translation is the whole of the API.
    chat = conformance_cluster.aggregated.client().chat.completions.create(
        model="tiny", max_tokens=8, temperature=0,
        messages=[{"role": "system", "content": "Answer briefly."}, {"role": "user", "content": USER[0]["content"]},
                  {"role": "assistant", "content": "Sunny."}, {"role": "user", "content": "And Rome?"}])
    assert "".join(block.text for block in first.content if block.type == "text") == chat.choices[0].message.content


def test_stop_sequences_end_the_answer_as_the_aggregated_workers(conformance_cluster: RefCluster) -> None:
    unstopped = sdk(conformance_cluster.aggregated).messages.create(model="tiny", max_tokens=16, messages=USER,
                                                                      extra_body=GREEDY)
    text = "".join(block.text for block in unstopped.content if block.type == "text")
    stop = text[4:6]  # a stop sequence the greedy answer reaches
    stops = ["never said", stop]
    answers = [sdk(node).messages.create(model="tiny", max_tokens=16, messages=USER, stop_sequences=stops,
                                         extra_body=GREEDY) for node in nodes(conformance_cluster)]
    assert answers[0].content == answers[1].content
    stopped = "".join(block.text for block in answers[0].content if block.type == "text")
    assert text.startswith(stopped) and stop not in stopped
    for answer in answers:
        assert (answer.stop_reason, answer.stop_sequence) == ("stop_sequence", stop)
        assert_strict(answer)
    for node in nodes(conformance_cluster):
        with sdk(node).messages.stream(model="tiny", max_tokens=16, messages=USER, stop_sequences=stops,
                                       extra_body=GREEDY) as stream:
            final = stream.get_final_message()
        assert (final.stop_reason, final.stop_sequence) == ("stop_sequence", stop)
        assert "".join(block.text for block in final.content if block.type == "text") == stopped
    unreached = sdk(conformance_cluster.orchestrator).messages.create(
        model="tiny", max_tokens=16, messages=USER, stop_sequences=["never said"], extra_body=GREEDY)
    assert (unreached.stop_reason, unreached.stop_sequence) == ("max_tokens", None)


def test_tool_use_round_trip(conformance_cluster: RefCluster) -> None:
    calls = [sdk(node).messages.create(model="tiny", max_tokens=96, messages=USER, tools=[WEATHER_TOOL],
                                       tool_choice={"type": "tool", "name": "get_weather"}, extra_body=GREEDY)
             for node in nodes(conformance_cluster)]
    call = calls[0]
    assert call.stop_reason == "tool_use"
    (block,) = call.content
    assert block.type == "tool_use" and block.name == "get_weather" and block.id.startswith("toolu_")
    jsonschema.validate(block.input, WEATHER_TOOL["input_schema"])
    assert [b.model_dump(exclude={"id"}) for b in calls[1].content] == [block.model_dump(exclude={"id"})]
    history: list[Any] = [*USER, {"role": "assistant", "content": [block.model_dump(exclude_none=True)]},
                          {"role": "user", "content": [{"type": "tool_result", "tool_use_id": block.id,
                                                        "content": [{"type": "text", "text": "18 C, sunny"}]},
                                                       {"type": "text", "text": "Thanks."}]}]
    answers = [sdk(node).messages.create(model="tiny", max_tokens=8, messages=history, tools=[WEATHER_TOOL],
                                         extra_body=GREEDY) for node in nodes(conformance_cluster)]
    assert answers[0].content == answers[1].content
    assert answers[0].stop_reason == "max_tokens"
    assert all(b.type == "text" for b in answers[0].content)  # 'auto' lets the model answer freely


@pytest.mark.parametrize("tool_choice", [{"type": "any"}, {"type": "tool", "name": "get_weather"}])
def test_a_streamed_tool_use_assembles_in_the_sdk(conformance_cluster: RefCluster, tool_choice: Any) -> None:
    with sdk(conformance_cluster.orchestrator).messages.stream(
            model="tiny", max_tokens=96, messages=USER, tools=[WEATHER_TOOL], tool_choice=tool_choice,
            extra_body=GREEDY) as stream:
        final = stream.get_final_message()
    assert final.stop_reason == "tool_use"
    (block,) = final.content
    assert block.type == "tool_use"
    jsonschema.validate(block.input, WEATHER_TOOL["input_schema"])


def test_streamed_text_assembles_to_the_whole_answer(conformance_cluster: RefCluster) -> None:
    whole = sdk(conformance_cluster.aggregated).messages.create(model="tiny", max_tokens=12, messages=USER,
                                                                 extra_body=GREEDY)
    for node in nodes(conformance_cluster):
        with sdk(node).messages.stream(model="tiny", max_tokens=12, messages=USER, extra_body=GREEDY) as stream:
            text = "".join(stream.text_stream)
            final = stream.get_final_message()
        assert [b.model_dump(include={"type", "text"}) for b in final.content] == \
            [b.model_dump(include={"type", "text"}) for b in whole.content]
        assert text == "".join(block.text for block in whole.content if block.type == "text")
        assert final.stop_reason == "max_tokens" and final.usage.output_tokens == 12
        assert final.usage.input_tokens + (final.usage.cache_read_input_tokens or 0) == \
            whole.usage.input_tokens + (whole.usage.cache_read_input_tokens or 0)


def test_the_event_sequence_is_anthropics(conformance_cluster: RefCluster) -> None:
    for node in nodes(conformance_cluster):
        events = raw_events(node, model="tiny", max_tokens=6, messages=USER, **GREEDY)
        kinds = [event["type"] for event in events]
        assert kinds[:2] == ["message_start", "ping"]
        assert kinds[-2:] == ["message_delta", "message_stop"]
        middle = kinds[2:-2]
        if middle:
            assert middle[0] == "content_block_start" and middle[-1] == "content_block_stop"
            assert set(middle[1:-1]) == {"content_block_delta"}
        assert events[-2]["delta"]["stop_reason"] == "max_tokens"
        assert events[-2]["usage"]["output_tokens"] == 6
    tool_events = raw_events(conformance_cluster.orchestrator, model="tiny", max_tokens=96, messages=USER, **GREEDY,
                             tools=[WEATHER_TOOL], tool_choice={"type": "any"})
    deltas = [event["delta"] for event in tool_events if event["type"] == "content_block_delta"]
    assert {delta["type"] for delta in deltas} == {"input_json_delta"}
    assert len(deltas) > 1  # the input in the pieces it is generated in, not once the call is complete
    jsonschema.validate(orjson.loads("".join(delta["partial_json"] for delta in deltas)),
                        WEATHER_TOOL["input_schema"])
    assert tool_events[-2]["delta"]["stop_reason"] == "tool_use"


@pytest.mark.parametrize("placement", ["through CTX", "GEN alone"])
def test_message_start_says_the_prompts_tokens(conformance_cluster: RefCluster, placement: str) -> None:
    body: dict[str, Any] = {"model": "tiny", "max_tokens": 3, "messages": USER, **GREEDY}
    aggregated = raw_message(conformance_cluster.aggregated, **body).usage
    with contextlib.ExitStack() as stack:
        orchestrator = conformance_cluster.orchestrator
        if placement == "GEN alone":  # conditional disaggregation: the prompt is prefilled where it is decoded
            orchestrator = start_orchestrator(stack, [conformance_cluster.ctx.url], [conformance_cluster.gen.url],
                                              max_local_prefill_length=100_000)
        for node in (orchestrator, conformance_cluster.aggregated):
            events = raw_events(node, **body)
            started, final = events[0]["message"]["usage"], events[-2]["usage"]
            assert started["output_tokens"] == 0 and final["output_tokens"] == 3
            for name in ("input_tokens", "cache_read_input_tokens"):
                assert started[name] == final[name] == getattr(aggregated, name), name
            assert started["input_tokens"] > 0


def test_output_config_format_holds_the_answer_to_the_schema(conformance_cluster: RefCluster) -> None:
    schema = {"type": "object", "properties": {"ok": {"type": "boolean"}}, "required": ["ok"],
              "additionalProperties": False}
    answers = [raw_message(node, model="tiny", max_tokens=32, messages=USER, **GREEDY,
                           output_config={"format": {"type": "json_schema", "schema": schema}})
               for node in nodes(conformance_cluster)]
    assert answers[0].content == answers[1].content
    (block,) = answers[0].content
    assert block.type == "text"
    jsonschema.validate(orjson.loads(block.text), schema)


def test_count_tokens_is_the_prompt_the_engine_gets(conformance_cluster: RefCluster) -> None:
    body: dict[str, Any] = {"model": "tiny", "messages": USER, "system": "Be brief.", "tools": [WEATHER_TOOL]}
    counts = [sdk(node).messages.count_tokens(**body) for node in nodes(conformance_cluster)]
    assert isinstance(counts[0], MessageTokensCount)
    assert_strict(counts[0])
    answer = sdk(conformance_cluster.aggregated).messages.create(max_tokens=1, **body)
    assert counts[0].input_tokens == counts[1].input_tokens == \
        answer.usage.input_tokens + (answer.usage.cache_read_input_tokens or 0)


@pytest.mark.parametrize(("body", "status", "kind", "names"), [
    ({"messages": USER}, 400, "invalid_request_error", "max_tokens"),
    ({"max_tokens": 4, "messages": USER, "frequency_penalty": 1}, 400, "invalid_request_error", "frequency_penalty"),
    ({"max_tokens": 4, "messages": [{"role": "user", "content": [
        {"type": "image", "source": {"type": "url", "url": "http://x"}}]}]},
     400, "invalid_request_error", "messages.0.content.0.type"),
    ({"max_tokens": 4, "messages": USER, "thinking": {"type": "enabled", "budget_tokens": 1024}},
     400, "invalid_request_error", "thinking"),
    ({"max_tokens": 4, "messages": USER, "tools": [{"type": "web_search_20250305", "name": "web_search"}]},
     400, "invalid_request_error", "tools.0.type"),
    ({"max_tokens": 4, "messages": USER, "model": "claude-nope"}, 404, "not_found_error", "claude-nope"),
])
def test_errors_come_in_anthropics_shape(conformance_cluster: RefCluster, body: dict[str, Any], status: int,
                                         kind: str, names: str) -> None:
    for node in nodes(conformance_cluster):
        reply = httpx.post(node.url + "/v1/messages", json={"model": "tiny", **body}, timeout=60)
        assert reply.status_code == status, reply.text
        error = reply.json()
        assert set(error) == {"type", "error"} and error["type"] == "error"
        assert_strict(ErrorResponse.model_validate(error))
        assert error["error"]["type"] == kind and names in error["error"]["message"]


def test_the_sdk_raises_its_own_errors(conformance_cluster: RefCluster) -> None:
    client = sdk(conformance_cluster.orchestrator)
    with pytest.raises(anthropic.NotFoundError) as missing:
        client.messages.create(model="claude-nope", max_tokens=4, messages=USER)
    body: Any = missing.value.body
    assert body == {"type": "error", "error": {"type": "not_found_error", "message": body["error"]["message"]}}
    with pytest.raises(anthropic.BadRequestError):
        client.messages.count_tokens(model="tiny", messages=[{"role": "user", "content": [
            {"type": "document", "source": {"type": "text", "media_type": "text/plain", "data": "x"}}]}])


def test_anthropic_headers_are_accepted(conformance_cluster: RefCluster) -> None:
    reply = httpx.post(conformance_cluster.orchestrator.url + "/v1/messages", timeout=60,
                       headers={"x-api-key": "k", "anthropic-version": "2023-06-01",
                                "anthropic-beta": "prompt-caching-2024-07-31"},
                       json={"model": "tiny", "max_tokens": 2, "messages": USER})
    assert reply.status_code == 200, reply.text


@pytest.mark.parametrize("streamed", [False, True])
def test_a_repeated_prompt_is_read_from_the_prefix_cache(reuse_cluster: RefCluster, streamed: bool) -> None:
    story = f"{streamed}: " + "The quick brown fox jumps over the lazy dog and runs into the forest. " * 4
    body: dict[str, Any] = {"model": "tiny", "max_tokens": 2, "messages": [{"role": "user", "content": story}],
                            "extra_body": GREEDY}
    client = sdk(reuse_cluster.orchestrator)
    usages = []
    for _ in range(2):
        if streamed:
            with client.messages.stream(**body) as stream:
                started = next(iter(stream))
                usages.append(stream.get_final_message().usage)
            assert started.type == "message_start"  # the prompt's counts, the cache's included, come first
            assert started.message.usage.input_tokens == usages[-1].input_tokens
            assert started.message.usage.cache_read_input_tokens == usages[-1].cache_read_input_tokens
        else:
            usages.append(client.messages.create(**body).usage)
    first, second = usages
    assert first.cache_read_input_tokens is not None and second.cache_read_input_tokens is not None
    # (The chat template's opening is in the cache from any earlier request: only the story's blocks are new.)
    assert second.cache_read_input_tokens >= first.cache_read_input_tokens + BLOCK_TOKENS
    assert second.input_tokens + second.cache_read_input_tokens == \
        first.input_tokens + first.cache_read_input_tokens  # the same prompt

"""Item 5: structured output through the orchestrator (CTX chooses the first token under the grammar, GEN the rest)
on the tiny reference model, driven by the official SDK: ``response_format`` json_object / json_schema, the
Responses API's ``text.format``, and forced tool calls, whole and streamed; the disaggregated answer equals the
aggregated one; bad schemas are 400s naming the field.

The tiny model has random weights, so the schemas here bound every value (enums, bounded integers, booleans,
short strings): the grammar, not the model, is what makes the output finish and validate.
"""

from __future__ import annotations

from typing import Any, Literal

import jsonschema
import openai
import orjson
import pytest
from pydantic import BaseModel, ConfigDict, Field

from tests.workers.engines.reference.cluster import RefCluster

MESSAGES: list[Any] = [{"role": "user", "content": "What is the weather in Paris?"}]


class Weather(BaseModel):
    model_config = ConfigDict(extra="forbid")

    city: Literal["Paris", "Berlin", "Rome"]
    sunny: bool
    degrees: int = Field(ge=-20, le=40)


WEATHER_TOOL: Any = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "parameters": {
            "type": "object",
            "properties": {"city": {"enum": ["Paris", "Rome"]}, "unit": {"enum": ["C", "F"]}},
            "required": ["city", "unit"],
            "additionalProperties": False,
        },
    },
}
TIME_TOOL: Any = {
    "type": "function",
    "function": {"name": "get_time", "parameters": {
        "type": "object", "properties": {"h": {"type": "integer", "minimum": 0, "maximum": 23}}, "required": ["h"],
        "additionalProperties": False}},
}
PARAMETERS = {t["function"]["name"]: t["function"]["parameters"] for t in (WEATHER_TOOL, TIME_TOOL)}
BOUNDED_SCHEMA: dict[str, Any] = {
    "type": "object",
    "properties": {"ok": {"type": "boolean"}, "n": {"type": "integer", "minimum": 0, "maximum": 9},
                   "tag": {"type": "string", "maxLength": 4}},
    "required": ["ok", "n", "tag"],
    "additionalProperties": False,
}


def test_json_schema_parses_into_the_pydantic_model(conformance_cluster: RefCluster) -> None:
    client = conformance_cluster.orchestrator.client()
    reply = client.chat.completions.parse(model="tiny", messages=MESSAGES, response_format=Weather, max_tokens=64,
                                          temperature=0)
    assert reply.choices[0].finish_reason == "stop"
    assert isinstance(reply.choices[0].message.parsed, Weather)


def test_json_schema_streamed_validates(conformance_cluster: RefCluster) -> None:
    client = conformance_cluster.orchestrator.client()
    response_format: Any = {"type": "json_schema", "json_schema": {"name": "b", "schema": BOUNDED_SCHEMA,
                                                                   "strict": True}}
    chunks = list(client.chat.completions.create(model="tiny", messages=MESSAGES, response_format=response_format,
                                                 max_tokens=64, temperature=0.8, seed=3, top_p=0.9, stream=True))
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "stop"
    jsonschema.validate(orjson.loads(text), BOUNDED_SCHEMA)


def test_json_object_gives_an_object(conformance_cluster: RefCluster) -> None:
    client = conformance_cluster.orchestrator.client()
    # Any object at all: a random model may fill it until max_tokens, so only a finished answer must parse.
    reply = client.chat.completions.create(model="tiny", messages=MESSAGES, response_format={"type": "json_object"},
                                           max_tokens=48, temperature=0)
    content = reply.choices[0].message.content or ""
    assert content.startswith("{")
    if reply.choices[0].finish_reason == "stop":
        assert isinstance(orjson.loads(content), dict)


@pytest.mark.parametrize("stream", [False, True])
def test_disaggregated_output_equals_aggregated(conformance_cluster: RefCluster, stream: bool) -> None:
    body: dict[str, Any] = {"model": "tiny", "messages": MESSAGES, "max_tokens": 64, "temperature": 0,
                            "response_format": {"type": "json_schema",
                                                "json_schema": {"name": "b", "schema": BOUNDED_SCHEMA}}}
    texts = []
    for node in (conformance_cluster.orchestrator, conformance_cluster.aggregated):
        client = node.client()
        if stream:
            chunks = client.chat.completions.create(**body, stream=True)
            texts.append("".join(c.choices[0].delta.content or "" for c in chunks if c.choices))
        else:
            texts.append(client.chat.completions.create(**body).choices[0].message.content or "")
    assert texts[0] == texts[1]
    jsonschema.validate(orjson.loads(texts[0]), BOUNDED_SCHEMA)


def test_responses_text_format_validates(conformance_cluster: RefCluster) -> None:
    client = conformance_cluster.orchestrator.client()
    text_format: Any = {"format": {"type": "json_schema", "name": "b", "schema": BOUNDED_SCHEMA, "strict": True}}
    reply = client.responses.create(model="tiny", input="Answer in JSON", text=text_format, max_output_tokens=64,
                                    temperature=0)
    jsonschema.validate(orjson.loads(reply.output_text), BOUNDED_SCHEMA)


@pytest.mark.parametrize("tool_choice", ["required", {"type": "function", "function": {"name": "get_time"}}])
def test_a_forced_tool_call_comes_in_openais_shape(conformance_cluster: RefCluster, tool_choice: Any) -> None:
    client = conformance_cluster.orchestrator.client()
    reply = client.chat.completions.create(model="tiny", messages=MESSAGES, tools=[WEATHER_TOOL, TIME_TOOL],
                                           tool_choice=tool_choice, max_tokens=64, temperature=0)
    choice = reply.choices[0]
    assert choice.finish_reason == "tool_calls"
    assert choice.message.content is None
    (call,) = choice.message.tool_calls or []
    assert isinstance(call, openai.types.chat.ChatCompletionMessageFunctionToolCall)
    assert call.type == "function" and call.id.startswith("call_")
    if isinstance(tool_choice, dict):
        assert call.function.name == "get_time"
    jsonschema.validate(orjson.loads(call.function.arguments), PARAMETERS[call.function.name])


def test_a_streamed_tool_call_assembles_in_the_sdk(conformance_cluster: RefCluster) -> None:
    client = conformance_cluster.orchestrator.client()
    with client.chat.completions.stream(model="tiny", messages=MESSAGES, tools=[WEATHER_TOOL],
                                        tool_choice="required", max_tokens=64, temperature=0) as events:
        final = events.get_final_completion()
    choice = final.choices[0]
    assert choice.finish_reason == "tool_calls"
    (call,) = choice.message.tool_calls or []
    assert call.type == "function" and call.function.name == "get_weather"
    jsonschema.validate(orjson.loads(call.function.arguments), PARAMETERS["get_weather"])
    # The streamed call is the whole call.
    whole = client.chat.completions.create(model="tiny", messages=MESSAGES, tools=[WEATHER_TOOL],
                                           tool_choice="required", max_tokens=64, temperature=0)
    (whole_call,) = whole.choices[0].message.tool_calls or []
    assert isinstance(whole_call, openai.types.chat.ChatCompletionMessageFunctionToolCall)
    assert (whole_call.function.name, whole_call.function.arguments) == (call.function.name, call.function.arguments)


@pytest.mark.parametrize("stream", [False, True])
def test_a_call_cut_short_by_max_tokens_is_text_with_finish_length(conformance_cluster: RefCluster,
                                                                  stream: bool) -> None:
    client = conformance_cluster.orchestrator.client()
    body: Any = {"model": "tiny", "messages": MESSAGES, "tools": [WEATHER_TOOL], "tool_choice": "required",
                 "max_tokens": 4, "temperature": 0}
    if stream:
        chunks = [c for c in client.chat.completions.create(**body, stream=True) if c.choices]
        assert not any(c.choices[0].delta.tool_calls for c in chunks)
        text, finish = "".join(c.choices[0].delta.content or "" for c in chunks), chunks[-1].choices[0].finish_reason
    else:
        choice = client.chat.completions.create(**body).choices[0]
        assert choice.message.tool_calls is None
        text, finish = choice.message.content or "", choice.finish_reason
    assert finish == "length" and '{"name": "get_weather"'.startswith(text) and text


@pytest.mark.parametrize("tool_choice", ["none", "auto"])
def test_tools_without_a_forced_call_answer_in_text(conformance_cluster: RefCluster, tool_choice: Any) -> None:
    client = conformance_cluster.orchestrator.client()
    reply = client.chat.completions.create(model="tiny", messages=MESSAGES, tools=[WEATHER_TOOL],
                                           tool_choice=tool_choice, max_tokens=4, temperature=0)
    assert reply.choices[0].finish_reason in ("stop", "length")
    assert reply.choices[0].message.tool_calls is None


@pytest.mark.parametrize(("body", "param"), [
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "nope"}}}},
     "response_format"),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x"}}}, "response_format"),
    ({"tools": [{"type": "function", "function": {"name": "f", "parameters": {"type": "object", "properties": {
        "a": {"$ref": "#/missing"}}}}}], "tool_choice": "required"}, "tools.0.function.parameters"),
    ({"tool_choice": "required"}, "tool_choice"),
    ({"tools": [WEATHER_TOOL], "tool_choice": {"type": "function", "function": {"name": "other"}}}, "tool_choice"),
    ({"tools": [WEATHER_TOOL], "tool_choice": "required", "response_format": {"type": "json_object"}},
     "response_format"),
])
def test_bad_structured_output_requests_are_400s_naming_the_field(
    conformance_cluster: RefCluster, body: dict[str, Any], param: str
) -> None:
    client = conformance_cluster.orchestrator.client()
    with pytest.raises(openai.BadRequestError) as caught:
        client.chat.completions.create(model="tiny", messages=MESSAGES, max_tokens=4, **body)
    assert caught.value.status_code == 400
    error = caught.value.body
    assert isinstance(error, dict) and error["param"] == param and error["type"] == "invalid_request_error"
    # The server keeps serving.
    assert client.chat.completions.create(model="tiny", messages=MESSAGES, max_tokens=1).choices


def _n_answers(node: Any, body: dict[str, Any], stream: bool) -> list[tuple[str, str | None]]:
    """Each choice's (text, finish_reason), by index, whole or streamed."""
    client = node.client()
    if not stream:
        return [(c.message.content or "", c.finish_reason) for c in client.chat.completions.create(**body).choices]
    texts: dict[int, str] = {}
    finishes: dict[int, str | None] = {}
    for chunk in client.chat.completions.create(**body, stream=True):
        for c in chunk.choices:
            texts[c.index] = texts.get(c.index, "") + (c.delta.content or "")
            finishes[c.index] = c.finish_reason or finishes.get(c.index)
    return [(texts[index], finishes[index]) for index in sorted(texts)]


@pytest.mark.parametrize("stream", [False, True])
def test_n_choices_each_follow_the_schema_and_disaggregated_equals_aggregated(conformance_cluster: RefCluster,
                                                                              stream: bool) -> None:
    # Each sequence has its own grammar state: CTX chooses every sequence's first token under it, GEN rebuilds
    # every sequence's state and replays its first token. Sampled (seed + i per choice), so the choices can differ.
    body: dict[str, Any] = {"model": "tiny", "messages": MESSAGES, "max_tokens": 64, "temperature": 0.8, "seed": 5,
                            "n": 2, "response_format": {"type": "json_schema",
                                                        "json_schema": {"name": "b", "schema": BOUNDED_SCHEMA}}}
    disaggregated = _n_answers(conformance_cluster.orchestrator, body, stream)
    assert disaggregated == _n_answers(conformance_cluster.aggregated, body, stream)
    assert len(disaggregated) == 2
    for text, finish in disaggregated:
        assert finish == "stop"
        jsonschema.validate(orjson.loads(text), BOUNDED_SCHEMA)
    # Choice i is the lone request seeded seed + i: its grammar state was not disturbed by its sibling's.
    lone = _n_answers(conformance_cluster.aggregated, {**body, "n": 1, "seed": 6}, stream)
    assert lone == disaggregated[1:]


@pytest.mark.parametrize("stream", [False, True])
def test_n_forced_tool_calls_come_one_per_choice(conformance_cluster: RefCluster, stream: bool) -> None:
    client = conformance_cluster.orchestrator.client()
    body: Any = {"model": "tiny", "messages": MESSAGES, "tools": [WEATHER_TOOL, TIME_TOOL], "tool_choice": "required",
                 "max_tokens": 64, "temperature": 0.8, "seed": 9, "n": 2}
    if stream:
        # Per choice, per call index: [id, name, arguments], the arguments' pieces joined as a client joins them.
        calls: dict[int, dict[int, list[Any]]] = {}
        finishes: dict[int, str | None] = {}
        for chunk in client.chat.completions.create(**body, stream=True):
            for c in chunk.choices:
                assert not c.delta.content
                for d in c.delta.tool_calls or ():
                    entry = calls.setdefault(c.index, {}).setdefault(d.index, [None, None, ""])
                    entry[0] = d.id or entry[0]
                    entry[1] = (d.function.name if d.function else None) or entry[1]
                    entry[2] += (d.function.arguments if d.function else None) or ""
                finishes[c.index] = c.finish_reason or finishes.get(c.index)
        got = [(finishes[i], [(index, *entry) for index, entry in sorted(calls[i].items())]) for i in sorted(calls)]
    else:
        reply = client.chat.completions.create(**body)
        got = [(c.finish_reason, [(i, t.id, t.function.name, t.function.arguments)
                                  for i, t in enumerate(c.message.tool_calls or ())
                                  if isinstance(t, openai.types.chat.ChatCompletionMessageFunctionToolCall)])
               for c in reply.choices]
    assert len(got) == 2
    ids = set()
    for finish, choice_calls in got:
        assert finish == "tool_calls"
        ((index, call_id, name, arguments),) = choice_calls
        assert index == 0 and call_id and call_id.startswith("call_") and name in PARAMETERS
        ids.add(call_id)
        jsonschema.validate(orjson.loads(arguments or ""), PARAMETERS[name])
    assert len(ids) == 2  # every call has its own id

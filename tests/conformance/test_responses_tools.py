"""Function tools on the Responses API with the official ``openai`` SDK, through CTX and GEN and on one worker:
``tools``, ``tool_choice`` (auto, required, none, a named function), ``parallel_tool_calls``, ``function_call``
output items whole and streamed (as OpenAI streams them), continued by ``previous_response_id``; every object and
event parses strictly with the SDK's own types; every bad input is a 400 naming the parameter.

The tiny model has random weights: a forced call's grammar, not the model, makes it finish and validate, so the
tools' parameters bound every value."""

from __future__ import annotations

from typing import Any

import httpx
import jsonschema
import openai
import orjson
import pydantic
import pytest
from openai.types.responses import Response, ResponseFunctionToolCall, ResponseStreamEvent

from tests.conformance.sdk_strict import assert_strict, named_events
from tests.workers.engines.reference.cluster import RefCluster, RefNode

# Short: every character of a tool is prompt, and the tiny model's context is 512 tokens of (mostly) one byte each.
WEATHER: Any = {
    "type": "function", "name": "weather", "description": "Now.",
    "parameters": {"type": "object", "properties": {"city": {"enum": ["Paris", "Rome"]}}, "required": ["city"],
                   "additionalProperties": False},
}
TIME: Any = {
    "type": "function", "name": "time",
    "parameters": {"type": "object", "properties": {"h": {"type": "integer", "minimum": 0, "maximum": 9}},
                   "required": ["h"], "additionalProperties": False},
}
PARAMETERS = {tool["name"]: tool["parameters"] for tool in (WEATHER, TIME)}
ASK: Any = {"model": "tiny", "input": "Weather in Paris?", "max_output_tokens": 48,
                       "temperature": 0}
EVENTS = pydantic.TypeAdapter(ResponseStreamEvent)


def whole(node: RefNode, **body: Any) -> Response:
    reply = httpx.post(node.url + "/v1/responses", json={**ASK, **body}, timeout=120)
    assert reply.status_code == 200, reply.text
    response = Response.model_validate(reply.json())
    assert_strict(response)
    return response


def streamed(node: RefNode, **body: Any) -> list[dict[str, Any]]:
    """The stream's events, each checked against the SDK's event types, its ``event:`` name its ``type``."""
    events = []
    with httpx.stream("POST", node.url + "/v1/responses", json={**ASK, **body, "stream": True}, timeout=120) as reply:
        assert reply.status_code == 200, reply.read()
        for payload in named_events(reply):
            event = EVENTS.validate_python(payload)
            assert isinstance(event, pydantic.BaseModel)
            assert_strict(event)
            events.append(payload)
    assert [e["sequence_number"] for e in events] == list(range(len(events)))
    return events


def the_call(response: Response) -> ResponseFunctionToolCall:
    (call,) = response.output
    assert isinstance(call, ResponseFunctionToolCall)
    assert call.status == "completed" and call.id and call.id.startswith("fc_") and call.call_id.startswith("call_")
    jsonschema.validate(orjson.loads(call.arguments), PARAMETERS[call.name])
    return call


@pytest.mark.parametrize("tool_choice", ["required", {"type": "function", "name": "time"}])
def test_a_forced_call_is_a_function_call_item_equal_on_every_deployment(conformance_cluster: RefCluster,
                                                                         tool_choice: Any) -> None:
    answers = [whole(node, tools=[WEATHER, TIME], tool_choice=tool_choice)
               for node in (conformance_cluster.orchestrator, conformance_cluster.aggregated)]
    calls = [the_call(response) for response in answers]
    assert (calls[0].name, calls[0].arguments) == (calls[1].name, calls[1].arguments)
    if isinstance(tool_choice, dict):
        assert calls[0].name == "time"
    response = answers[0]
    assert response.status == "completed" and response.output_text == ""
    assert response.tool_choice == tool_choice if isinstance(tool_choice, str) else \
        response.tool_choice.model_dump(exclude_none=True) == tool_choice  # type: ignore[union-attr]
    assert [tool.model_dump(exclude_none=True) for tool in response.tools] == [WEATHER, TIME]
    assert response.parallel_tool_calls is True


def test_a_streamed_call_comes_as_openai_streams_it(conformance_cluster: RefCluster) -> None:
    body = {"tools": [WEATHER], "tool_choice": "required", "parallel_tool_calls": False}
    events = streamed(conformance_cluster.orchestrator, **body)
    types = [e["type"] for e in events]
    deltas = [e for e in events if e["type"] == "response.function_call_arguments.delta"]
    assert types == [
        "response.created", "response.in_progress", "response.output_item.added",
        *["response.function_call_arguments.delta"] * len(deltas), "response.function_call_arguments.done",
        "response.output_item.done", "response.completed"]
    assert len(deltas) > 1  # the arguments in the pieces they are generated in, not once the call is complete
    added, done, item_done, completed = events[2], *events[-3:]
    assert added["item"]["type"] == "function_call" and added["item"]["status"] == "in_progress"
    assert added["item"]["arguments"] == "" and added["item"]["name"] == "weather"
    assert {d["item_id"] for d in deltas} == {done["item_id"]} == {added["item"]["id"]} == {item_done["item"]["id"]}
    assert "".join(d["delta"] for d in deltas) == done["arguments"] == item_done["item"]["arguments"]
    assert completed["response"]["output"] == [item_done["item"]]
    assert completed["response"]["parallel_tool_calls"] is False
    # The same call, whole and on one worker.
    call = the_call(whole(conformance_cluster.aggregated, **body))
    assert (call.name, call.arguments) == (item_done["item"]["name"], done["arguments"])
    aggregated = streamed(conformance_cluster.aggregated, **body)
    assert aggregated[-2]["item"]["arguments"] == done["arguments"]


def test_the_sdks_stream_helper_assembles_the_call(conformance_cluster: RefCluster) -> None:
    with conformance_cluster.orchestrator.client() as client, client.responses.stream(
            model="tiny", input=ASK["input"], max_output_tokens=48, temperature=0, tools=[WEATHER],
            tool_choice="required") as stream:
        final = stream.get_final_response()
    call = the_call(final)
    assert call.name == "weather"


def test_a_stream_cut_short_inside_the_arguments_ends_with_the_call_incomplete(conformance_cluster: RefCluster
                                                                                ) -> None:
    body = {"tools": [WEATHER], "tool_choice": "required"}
    complete = whole(conformance_cluster.orchestrator, **body)
    assert complete.usage is not None
    arguments = the_call(complete).arguments
    # A few tokens short of the whole call: inside '{"city": "Paris"}', whose pieces are already out.
    events = streamed(conformance_cluster.orchestrator, **body, max_output_tokens=complete.usage.output_tokens - 3)
    response = Response.model_validate(events[-1]["response"])
    assert events[-1]["type"] == "response.incomplete" and response.status == "incomplete"
    (item,) = response.output
    assert isinstance(item, ResponseFunctionToolCall) and item.status == "incomplete"
    assert item.arguments and arguments.startswith(item.arguments) and item.arguments != arguments
    sent = "".join(e["delta"] for e in events if e["type"] == "response.function_call_arguments.delta")
    assert sent == item.arguments


@pytest.mark.parametrize("stream", [False, True])
def test_a_call_cut_short_is_text_and_incomplete(conformance_cluster: RefCluster, stream: bool) -> None:
    # Cut before its name is known: no call has begun, the stream's text is the answer.
    body = {"tools": [WEATHER], "tool_choice": "required", "max_output_tokens": 4}
    if stream:
        events = streamed(conformance_cluster.orchestrator, **body)
        assert not any(e["type"].startswith("response.function_call") for e in events)
        response = Response.model_validate(events[-1]["response"])
    else:
        response = whole(conformance_cluster.orchestrator, **body)
    assert response.status == "incomplete"
    text = response.output_text
    assert text and '{"name": "weather"'.startswith(text)


@pytest.mark.parametrize("tool_choice", ["auto", "none", None])
def test_without_a_forced_call_the_answer_is_text(conformance_cluster: RefCluster, tool_choice: Any) -> None:
    choice = {"tool_choice": tool_choice} if tool_choice else {}
    response = whole(conformance_cluster.orchestrator, tools=[WEATHER], max_output_tokens=4, **choice)
    assert [item.type for item in response.output] == ["message"]
    assert response.tool_choice == (tool_choice or "auto")


@pytest.mark.parametrize("stream", [False, True])
def test_a_call_continues_by_previous_response_id(conformance_cluster: RefCluster, stream: bool) -> None:
    with conformance_cluster.orchestrator.client() as client:
        first = client.responses.create(**ASK, tools=[WEATHER], tool_choice="required")
        call = the_call(first)
        follow_up: Any = {"type": "function_call_output", "call_id": call.call_id, "output": "12 C and sunny"}
        request: dict[str, Any] = {**ASK, "input": [follow_up], "previous_response_id": first.id,
                                   "tools": [WEATHER], "max_output_tokens": 4}
        if stream:
            events = list(client.responses.create(**request, stream=True))
            second = events[-1].response
        else:
            second = client.responses.create(**request)
        # On one worker, the conversation sent whole: the same answer.
        conversation = [{"role": "user", "content": ASK["input"]}, *(i.model_dump(exclude_none=True)
                                                                      for i in first.output), follow_up]
        with conformance_cluster.aggregated.client() as worker:
            alone = worker.responses.create(**{**request, "previous_response_id": None, "input": conversation,
                                               "store": False})
    assert second.output_text == alone.output_text and second.usage == alone.usage
    assert second.usage is not None and first.usage is not None
    assert second.usage.input_tokens > first.usage.input_tokens


REFUSED: list[tuple[dict[str, Any], str]] = [
    ({"tools": [{"type": "web_search"}]}, "tools.0.type"),
    ({"tools": [WEATHER, {"type": "file_search", "vector_store_ids": ["vs_1"]}]}, "tools.1.type"),
    ({"tools": [{"type": "code_interpreter", "container": {"type": "auto"}}]}, "tools.0.type"),
    ({"tools": [{"type": "function"}]}, "tools.0.name"),
    ({"tools": [{"type": "function", "function": {"name": "f"}}]}, "tools.0.name"),  # chat's shape
    ({"tools": [{**WEATHER, "defer_loading": True}]}, "tools.0.defer_loading"),
    ({"tools": "weather"}, "tools"),
    ({"tool_choice": "required"}, "tool_choice"),
    ({"tools": [WEATHER], "tool_choice": {"type": "function", "name": "other"}}, "tool_choice"),
    ({"tools": [WEATHER], "tool_choice": {"type": "web_search_preview"}}, "tool_choice"),
    ({"tools": [WEATHER], "tool_choice": {"type": "allowed_tools", "mode": "auto", "tools": []}}, "tool_choice"),
    ({"tools": [WEATHER], "tool_choice": "sometimes"}, "tool_choice"),
    ({"tools": [{**WEATHER, "parameters": {"type": "object", "properties": {"a": {"$ref": "#/missing"}}}}],
      "tool_choice": "required"}, "tools.0.parameters"),
    ({"tools": [WEATHER], "tool_choice": "required", "text": {"format": {"type": "json_object"}}}, "text.format"),
    ({"parallel_tool_calls": "yes"}, "parallel_tool_calls"),
]


@pytest.mark.parametrize(("body", "param"), REFUSED)
def test_a_bad_tools_request_is_a_400_naming_the_parameter(conformance_cluster: RefCluster, body: dict[str, Any],
                                                          param: str) -> None:
    with conformance_cluster.orchestrator.client() as client, pytest.raises(openai.BadRequestError) as caught:
        client.responses.create(**{**ASK, "max_output_tokens": 4}, extra_body=body)
    error = caught.value.body
    assert isinstance(error, dict) and error["param"] == param and error["type"] == "invalid_request_error", error
    if param.endswith(".type"):
        assert repr(body["tools"][int(param.split(".")[1])]["type"]) in error["message"]  # the tool type, by name

from __future__ import annotations

import typing
from typing import Any

import orjson
import pytest
from openai import BaseModel as OpenAIModel
from openai.types import Completion
from openai.types.chat import ChatCompletion, ChatCompletionChunk
from openai.types.responses import Response, ResponseStreamEvent

from frontend.errors import UpstreamError
from frontend.openai_output import (
    Endpoint,
    ResponseIdentity,
    ResponsesSettings,
    StreamRenderer,
    TokenLogprobInfo,
    Usage,
    as_function_call_output,
    render_response,
    replay_as_stream,
    stream_error_frames,
)
from frontend.sse import DONE_FRAME, FrameSplitter

USAGE = Usage(prompt_tokens=11, completion_tokens=3)
LOGPROBS = [TokenLogprobInfo("He", -0.5, (("He", -0.5), ("Hi", -1.5))), TokenLogprobInfo("llo", 0.0, (("llo", 0.0),))]


def _event_classes() -> dict[str, type[OpenAIModel]]:
    union = typing.get_args(ResponseStreamEvent)[0]
    classes: dict[str, type[OpenAIModel]] = {}
    for cls in typing.get_args(union):
        (literal,) = typing.get_args(cls.model_fields["type"].annotation)
        classes[literal] = cls
    return classes


EVENT_CLASSES = _event_classes()


def ident(endpoint: Endpoint) -> ResponseIdentity:
    prefix = {"chat": "chatcmpl-", "completions": "cmpl-", "responses": "resp_"}[endpoint]
    return ResponseIdentity(endpoint, prefix + "abc123", "synthetic", created=1_700_000_000)


def parse_frames(frames: list[bytes]) -> list[tuple[str | None, Any]]:
    """(event type or None, parsed data) per frame; ``[DONE]`` comes back as the string."""
    out: list[tuple[str | None, Any]] = []
    for frame in frames:
        assert frame.endswith(b"\n\n")
        event, data = None, None
        for line in frame[:-2].split(b"\n"):
            if line.startswith(b"event: "):
                event = line[len(b"event: "):].decode()
            elif line.startswith(b"data: "):
                raw = line[len(b"data: "):]
                data = raw.decode() if raw == b"[DONE]" else orjson.loads(raw)
        out.append((event, data))
    return out


def validate_completion_chunk(data: dict[str, Any]) -> dict[str, Any]:
    """The client's ``Completion`` type is reused for stream chunks but types ``finish_reason`` as non-null, while
    the API (OpenAI's and vLLM's alike) streams ``null`` until the last chunk: validate everything else."""
    checked = orjson.loads(orjson.dumps(data))
    for choice in checked["choices"]:
        if choice["finish_reason"] is None:
            choice["finish_reason"] = "stop"
    Completion.model_validate(checked)
    return data


def validate_responses_events(frames: list[bytes]) -> list[str]:
    types = []
    for event, data in parse_frames(frames):
        assert event is not None and event == data["type"]
        EVENT_CLASSES[event].model_validate(data)
        types.append(event)
    return types


# -- whole responses ---------------------------------------------------------------------------------------
@pytest.mark.parametrize("logprobs", [None, LOGPROBS])
def test_chat_response_is_a_valid_chat_completion(logprobs: list[TokenLogprobInfo] | None) -> None:
    body = render_response(ident("chat"), "Hello", "stop", USAGE, logprobs)
    parsed = ChatCompletion.model_validate(orjson.loads(orjson.dumps(body)))
    assert parsed.choices[0].message.content == "Hello"
    assert parsed.choices[0].finish_reason == "stop"
    assert parsed.usage is not None
    assert (parsed.usage.prompt_tokens, parsed.usage.completion_tokens, parsed.usage.total_tokens) == (11, 3, 14)
    if logprobs is None:
        assert parsed.choices[0].logprobs is None
    else:
        assert parsed.choices[0].logprobs is not None
        content = parsed.choices[0].logprobs.content
        assert content is not None
        assert [c.token for c in content] == ["He", "llo"]
        assert content[0].bytes == list(b"He")
        assert [t.token for t in content[0].top_logprobs] == ["He", "Hi"]


@pytest.mark.parametrize("logprobs", [None, LOGPROBS])
def test_completion_response_is_a_valid_completion(logprobs: list[TokenLogprobInfo] | None) -> None:
    body = render_response(ident("completions"), "Hello", "length", USAGE, logprobs)
    parsed = Completion.model_validate(body)
    assert parsed.choices[0].text == "Hello"
    assert parsed.choices[0].finish_reason == "length"
    if logprobs is not None:
        lp = parsed.choices[0].logprobs
        assert lp is not None
        assert lp.tokens == ["He", "llo"]
        assert lp.text_offset == [0, 2]
        assert lp.token_logprobs == [-0.5, 0.0]


@pytest.mark.parametrize(("finish", "status"), [("stop", "completed"), ("length", "incomplete")])
def test_responses_response_is_a_valid_response(finish: str, status: str) -> None:
    body = render_response(ident("responses"), "Hello", finish, USAGE)
    parsed = Response.model_validate(body)
    assert parsed.output_text == "Hello"
    assert parsed.status == status
    assert parsed.usage is not None
    assert (parsed.usage.input_tokens, parsed.usage.output_tokens, parsed.usage.total_tokens) == (11, 3, 14)
    if status == "incomplete":
        assert parsed.incomplete_details is not None
        assert parsed.incomplete_details.reason == "max_output_tokens"


# -- streams -----------------------------------------------------------------------------------------------
def render_stream(endpoint: Endpoint, deltas: list[str], finish: str, include_usage: bool) -> list[bytes]:
    renderer = StreamRenderer(ident(endpoint), include_usage)
    frames = renderer.begin()
    for delta in deltas:
        frames += renderer.delta(delta)
    return frames + renderer.finish(finish, USAGE)


@pytest.mark.parametrize("include_usage", [False, True])
def test_chat_stream_chunks_are_valid_and_end_with_done(include_usage: bool) -> None:
    frames = render_stream("chat", ["He", "", "llo"], "stop", include_usage)
    assert frames[-1] == DONE_FRAME
    chunks = [ChatCompletionChunk.model_validate(data) for _, data in parse_frames(frames[:-1])]
    assert chunks[0].choices[0].delta.role == "assistant"
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == "Hello"
    finishes = [c.choices[0].finish_reason for c in chunks if c.choices]
    assert finishes[-1] == "stop"
    assert all(f is None for f in finishes[:-1])
    usage = [c.usage for c in chunks if c.usage is not None]
    if include_usage:
        assert len(usage) == 1
        assert chunks[-1].choices == []
        assert usage[0].completion_tokens == 3
    else:
        assert usage == []


@pytest.mark.parametrize("include_usage", [False, True])
def test_completion_stream_chunks_are_valid_and_end_with_done(include_usage: bool) -> None:
    frames = render_stream("completions", ["He", "llo"], "length", include_usage)
    assert frames[-1] == DONE_FRAME
    chunks = [validate_completion_chunk(data) for _, data in parse_frames(frames[:-1])]
    assert "".join(c["choices"][0]["text"] for c in chunks if c["choices"]) == "Hello"
    finishes = [c["choices"][0]["finish_reason"] for c in chunks if c["choices"]]
    assert finishes == [None, None, "length"]
    assert any("usage" in c for c in chunks) is include_usage


RESPONSES_SEQUENCE = [
    "response.created",
    "response.in_progress",
    "response.output_item.added",
    "response.content_part.added",
    "response.output_text.delta",
    "response.output_text.delta",
    "response.output_text.done",
    "response.content_part.done",
    "response.output_item.done",
]


@pytest.mark.parametrize(("finish", "last"), [("stop", "response.completed"), ("length", "response.incomplete")])
def test_responses_stream_events_are_valid_and_in_order(finish: str, last: str) -> None:
    frames = render_stream("responses", ["He", "llo"], finish, False)
    assert validate_responses_events(frames) == [*RESPONSES_SEQUENCE, last]
    parsed = parse_frames(frames)
    assert [data["sequence_number"] for _, data in parsed] == list(range(len(frames)))
    final = Response.model_validate(parsed[-1][1]["response"])
    assert final.output_text == "Hello"
    assert parsed[6][1]["text"] == "Hello"


def test_stream_frames_survive_any_resplitting() -> None:
    frames = render_stream("responses", ["a", "b", "c"], "stop", False)
    splitter = FrameSplitter()
    out = [f for byte in b"".join(frames) for f in splitter.feed(bytes([byte]))]
    assert out == frames


def test_stream_error_frames() -> None:
    error = UpstreamError("the GEN stream broke")
    chat = stream_error_frames("chat", error)
    assert chat[-1] == DONE_FRAME
    assert parse_frames(chat)[0][1]["error"]["code"] == "upstream_error"
    (frame,) = stream_error_frames("responses", error, sequence_number=4)
    event, data = parse_frames([frame])[0]
    assert event == "error"
    EVENT_CLASSES["error"].model_validate(data)
    assert data["sequence_number"] == 4
    assert data["message"] == "the GEN stream broke"


def test_renderer_error_continues_the_sequence_numbers() -> None:
    renderer = StreamRenderer(ident("responses"))
    begun = renderer.begin()
    (frame,) = renderer.error(UpstreamError("x"))
    assert parse_frames([frame])[0][1]["sequence_number"] == len(begun)


@pytest.mark.parametrize("endpoint", ["chat", "completions", "responses"])
@pytest.mark.parametrize("finish", ["stop", "length"])
def test_replay_of_a_whole_response_streams_the_same_text(endpoint: Endpoint, finish: str) -> None:
    whole = orjson.loads(orjson.dumps(render_response(ident(endpoint), "Hi!", finish, USAGE)))
    frames = replay_as_stream(endpoint, whole, include_usage=True)
    if endpoint == "responses":
        types = validate_responses_events(frames)
        assert types[-1] == ("response.completed" if finish == "stop" else "response.incomplete")
        parsed = parse_frames(frames)
        assert [data["sequence_number"] for _, data in parsed] == list(range(len(frames)))  # in emission order
        final = parsed[-1][1]["response"]
        assert final["output"][0]["content"][0]["text"] == "Hi!"
        assert final["usage"]["input_tokens"] == 11
        return
    assert frames[-1] == DONE_FRAME
    chunks = [data for _, data in parse_frames(frames[:-1])]
    for chunk in chunks:
        if endpoint == "chat":
            ChatCompletionChunk.model_validate(chunk)
        else:
            validate_completion_chunk(chunk)
    choices = [c["choices"][0] for c in chunks if c["choices"]]
    text = "".join(c["delta"].get("content") or "" if endpoint == "chat" else c["text"] for c in choices)
    assert text == "Hi!"
    assert choices[-1]["finish_reason"] == finish
    assert chunks[-1]["usage"]["prompt_tokens"] == 11
    assert all(c["id"] == whole["id"] for c in chunks)


def test_usage_shapes() -> None:
    assert USAGE.as_openai("chat") == {"prompt_tokens": 11, "completion_tokens": 3, "total_tokens": 14,
                                       "prompt_tokens_details": {"cached_tokens": 0}}
    assert Usage.from_openai(Usage(11, 3, 5).as_openai("chat")) == Usage(11, 3, 5)
    assert Usage.from_openai(Usage(11, 3, 5).as_openai("responses")) == Usage(11, 3, 5)
    assert USAGE.as_openai("responses")["input_tokens"] == 11
    assert USAGE.as_openai("responses")["output_tokens"] == 3


@pytest.mark.parametrize("endpoint", ["chat", "completions"])
def test_continuous_usage_puts_the_counts_so_far_on_every_chunk(endpoint: Endpoint) -> None:
    renderer = StreamRenderer(ident(endpoint), include_usage=True, continuous_usage=True)
    renderer.usage = Usage(11, 0, 4)
    frames = renderer.begin()
    renderer.usage = Usage(11, 1, 4)
    frames += renderer.delta("Hi")
    frames += renderer.finish("stop", Usage(11, 1, 4))
    usages = [data["usage"] for _, data in parse_frames(frames[:-1])]
    if endpoint == "chat":  # its first chunk (the role's) comes before any token: the prompt's counts alone
        assert usages.pop(0) == Usage(11, 0, 4).as_openai(endpoint)
    assert usages == [Usage(11, 1, 4).as_openai(endpoint)] * len(usages) and usages
    assert not StreamRenderer(ident(endpoint), include_usage=False, continuous_usage=True).continuous_usage


def test_a_replay_with_continuous_usage_says_the_prompts_counts_first() -> None:
    whole = orjson.loads(orjson.dumps(render_response(ident("chat"), "Hi!", "stop", Usage(11, 3, 4))))
    frames = replay_as_stream("chat", whole, include_usage=True, continuous_usage=True)
    usages = [data["usage"] for _, data in parse_frames(frames[:-1])]
    assert usages[0] == Usage(11, 0, 4).as_openai("chat")
    assert usages[-1] == Usage(11, 3, 4).as_openai("chat")
    assert None not in usages


# -- Responses function calls ------------------------------------------------------------------------------------
CALL = {"id": "call_abc123", "type": "function", "function": {"name": "weather", "arguments": '{"city":"Paris"}'}}
TOOLS_SET = ResponsesSettings(tools=({"type": "function", "name": "weather", "description": None,
                                      "parameters": {"type": "object"}, "strict": None},),
                              tool_choice={"type": "function", "name": "weather"}, parallel_tool_calls=False)


def test_a_response_repeats_its_tools_settings_and_openais_defaults() -> None:
    plain = render_response(ident("responses"), "Hi", "stop", USAGE)
    assert (plain["tools"], plain["tool_choice"], plain["parallel_tool_calls"]) == ([], "auto", True)
    with_tools = render_response(ResponseIdentity("responses", "resp_abc123", "m", 1, settings=TOOLS_SET), "Hi",
                                 "stop", USAGE)
    response = Response.model_validate(with_tools)
    assert response.tools[0].type == "function" and response.tools[0].name == "weather"
    assert with_tools["tool_choice"] == {"type": "function", "name": "weather"}
    assert with_tools["parallel_tool_calls"] is False


def test_a_whole_function_call_is_a_function_call_item() -> None:
    body = render_response(ident("responses"), '{"name": "weather"}', "stop", USAGE)
    as_function_call_output(body, [CALL])
    response = Response.model_validate(body)
    (item,) = response.output
    assert item.type == "function_call" and item.model_dump(exclude_none=True) == {
        "type": "function_call", "id": "fc_abc123", "call_id": "call_abc123", "name": "weather",
        "arguments": '{"city":"Paris"}', "status": "completed"}
    assert response.status == "completed" and response.output_text == ""


def test_a_held_back_call_streams_as_openai_streams_a_function_call() -> None:
    renderer = StreamRenderer(ident("responses"), tool_call=True)
    frames = [*renderer.begin(), *renderer.delta(""), *renderer.finish_function_calls([CALL], USAGE)]
    assert validate_responses_events(frames) == [
        "response.created", "response.in_progress", "response.output_item.added",
        "response.function_call_arguments.delta", "response.function_call_arguments.done",
        "response.output_item.done", "response.completed"]
    parsed = [data for _, data in parse_frames(frames)]
    assert [data["sequence_number"] for data in parsed] == list(range(len(frames)))
    added, delta, done, item_done, completed = parsed[2:]
    assert added["item"] == {**item_done["item"], "arguments": "", "status": "in_progress"}
    assert delta["delta"] == done["arguments"] == '{"city":"Paris"}'
    assert completed["response"]["output"] == [item_done["item"]]
    assert completed["response"]["status"] == "completed"


def test_a_held_back_answer_that_is_text_opens_its_message_late() -> None:
    renderer = StreamRenderer(ident("responses"), tool_call=True)
    frames = renderer.begin()
    assert validate_responses_events(frames) == ["response.created", "response.in_progress"]
    frames += [*renderer.delta('{"na'), *renderer.finish("length", USAGE)]
    assert validate_responses_events(frames)[2:] == [
        "response.output_item.added", "response.content_part.added", "response.output_text.delta",
        "response.output_text.done", "response.content_part.done", "response.output_item.done",
        "response.incomplete"]
    assert parse_frames(frames)[-1][1]["response"]["output"][0]["content"][0]["text"] == '{"na'


def test_the_replay_of_a_function_call_streams_the_call() -> None:
    body = render_response(ResponseIdentity("responses", "resp_abc123", "m", 1, settings=TOOLS_SET), "", "stop",
                           USAGE)
    as_function_call_output(body, [CALL])
    frames = replay_as_stream("responses", orjson.loads(orjson.dumps(body)), include_usage=False)
    assert "response.function_call_arguments.delta" in validate_responses_events(frames)
    final = parse_frames(frames)[-1][1]["response"]
    assert {k: final[k] for k in ("output", "tools", "tool_choice", "parallel_tool_calls", "usage")} == \
        {k: body[k] for k in ("output", "tools", "tool_choice", "parallel_tool_calls", "usage")}


def test_text_then_calls_stream_as_a_message_item_then_function_call_items() -> None:
    renderer = StreamRenderer(ident("responses"), tool_call=True)
    frames = [*renderer.begin(), *renderer.delta("Let me look."),
              *renderer.tool_call_opened("call_abc123", "weather", 0), *renderer.tool_call_arguments('{"city"', 0),
              *renderer.tool_call_arguments(': "Paris"}', 0), *renderer.tool_call_opened("call_abc123-1", "time", 1),
              *renderer.tool_call_arguments("{}", 1), *renderer.finish("stop", USAGE)]
    assert validate_responses_events(frames)[2:] == [
        "response.output_item.added", "response.content_part.added", "response.output_text.delta",
        "response.output_text.done", "response.content_part.done", "response.output_item.done",
        "response.output_item.added", "response.function_call_arguments.delta",
        "response.function_call_arguments.delta", "response.function_call_arguments.done",
        "response.output_item.done",
        "response.output_item.added", "response.function_call_arguments.delta",
        "response.function_call_arguments.done", "response.output_item.done", "response.completed"]
    parsed = [data for _, data in parse_frames(frames)]
    assert [data["sequence_number"] for data in parsed] == list(range(len(frames)))
    final = Response.model_validate(parsed[-1]["response"])
    message, weather, time = final.output
    assert final.status == "completed" and final.output_text == "Let me look."
    assert message.type == "message"
    assert weather.type == "function_call" and (weather.id, weather.arguments) == ("fc_abc123", '{"city": "Paris"}')
    assert time.type == "function_call" and (time.id, time.call_id) == ("fc_abc123_1", "call_abc123-1")
    indexes = [(data["type"], data.get("output_index")) for data in parsed if "output_index" in data]
    assert {index for kind, index in indexes if kind.startswith("response.output_text")} == {0}
    assert {index for kind, index in indexes if kind.startswith("response.function_call")} == {1, 2}
    # The whole answer says the same, and its replay streams it again.
    body = render_response(ident("responses"), "Let me look.", "stop", USAGE)
    as_function_call_output(body, [{"id": "call_abc123", "type": "function",
                                    "function": {"name": "weather", "arguments": '{"city": "Paris"}'}},
                                   {"id": "call_abc123-1", "type": "function",
                                    "function": {"name": "time", "arguments": "{}"}}], "Let me look.")
    assert body["output"] == parsed[-1]["response"]["output"]
    replayed = replay_as_stream("responses", orjson.loads(orjson.dumps(body)), include_usage=False)
    assert parse_frames(replayed)[-1][1]["response"]["output"] == body["output"]


def test_chat_tool_call_deltas_carry_the_id_and_name_first_then_the_arguments_in_pieces() -> None:
    renderer = StreamRenderer(ident("chat"), tool_call=True)
    frames = [*renderer.tool_call_opened("call_abc123", "weather", 0, choice=1),
              *renderer.tool_call_arguments('{"city"', 0, choice=1), *renderer.tool_call_arguments("", 0, choice=1)]
    chunks = [ChatCompletionChunk.model_validate(data) for _, data in parse_frames(frames)]
    assert len(chunks) == 2  # an empty piece sends nothing
    first, second = (chunk.choices[0] for chunk in chunks)
    assert first.index == second.index == 1
    (opened,) = first.delta.tool_calls or []
    assert (opened.index, opened.id, opened.type) == (0, "call_abc123", "function")
    assert opened.function is not None and (opened.function.name, opened.function.arguments) == ("weather", "")
    (piece,) = second.delta.tool_calls or []
    assert piece.id is None and piece.function is not None and piece.function.arguments == '{"city"'

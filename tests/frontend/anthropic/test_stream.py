"""A chat stream as Anthropic's event stream, whatever its chunking."""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import Any

import orjson
import pydantic
import pytest
from anthropic.types import RawMessageStreamEvent

from frontend.anthropic.stream import messages_events
from frontend.errors import UpstreamError, sse_error_event
from frontend.logging_setup import request_id_var
from frontend.sse import DONE_FRAME, data_frame

EVENTS = pydantic.TypeAdapter(RawMessageStreamEvent)


def chunk(delta: dict[str, Any] | None = None, finish: str | None = None, usage: dict[str, Any] | None = None
          ) -> bytes:
    choices = [] if delta is None else [{"index": 0, "delta": delta, "logprobs": None, "finish_reason": finish}]
    return data_frame({"id": "chatcmpl-7", "object": "chat.completion.chunk", "created": 1, "model": "m",
                       "choices": choices, "usage": usage})


USAGE = {"prompt_tokens": 9, "completion_tokens": 2, "total_tokens": 11, "prompt_tokens_details": {"cached_tokens": 0}}


async def events_of(frames: list[bytes], piece: int | None = None, stops: tuple[str, ...] = ()
                    ) -> list[tuple[str, dict[str, Any]]]:
    raw = b"".join(frames)
    pieces = [raw[i:i + piece] for i in range(0, len(raw), piece)] if piece else frames

    async def source() -> AsyncIterator[bytes]:
        for p in pieces:
            yield p

    out = b"".join([e async for e in messages_events(source(), stops)])
    parsed = []
    for frame in out.decode().split("\n\n"):
        if frame:
            name, data = frame.split("\n")
            parsed.append((name.removeprefix("event: "), orjson.loads(data.removeprefix("data: "))))
    return parsed


async def test_text_stream_in_any_chunking() -> None:
    frames = [chunk({"role": "assistant", "content": ""}), chunk({"content": "He"}), chunk({"content": "llo"}),
              chunk({}, "length"), chunk(usage=USAGE), DONE_FRAME]
    whole = await events_of(frames)
    assert whole == await events_of(frames, piece=7)
    assert [name for name, _ in whole] == ["message_start", "ping", "content_block_start", "content_block_delta",
                                           "content_block_delta", "content_block_stop", "message_delta",
                                           "message_stop"]
    assert all(name == payload["type"] for name, payload in whole)
    start = whole[0][1]["message"]
    assert start["id"] == "msg_7" and start["content"] == [] and start["stop_reason"] is None
    assert [p["delta"]["text"] for n, p in whole if n == "content_block_delta"] == ["He", "llo"]
    assert whole[-2][1] == {"type": "message_delta", "delta": {"stop_reason": "max_tokens", "stop_sequence": None},
                            "usage": {"input_tokens": 9, "output_tokens": 2, "cache_creation_input_tokens": 0,
                                      "cache_read_input_tokens": 0}}
    for name, payload in whole:
        if name != "ping":
            EVENTS.validate_python(payload)


async def test_message_start_carries_the_prompts_counts_from_the_first_chunk() -> None:
    # The chat stream is asked for usage on every chunk: its first says the prompt's, as Anthropic's message_start.
    first = {"prompt_tokens": 9, "completion_tokens": 0, "total_tokens": 9,
             "prompt_tokens_details": {"cached_tokens": 4}}
    last = {**first, "completion_tokens": 2, "total_tokens": 11}
    events = await events_of([chunk({"role": "assistant", "content": ""}, usage=first),
                              chunk({"content": "Hi"}, usage={**first, "completion_tokens": 1}),
                              chunk({}, "length", usage=last), chunk(usage=last), DONE_FRAME])
    start = events[0][1]["message"]["usage"]
    assert start == {"input_tokens": 5, "output_tokens": 0, "cache_creation_input_tokens": 0,
                     "cache_read_input_tokens": 4}
    assert events[-2][1]["usage"] == {**start, "output_tokens": 2}
    EVENTS.validate_python(events[0][1])


async def test_a_tool_call_is_a_tool_use_block() -> None:
    call = {"index": 0, "id": "call_7", "type": "function", "function": {"name": "f", "arguments": '{"a": 1}'}}
    events = await events_of([chunk({"role": "assistant", "content": ""}), chunk({"tool_calls": [call]}),
                              chunk({}, "tool_calls"), chunk(usage=USAGE), DONE_FRAME])
    assert [name for name, _ in events][2:] == ["content_block_start", "content_block_delta", "content_block_stop",
                                                "message_delta", "message_stop"]
    assert events[2][1]["content_block"] == {"type": "tool_use", "id": "toolu_7", "name": "f", "input": {}}
    assert events[3][1]["delta"] == {"type": "input_json_delta", "partial_json": '{"a": 1}'}  # as generated
    assert events[-2][1]["delta"]["stop_reason"] == "tool_use"


async def test_text_then_calls_streamed_in_pieces_are_a_text_block_then_tool_use_blocks() -> None:
    def opened(index: int, call_id: str, name: str) -> dict[str, Any]:
        return {"tool_calls": [{"index": index, "id": call_id, "type": "function",
                                "function": {"name": name, "arguments": ""}}]}

    def piece(index: int, text: str) -> dict[str, Any]:
        return {"tool_calls": [{"index": index, "function": {"arguments": text}}]}

    frames = [chunk({"role": "assistant", "content": ""}), chunk({"content": "Let me look."}),
              chunk(opened(0, "call_7", "f")), chunk(piece(0, '{"a"')), chunk(piece(0, ": 1}")),
              chunk(opened(1, "call_7-1", "g")), chunk(piece(1, "{}")), chunk({}, "tool_calls"), chunk(usage=USAGE),
              DONE_FRAME]
    events = await events_of(frames)
    starts = [payload["content_block"] for name, payload in events if name == "content_block_start"]
    assert starts == [{"type": "text", "text": ""}, {"type": "tool_use", "id": "toolu_7", "name": "f", "input": {}},
                      {"type": "tool_use", "id": "toolu_7-1", "name": "g", "input": {}}]
    json_pieces = [(payload["index"], payload["delta"]["partial_json"]) for name, payload in events
                   if name == "content_block_delta" and payload["delta"]["type"] == "input_json_delta"]
    assert json_pieces == [(1, '{"a"'), (1, ": 1}"), (2, "{}")]
    stops = [payload["index"] for name, payload in events if name == "content_block_stop"]
    assert stops == [0, 1, 2]
    assert events[-2][1]["delta"]["stop_reason"] == "tool_use"


async def test_a_failed_stream_ends_with_an_error_event() -> None:
    events = await events_of([chunk({"role": "assistant", "content": ""}), chunk({"content": "x"}),
                              sse_error_event(UpstreamError("the GEN worker failed")), DONE_FRAME])
    name, payload = events[-1]
    assert name == "error"
    assert payload == {"type": "error", "error": {"type": "api_error", "message": "the GEN worker failed"}}
    assert "message_stop" not in [n for n, _ in events]


async def test_a_chunk_that_cannot_be_translated_ends_the_stream_with_an_error_event_logged(
        caplog: pytest.LogCaptureFixture) -> None:
    closed: list[bool] = []

    async def source() -> AsyncIterator[bytes]:
        try:
            yield chunk({"role": "assistant", "content": ""}) + chunk({"content": "x"})
            yield b"data: {not json\n\n"
            yield chunk({"content": "never read"})
        finally:
            closed.append(True)

    token = request_id_var.set("req-7")
    try:
        out = b"".join([e async for e in messages_events(source())])
    finally:
        request_id_var.reset(token)
    *_, last = [frame for frame in out.decode().split("\n\n") if frame]
    assert last.startswith("event: error\n")
    assert orjson.loads(last.split("\n")[1].removeprefix("data: "))["error"]["type"] == "api_error"
    assert closed == [True]  # the chat stream is closed: GEN stops
    (record,) = [r for r in caplog.records if r.name == "disagg_serve.messages"]
    assert "req-7" in record.getMessage() and record.exc_info is not None  # the request id and the cause


def with_logprobs(frame: bytes, *tokens: bytes) -> bytes:
    payload = orjson.loads(frame.removeprefix(b"data: "))
    payload["choices"][0]["logprobs"] = {"content": [{"token": "", "logprob": 0.0, "bytes": list(t),
                                                      "top_logprobs": []} for t in tokens], "refusal": None}
    return data_frame(payload)


async def test_a_stop_sequence_is_told_in_message_delta() -> None:
    frames = [chunk({"role": "assistant", "content": ""}), with_logprobs(chunk({"content": "He"}), b"He"),
              with_logprobs(chunk({"content": "y"}), b"y", b" S"), with_logprobs(chunk({}, "stop"), b"TOP"),
              chunk(usage=USAGE), DONE_FRAME]
    events = await events_of(frames, stops=(" STOP",))
    assert events[-2][1]["delta"] == {"stop_reason": "stop_sequence", "stop_sequence": " STOP"}
    assert all("logprobs" not in payload.get("delta", {}) for _, payload in events)
    assert (await events_of(frames, stops=("nope",)))[-2][1]["delta"] == {"stop_reason": "end_turn",
                                                                           "stop_sequence": None}

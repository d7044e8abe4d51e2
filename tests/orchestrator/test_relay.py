"""The streaming relay over scripted streams: bytes passed on untouched, a broken or truncated GEN stream ended
with an error event, the load counted while it runs, and the stream closed however the relay ends."""

from __future__ import annotations

import time
from collections.abc import AsyncGenerator

import orjson
import pytest

from frontend.errors import UpstreamError
from frontend.metrics import Metrics
from frontend.openai_output import Endpoint
from frontend.sse import DONE_FRAME
from orchestrator.member import PoolMember
from orchestrator.relay import relay_stream
from tests.orchestrator.scripted_transport import ScriptedStream, ScriptedTransport

CHAT = [b'data: {"choices": [{"delta": {"content": "Th"}}]}\n\n', b'data: {"choices": [{"delta": ', b'{}}]}\n\n',
        DONE_FRAME]


@pytest.fixture
def member() -> PoolMember:
    member = PoolMember(ScriptedTransport("http://gen:1"))
    member.healthy = True
    return member


def relay(stream: ScriptedStream, member: PoolMember, endpoint: Endpoint = "chat") -> AsyncGenerator[bytes, None]:
    return relay_stream(stream, member, 42, endpoint, time.perf_counter(), Metrics())


async def test_a_whole_stream_is_relayed_byte_for_byte_and_closed(member: PoolMember) -> None:
    stream = ScriptedStream(200, CHAT)
    received = []
    async for chunk in relay(stream, member):
        assert (member.inflight, member.inflight_prompt_tokens) == (1, 42)
        received.append(chunk)
    assert received == CHAT
    assert stream.closed
    assert (member.inflight, member.inflight_prompt_tokens) == (0, 0)


def error_of(frames: list[bytes]) -> dict[str, object]:
    error = orjson.loads(frames[-2].removeprefix(b"data: "))["error"]
    assert isinstance(error, dict)
    return error


async def test_a_stream_that_breaks_ends_with_an_error_then_done(member: PoolMember) -> None:
    stream = ScriptedStream(200, CHAT[:1], fails_with=UpstreamError("worker http://gen:1 failed: ReadError"))
    frames = [chunk async for chunk in relay(stream, member)]
    assert frames[0] == CHAT[0]
    assert frames[-1] == DONE_FRAME
    error = error_of(frames)
    assert error["code"] == "upstream_error"
    assert error["message"] == "the GEN stream broke: worker http://gen:1 failed: ReadError"
    assert stream.closed
    assert member.inflight == 0


async def test_a_stream_that_ends_before_its_end_marker_ends_with_an_error(member: PoolMember) -> None:
    stream = ScriptedStream(200, CHAT[:2])
    frames = [chunk async for chunk in relay(stream, member)]
    assert frames[:2] == CHAT[:2]
    assert error_of(frames)["message"] == "the GEN stream ended before it was complete"


async def test_a_responses_stream_ends_with_an_error_event(member: PoolMember) -> None:
    stream = ScriptedStream(200, [b'event: response.created\ndata: {}\n\n'])
    frames = [chunk async for chunk in relay(stream, member, "responses")]
    assert frames[-1].startswith(b"event: error\n")
    completed = ScriptedStream(200, [b'event: response.completed\ndata: {}\n\n'])
    assert [chunk async for chunk in relay(completed, member, "responses")] == completed.parts


@pytest.mark.parametrize("broken", [False, True], ids=["ended-early", "broke"])
async def test_a_responses_error_event_goes_on_with_the_streams_sequence_numbers(
    member: PoolMember, broken: bool
) -> None:
    sent = [b'event: response.created\ndata: {"type":"response.created","sequence_number":0}\n\n',
            b'event: response.in_progress\ndata: {"type":"response.in_progress","sequence_number":1}\n\n',
            b'event: response.output_text.delta\ndata: {"type":"response.output_text.delta","seq']  # cut short
    failure = UpstreamError("worker http://gen:1 failed: ReadError") if broken else None
    stream = ScriptedStream(200, sent, fails_with=failure)
    frames = [chunk async for chunk in relay(stream, member, "responses")]
    assert frames[:3] == sent
    error = orjson.loads(frames[-1].partition(b"data: ")[2])
    assert error["type"] == "error" and error["sequence_number"] == 2  # after GEN's last whole event, not 0


async def test_a_client_that_leaves_mid_stream_closes_the_upstream_stream(member: PoolMember) -> None:
    stream = ScriptedStream(200, CHAT)
    frames = relay(stream, member)
    assert await anext(frames) == CHAT[0]
    assert member.inflight == 1
    await frames.aclose()  # what the server does when the client goes away
    assert stream.closed
    assert stream.iterated == CHAT[:1]
    assert member.inflight == 0

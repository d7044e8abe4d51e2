"""The streaming relay over scripted streams, iterated and pushed: bytes passed on untouched, a broken or truncated
GEN stream ended with an error event, the load counted while it runs, and the stream closed however the relay
ends."""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncGenerator
from types import SimpleNamespace
from typing import Any, cast

import orjson
import pytest

from frontend.errors import EngineError, UpstreamError
from frontend.metrics import Metrics
from frontend.openai_output import Endpoint, stream_error_frames
from frontend.sse import DONE_FRAME
from orchestrator.flow.migration import Migration, Migrations
from orchestrator.flow.request import FlowRequest
from orchestrator.member import PoolMember
from orchestrator.relay import RelayedStream, relay_stream
from orchestrator.routers import RoutingKey
from tests.orchestrator.upstream.scripted_transport import ScriptedStream, ScriptedTransport
from tests.waiting import DEFAULT_TIMEOUT_S, eventually_async

CHAT = [b'data: {"choices": [{"delta": {"content": "Th"}}]}\n\n', b'data: {"choices": [{"delta": ', b'{}}]}\n\n',
        DONE_FRAME]


@pytest.fixture
def member() -> PoolMember:
    member = PoolMember(ScriptedTransport("http://gen:1"))
    member.healthy = True
    return member


def relay(stream: ScriptedStream, member: PoolMember, endpoint: Endpoint = "chat") -> AsyncGenerator[bytes, None]:
    return relay_stream(stream, member, 42, endpoint, time.perf_counter(), Metrics())


@pytest.fixture(params=["iterated", "pushed"])
def mode(request: pytest.FixtureRequest) -> str:
    return str(request.param)


class Client:
    """What a pushed relay hands the client's answer: its pieces, and the one it ended the answer with."""

    def __init__(self, behind_every: int = 0) -> None:
        self.written: list[bytes] = []
        self.last: bytes | None = None
        self.behind_every = behind_every  # say "behind" after every so many pieces (0: never)

    def write(self, chunk: bytes) -> bool:
        assert self.last is None, "a piece written after the answer ended"
        self.written.append(chunk)
        return not self.behind_every or len(self.written) % self.behind_every != 0

    def finish(self, chunk: bytes) -> None:
        assert self.last is None, "the answer ended twice"
        self.written.append(chunk)
        self.last = chunk


async def _never_behind() -> None:
    raise AssertionError("a client that keeps up is never waited for")


async def relayed(stream: ScriptedStream, member: PoolMember, mode: str, endpoint: Endpoint = "chat") -> list[bytes]:
    """Everything the client gets, the relay iterated or pushed."""
    if mode == "iterated":
        return [chunk async for chunk in relay(stream, member, endpoint)]
    client = Client()
    await RelayedStream(stream, member, 42, endpoint, time.perf_counter(), Metrics()).push(
        client.write, _never_behind, client.finish)
    return client.written


@pytest.mark.parametrize("tail", [[], [b"0 trailing bytes"]], ids=["marker-last", "bytes-after-marker"])
async def test_a_gen_that_stalls_after_its_end_marker_is_given_up_on_and_its_stream_closed(
    member: PoolMember, mode: str, tail: list[bytes], caplog: pytest.LogCaptureFixture
) -> None:
    # The client's answer is whole at the marker: GEN's stalled tail must not keep the relay (and the client's
    # connection, its request's slots) until the worker read timeout. A small tail here; 2 s by default.
    stream = ScriptedStream(200, CHAT + tail, stalls=True)
    relayed_stream = RelayedStream(stream, member, 42, "chat", time.perf_counter(), Metrics(), tail_s=0.01)
    async with asyncio.timeout(DEFAULT_TIMEOUT_S):  # a hang guard only
        if mode == "iterated":
            frames = [chunk async for chunk in relayed_stream.frames()]
            assert frames == CHAT + tail  # what came after the marker in time is passed on, as before
        else:
            client = Client()
            await relayed_stream.push(client.write, _never_behind, client.finish)
            assert client.written == CHAT and client.last == DONE_FRAME
    assert stream.closed and member.inflight == 0
    assert "did not end its stream within 0.01 s of its end marker" in caplog.text


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


async def test_a_stream_that_breaks_ends_with_an_error_then_done(member: PoolMember, mode: str) -> None:
    stream = ScriptedStream(200, CHAT[:1], fails_with=UpstreamError("worker http://gen:1 failed: ReadError"))
    frames = await relayed(stream, member, mode)
    assert frames[0] == CHAT[0]
    assert frames[-1] == DONE_FRAME
    error = error_of(frames)
    assert error["code"] == "upstream_error"
    assert error["message"] == "the GEN stream broke: worker http://gen:1 failed: ReadError"
    assert stream.closed
    assert member.inflight == 0


async def test_a_stream_that_ends_before_its_end_marker_ends_with_an_error(member: PoolMember, mode: str) -> None:
    stream = ScriptedStream(200, CHAT[:2])
    frames = await relayed(stream, member, mode)
    assert frames[:2] == CHAT[:2]
    assert error_of(frames)["message"] == "the GEN stream ended before it was complete"


async def test_a_responses_stream_ends_with_an_error_event(member: PoolMember, mode: str) -> None:
    stream = ScriptedStream(200, [b'event: response.created\ndata: {}\n\n'])
    frames = await relayed(stream, member, mode, "responses")
    assert frames[-1].startswith(b"event: error\n")
    completed = ScriptedStream(200, [b'event: response.completed\ndata: {}\n\n'])
    assert await relayed(completed, member, mode, "responses") == completed.parts


@pytest.mark.parametrize("joined", [False, True], ids=["piece-per-event", "one-piece"])
@pytest.mark.parametrize("broken", [False, True], ids=["ended-early", "broke"])
async def test_a_responses_error_event_goes_on_with_the_streams_sequence_numbers(
    member: PoolMember, broken: bool, joined: bool, mode: str
) -> None:
    sent = [b'event: response.created\ndata: {"type":"response.created","sequence_number":0}\n\n',
            b'event: response.in_progress\ndata: {"type":"response.in_progress","sequence_number":1}\n\n',
            b'event: response.output_text.delta\ndata: {"type":"response.output_text.delta","seq']  # cut short
    if joined:  # the last whole event is cut from a piece that holds two, and the begun third
        sent = [b"".join(sent)]
    failure = UpstreamError("worker http://gen:1 failed: ReadError") if broken else None
    stream = ScriptedStream(200, sent, fails_with=failure)
    frames = await relayed(stream, member, mode, "responses")
    assert frames[:len(sent)] == sent
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


async def test_a_pushed_relay_waits_for_a_client_that_is_behind_and_reads_on(member: PoolMember) -> None:
    stream = ScriptedStream(200, CHAT)
    client = Client(behind_every=2)
    waits: list[int] = []

    async def drained() -> None:
        waits.append(len(client.written))

    await RelayedStream(stream, member, 42, "chat", time.perf_counter(), Metrics()).push(
        client.write, drained, client.finish)
    assert client.written == CHAT
    assert waits == [2]  # (the last piece ends the answer: nothing is written after it to wait for)
    assert stream.closed and member.inflight == 0


@pytest.mark.parametrize("parts", [
    [b"data: {}\n\ndata: [DO", b"NE]\n\n"],  # the end marker split between two pieces
    [b"data: {}\n\ndata: [DONE]\n\n"],  # in one piece behind another frame
    [b"data: {}\n", b"\n", DONE_FRAME],  # a frame's blank line split
], ids=["marker-split", "two-frames-one-piece", "blank-line-split"])
async def test_the_end_marker_is_found_however_the_stream_is_cut(member: PoolMember, mode: str,
                                                                 parts: list[bytes]) -> None:
    assert await relayed(ScriptedStream(200, parts), member, mode) == parts


async def test_an_end_marker_inside_a_frame_is_not_the_streams_end(member: PoolMember, mode: str) -> None:
    parts = [b'data: {"text": "event: error data: [DONE]\n"}\n\n']
    frames = await relayed(ScriptedStream(200, parts), member, mode)
    assert error_of(frames)["message"] == "the GEN stream ended before it was complete"


async def test_a_client_that_leaves_a_pushed_relay_closes_the_upstream_stream(member: PoolMember) -> None:
    gate = asyncio.Event()

    class Held(ScriptedStream):
        async def chunks(self) -> AsyncGenerator[bytes, None]:
            try:
                yield self.parts[0]
                await gate.wait()  # GEN has more to say, the client leaves first
                yield self.parts[1]
            finally:
                await self.aclose()

    stream = Held(200, CHAT)
    client = Client()

    async def drained() -> None:
        pass

    task = asyncio.ensure_future(RelayedStream(stream, member, 42, "chat", time.perf_counter(), Metrics())
                                 .push(client.write, drained, client.finish))
    assert await eventually_async(lambda: client.written == CHAT[:1])
    assert member.inflight == 1
    task.cancel()  # what the exchange does when the client goes away
    with pytest.raises(asyncio.CancelledError):
        await task
    assert stream.closed and member.inflight == 0


@pytest.mark.parametrize("parts", [
    [b"data: {}\n\ndata: [DO", b"NE]\n\n"],
    [b"data: {}\n\n", DONE_FRAME],
], ids=["marker-split", "marker-alone"])
async def test_the_end_marker_is_told_once_as_it_passes(member: PoolMember, mode: str, parts: list[bytes]) -> None:
    """``on_end`` says the answer is whole as soon as its end marker has passed, before GEN's stream itself has
    ended: a client may hang up at ``[DONE]`` (the openai SDK does) before the rest is read."""
    client = Client()
    written = client.written
    told: list[int] = []
    relayed = RelayedStream(ScriptedStream(200, parts), member, 42, "chat", time.perf_counter(), Metrics(),
                            lambda: told.append(len(written)))
    if mode == "iterated":
        async for chunk in relayed.frames():
            written.append(chunk)
    else:
        await relayed.push(client.write, _never_behind, client.finish)
    assert written == parts
    assert told == [len(parts) - 1]  # once, while the piece with the marker was on its way to the client


async def test_a_stream_without_its_end_marker_is_never_told_whole(member: PoolMember, mode: str) -> None:
    told: list[int] = []
    relayed = RelayedStream(ScriptedStream(200, [b"data: {}\n\n"]), member, 42, "chat", time.perf_counter(),
                            Metrics(), lambda: told.append(1))
    if mode == "iterated":
        _ = [chunk async for chunk in relayed.frames()]
    else:
        client = Client()
        await relayed.push(client.write, _never_behind, client.finish)
        assert client.last is None
    assert told == []


@pytest.mark.parametrize(("parts", "last"), [
    ([b"data: {}\n\n", DONE_FRAME], DONE_FRAME),
    ([b"data: {}\n\ndata: [DONE]\n\n"], b"data: {}\n\ndata: [DONE]\n\n"),
    ([b"data: {}\n\ndata: [DO", b"NE]\n\n"], b"NE]\n\n"),
    ([b"event: response.created\ndata: {}\n\n", b"event: response.completed\ndata: {}\n\n"],
     b"event: response.completed\ndata: {}\n\n"),
], ids=["done", "done-behind-a-frame", "done-split", "responses-completed"])
async def test_a_pushed_relay_ends_the_answer_with_the_piece_that_holds_the_end_marker(
    member: PoolMember, parts: list[bytes], last: bytes
) -> None:
    """The piece with the end marker goes to ``finish`` (the exchange ends the answer in that piece's send), and
    what GEN sends after it reaches the client no more than a break after it does: the answer was whole."""
    after = [b"data: {}\n\n"]  # nothing may follow the end marker: not relayed
    stream = ScriptedStream(200, [*parts, *after], fails_with=UpstreamError("worker http://gen:1 failed: ReadError"))
    client = Client()
    await RelayedStream(stream, member, 42, "chat", time.perf_counter(), Metrics()).push(
        client.write, _never_behind, client.finish)
    assert client.last == last
    assert client.written == parts
    assert stream.closed and member.inflight == 0


async def test_a_responses_error_event_does_not_end_a_pushed_answer(member: PoolMember) -> None:
    """An ``event: error`` ends the stream as far as the relay's check goes, but another engine's Responses stream
    may follow it with more events: they are relayed, and the answer ends when GEN's stream does."""
    parts = [b"event: error\ndata: {}\n\n", b"event: response.failed\ndata: {}\n\n"]
    client = Client()
    await RelayedStream(ScriptedStream(200, parts), member, 42, "responses", time.perf_counter(), Metrics()).push(
        client.write, _never_behind, client.finish)
    assert client.written == parts and client.last is None


async def test_a_stream_that_broke_is_read_no_further_while_the_client_waits(member: PoolMember, mode: str) -> None:
    # Once GEN's stream broke (its error event; a continuation that replayed other tokens than the client has),
    # nothing more of it reaches the client: what GEN writes on (a whole answer, decoded to its end) must not hold
    # the client, who gets the relay's error event at once, and GEN's stream is closed.
    migrations = Migrations(0, cast(Any, SimpleNamespace(metrics=Metrics())))  # (no move allowed: the error stands)
    migration = Migration(FlowRequest("chat", {}, RoutingKey(), 0.0), migrations)
    tagged = b': token_ids 5\ndata: {"id":"chatcmpl-a1","created":1,"choices":[{"delta":{"content":"x"}}]}\n\n'
    error = b"".join(stream_error_frames("chat", EngineError("the engine failed")))
    stream = ScriptedStream(200, [tagged, error, tagged], stalls=True)
    relayed_stream = RelayedStream(stream, member, 42, "chat", time.perf_counter(), Metrics(), migration=migration)
    async with asyncio.timeout(DEFAULT_TIMEOUT_S):  # a hang guard only
        if mode == "iterated":
            frames = [chunk async for chunk in relayed_stream.frames()]
        else:
            client = Client()
            await relayed_stream.push(client.write, _never_behind, client.finish)
            frames = client.written
    assert frames[0] == tagged.partition(b"\n")[2] and frames[-1] == DONE_FRAME
    assert b"the engine failed" in b"".join(frames[1:])
    assert stream.closed and member.inflight == 0

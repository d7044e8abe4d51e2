from __future__ import annotations

import itertools

import orjson
from hypothesis import given
from hypothesis import strategies as st

from frontend.sse import DONE_FRAME, FrameSplitter, data_frame, event_frame

json_scalars = st.one_of(st.integers(min_value=-(2**63), max_value=2**63 - 1), st.text(max_size=20))
payloads = st.dictionaries(st.text(max_size=8), json_scalars, max_size=4)


def test_data_and_event_frames() -> None:
    assert data_frame({"a": 1}) == b'data: {"a":1}\n\n'
    assert event_frame("response.created", {"b": "x"}) == b'event: response.created\ndata: {"b":"x"}\n\n'
    assert DONE_FRAME == b"data: [DONE]\n\n"


def test_newlines_inside_payload_strings_are_escaped() -> None:
    frame = data_frame({"text": "a\n\nb"})
    assert frame.count(b"\n\n") == 1
    assert orjson.loads(frame[6:])["text"] == "a\n\nb"


@st.composite
def chunked_streams(draw: st.DrawFn) -> tuple[list[bytes], list[bytes]]:
    frames = [data_frame(p) if draw(st.booleans()) else event_frame("e.t", p)
              for p in draw(st.lists(payloads, max_size=8))]
    frames.append(DONE_FRAME)
    stream = b"".join(frames)
    cuts = sorted(draw(st.lists(st.integers(min_value=0, max_value=len(stream)), max_size=20)))
    bounds = [0, *cuts, len(stream)]
    return frames, [stream[a:b] for a, b in itertools.pairwise(bounds)]


@given(chunked_streams())
def test_splitter_recovers_every_frame_whatever_the_chunking(case: tuple[list[bytes], list[bytes]]) -> None:
    frames, chunks = case
    splitter = FrameSplitter()
    out: list[bytes] = []
    for chunk in chunks:
        out.extend(splitter.feed(chunk))
    assert out == frames
    assert splitter.feed(DONE_FRAME) == [DONE_FRAME]  # nothing was left over to prefix the next frame


def test_incomplete_frame_stays_pending() -> None:
    splitter = FrameSplitter()
    assert splitter.feed(b"data: {}\n") == []
    assert splitter.feed(b"\ndata: [DO") == [b"data: {}\n\n"]
    assert splitter.feed(b"NE]\n\n") == [DONE_FRAME]

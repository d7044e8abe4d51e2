"""The streaming relay: GEN's stream to the client, byte for byte, ended with an error event if GEN's breaks.

The bytes are passed on as they arrive; the frames are only watched for the stream's end marker, so a GEN that
died mid-way (the connection broke, or ended before its last frame) still leaves the client a well-formed
stream that says what went wrong.
"""

from __future__ import annotations

import logging
import time
from collections.abc import AsyncGenerator
from contextlib import aclosing

import orjson

from frontend.errors import UpstreamError
from frontend.metrics import Metrics
from frontend.openai_output import Endpoint, stream_error_frames
from frontend.sse import DONE_FRAME, FrameSplitter
from orchestrator.member import PoolMember
from orchestrator.transport import OpenStream

logger = logging.getLogger(__name__)

_STREAM_ENDS = (DONE_FRAME, b"event: response.completed", b"event: response.incomplete", b"event: error")


async def relay_stream(
    stream: OpenStream,
    member: PoolMember,
    prompt_tokens: int,
    endpoint: Endpoint,
    started: float,
    metrics: Metrics,
) -> AsyncGenerator[bytes, None]:
    """Relay ``stream`` (GEN's 200 answer) and close it, however the relay ends; ``started`` is when the
    client's request arrived (for time to first token)."""
    splitter = FrameSplitter()
    seen_end = False
    last_frame: bytes | None = None  # the last whole frame GEN sent: a Responses error event numbers on from it
    last: float | None = None
    failure: UpstreamError | None = None
    with member.carrying(prompt_tokens, 0):  # its first byte came: the prompt is computed
        try:
            async with aclosing(stream.chunks()) as chunks:
                async for chunk in chunks:
                    now = time.perf_counter()
                    if last is None:
                        metrics.time_to_first_token.observe(now - started)
                    else:
                        metrics.inter_token_latency.observe(now - last)
                    last = now
                    for frame in splitter.feed(chunk):
                        last_frame = frame
                        if frame.startswith(_STREAM_ENDS):
                            seen_end = True
                    yield chunk
        except UpstreamError as exc:
            failure = UpstreamError(f"the GEN stream broke: {exc.message}")
        finally:
            await stream.aclose()
    if failure is None and not seen_end:
        failure = UpstreamError("the GEN stream ended before it was complete")
    if failure is not None:
        logger.warning("%s (GEN worker %s)", failure.message, member.url)
        for frame in stream_error_frames(endpoint, failure, next_sequence_number(last_frame)):
            yield frame


def next_sequence_number(frame: bytes | None) -> int:
    """The ``sequence_number`` that follows the Responses event ``frame`` (0 when GEN sent none), so the relay's
    error event goes on with GEN's numbering rather than restart it. Read only when a stream fails: the relay
    itself never parses what it passes on."""
    if frame is None:
        return 0
    _, _, data = frame.partition(b"data: ")
    try:
        number = orjson.loads(data)["sequence_number"]
    except (orjson.JSONDecodeError, KeyError, TypeError):
        return 0  # not a Responses event (chat and completions streams have no numbers)
    return number + 1 if isinstance(number, int) else 0

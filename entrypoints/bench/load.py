"""The request driver: streamed requests over one pooled httpx client, each timed into a ``Record``.

Two ways to put load on: a closed loop of ``concurrency`` clients (``run_client``: each sends its next request
when the last one ended) or an open loop at a request rate (``poisson_arrivals``: exponential gaps, so requests
arrive whether or not the earlier ones finished, as independent users do).

A streamed answer is read as raw bytes. With ``detail`` off (the project's own CPU benchmarks) only its last
bytes are kept, to check the ``[DONE]`` marker, so the load generator costs next to nothing per chunk. With
``detail`` on (``disagg-serve bench``) each SSE event is timed: the first content event is the time to first
token, the gaps between content events are the inter-token latencies, and the final usage chunk (asked for with
``stream_options.include_usage``) gives the output tokens; servers that send no usage are counted by events.
"""

from __future__ import annotations

import asyncio
import random
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass, field

import httpx
import orjson

JSON_HEADERS = {"Content-Type": "application/json"}
_FAILURE_PAUSE_S = 0.05  # a failing server must not turn a closed loop into a busy spin


class StreamError(Exception):
    """The server answered, but not with a complete 200 stream."""

    def __init__(self, message: str, kind: str) -> None:
        super().__init__(message)
        self.kind = kind


@dataclass
class Record:
    """One request, as the client saw it (``time.perf_counter`` seconds)."""

    started: float
    first: float | None = None  # first byte (detail off) or first content event (detail on)
    ended: float | None = None
    ok: bool = False
    error: str | None = None
    error_kind: str | None = None  # http_<status>, timeout, connection, protocol, incomplete_stream
    in_window: bool = False
    token_times: list[float] = field(default_factory=list)  # detail: each content event's arrival
    output_tokens: int | None = None  # detail: from the usage chunk, else the count of content events
    prompt_tokens: int | None = None  # detail: from the usage chunk

    def failed(self, exc: BaseException) -> None:
        self.error = f"{type(exc).__name__}: {exc}"[:300]
        self.error_kind = error_kind(exc)


def error_kind(exc: BaseException) -> str:
    """A short, stable name for what went wrong, for the errors-by-kind table."""
    if isinstance(exc, StreamError):
        return exc.kind
    if isinstance(exc, httpx.TimeoutException):
        return "timeout"
    if isinstance(exc, httpx.TransportError):
        return "connection"
    return "protocol"  # not JSON, or not the shape of an OpenAI answer


LOAD_ERRORS = (httpx.HTTPError, StreamError, KeyError, IndexError, TypeError, orjson.JSONDecodeError)


async def consume_stream(response: httpx.Response, record: Record, detail: bool = False) -> None:
    """Read a streamed answer to its end into ``record``; ``StreamError`` if it is not a complete 200 stream."""
    if response.status_code != 200:
        body = await response.aread()
        raise StreamError(f"status {response.status_code}: {body[:200]!r}", f"http_{response.status_code}")
    if detail:
        await _timed_events(response.aiter_raw(), record)
        return
    tail = b""
    async for chunk in response.aiter_raw():
        if not chunk:
            continue
        if record.first is None:
            record.first = time.perf_counter()
        tail = (tail + chunk)[-64:]
    if b"[DONE]" not in tail:
        raise StreamError("the stream ended without [DONE]", "incomplete_stream")


async def _timed_events(chunks: AsyncIterator[bytes], record: Record) -> None:
    pending = b""
    done = False
    counted = 0
    async for chunk in chunks:
        now = time.perf_counter()
        pending += chunk
        *events, pending = pending.split(b"\n\n")
        for event in events:
            data = event.strip()
            if not data.startswith(b"data:"):
                continue  # a comment, or an event name line of another server's dialect
            data = data[5:].strip()
            if data == b"[DONE]":
                done = True
            elif b'"usage":{' in data or b'"usage": {' in data:
                usage = orjson.loads(data).get("usage") or {}
                record.output_tokens = usage.get("completion_tokens")
                record.prompt_tokens = usage.get("prompt_tokens")
                if _has_content(data):
                    counted += 1
                    record.token_times.append(now)
            elif _has_content(data):
                counted += 1
                record.token_times.append(now)
    if not done:
        raise StreamError("the stream ended without [DONE]", "incomplete_stream")
    if record.token_times:
        record.first = record.token_times[0]
    if record.output_tokens is None:
        record.output_tokens = counted


def _has_content(data: bytes) -> bool:
    """An event that carries output (completions' text, chat's delta content), not just a role or a finish."""
    return (b'"text":"' in data and b'"text":""' not in data) or \
        (b'"content":"' in data and b'"content":""' not in data)


async def post_streamed(client: httpx.AsyncClient, url: str, body: bytes, record: Record,
                        detail: bool = False, headers: dict[str, str] | None = None) -> None:
    async with client.stream("POST", url, content=body, headers=headers or JSON_HEADERS) as response:
        await consume_stream(response, record, detail)


async def send(request: Callable[[Record], Awaitable[None]], record: Record,
               done: Callable[[Record], None] | None = None) -> Record:
    """Run one request into ``record``: ``ok``, or the error and its kind; always ``ended``."""
    try:
        await request(record)
        record.ok = True
    except LOAD_ERRORS as exc:
        record.failed(exc)
    finally:
        record.ended = time.perf_counter()
        if done is not None:
            done(record)
    return record


async def run_client(keep_going: Callable[[], bool], new_record: Callable[[], Record],
                     request: Callable[[Record], Awaitable[None]],
                     done: Callable[[Record], None] | None = None) -> None:
    """One closed-loop client: the next request as soon as the last one ended, while ``keep_going()``."""
    while keep_going():
        record = await send(request, new_record(), done)
        if not record.ok:
            await asyncio.sleep(_FAILURE_PAUSE_S)


async def poisson_arrivals(rate_per_s: float, count: int, rng: random.Random) -> AsyncIterator[int]:
    """Yield 0..count-1 at the moments of a Poisson process of ``rate_per_s`` (exponential gaps), on schedule:
    a late wake-up shortens the next gap rather than shifting every later arrival."""
    due = time.perf_counter()
    for index in range(count):
        delay = due - time.perf_counter()
        if delay > 0:
            await asyncio.sleep(delay)
        yield index
        due += rng.expovariate(rate_per_s)

"""bench.soak's load: a bounded asyncio loop of OpenAI chat requests over httpx, half streamed, some clients hanging
up early on purpose; each request's outcome, its answer checked against the synthetic engine's text."""

from __future__ import annotations

import asyncio
import contextlib
import random
import time
from dataclasses import dataclass
from typing import Any

import httpx
import orjson

from workers.engines.synthetic import synthetic_text

MODEL = "synthetic"


@dataclass
class Outcome:
    started: float
    ended: float
    kind: str  # ok | cancelled | error
    detail: str = ""
    streaming: bool = False
    ttft_s: float | None = None  # a stream's: its first piece of text, from the request's start
    max_gap_s: float | None = None  # a stream's: the longest wait between two pieces of text (its worst stall)


@dataclass
class Settings:
    duration_s: float
    concurrency: int
    itl_ms: float
    disconnect_fraction: float
    stream_fraction: float
    restart_at: float
    sample_every_s: float
    settle_s: float
    seed: int
    gens: int = 1  # GEN workers
    kill_every_s: float | None = None  # SIGKILL one GEN (in turn) this often, and start it again
    roll_every_s: float | None = None  # SIGTERM one GEN (in turn) this often, wait for its exit, start it again
    migration_limit: int | None = None  # the orchestrator's (None: its default); 0 shows what migration saves


async def one_request(client: httpx.AsyncClient, url: str, rng: random.Random, settings: Settings) -> Outcome:
    streaming = rng.random() < settings.stream_fraction
    disconnect = rng.random() < settings.disconnect_fraction
    max_tokens = rng.randint(4, 48)
    words = rng.randint(5, 400)
    content = " ".join(rng.choice(("alpha", "beta", "gamma", "delta", "ünïcödé")) for _ in range(words))
    body = {"model": MODEL, "messages": [{"role": "user", "content": content}], "max_tokens": max_tokens,
            "stream": streaming}
    started = time.monotonic()
    try:
        if streaming:
            return await _streamed(client, url, body, max_tokens, disconnect, started, rng)
        if disconnect:
            # The client gives up before the answer: the task is cancelled, its connection closed.
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(client.post(url + "/v1/chat/completions", content=orjson.dumps(body)),
                                       timeout=rng.uniform(0.001, 0.03))
            return Outcome(started, time.monotonic(), "cancelled")
        reply = await client.post(url + "/v1/chat/completions", content=orjson.dumps(body))
        if reply.status_code != 200:
            return Outcome(started, time.monotonic(), "error", f"HTTP {reply.status_code}: {reply.text[:200]}")
        text = reply.json()["choices"][0]["message"]["content"]
        if text != synthetic_text(max_tokens):
            return Outcome(started, time.monotonic(), "error", f"wrong text {text[:60]!r}")
        return Outcome(started, time.monotonic(), "ok")
    except httpx.HTTPError as exc:
        return Outcome(started, time.monotonic(), "error", f"{type(exc).__name__}: {exc}", streaming)


async def _streamed(client: httpx.AsyncClient, url: str, body: dict[str, Any], max_tokens: int, disconnect: bool,
                    started: float, rng: random.Random) -> Outcome:
    leave_after = rng.randint(1, 4) if disconnect else None
    parts: list[str] = []
    frames = 0
    buffer = b""
    first: float | None = None  # when the first piece of text came, and the last one
    last = started
    max_gap = 0.0
    async with client.stream("POST", url + "/v1/chat/completions", content=orjson.dumps(body)) as response:
        if response.status_code != 200:
            text = (await response.aread()).decode(errors="replace")
            return Outcome(started, time.monotonic(), "error", f"HTTP {response.status_code}: {text[:200]}", True)
        async for chunk in response.aiter_raw():
            buffer += chunk
            while b"\n\n" in buffer:
                frame, buffer = buffer.split(b"\n\n", 1)
                frames += 1
                if frame == b"data: [DONE]":
                    text = "".join(parts)
                    if text != synthetic_text(max_tokens):
                        return Outcome(started, time.monotonic(), "error", f"wrong text {text[:60]!r}", True)
                    return Outcome(started, time.monotonic(), "ok", streaming=True,
                                   ttft_s=None if first is None else first - started, max_gap_s=max_gap)
                payload = orjson.loads(frame.removeprefix(b"data: "))
                if "error" in payload:
                    return Outcome(started, time.monotonic(), "error",
                                   f"stream error event: {payload['error'].get('message', '')[:200]}", True)
                if payload.get("choices"):
                    piece = payload["choices"][0]["delta"].get("content") or ""
                    if piece:
                        now = time.monotonic()
                        if first is None:
                            first = now
                        else:
                            max_gap = max(max_gap, now - last)
                        last = now
                    parts.append(piece)
            if leave_after is not None and frames >= leave_after:
                return Outcome(started, time.monotonic(), "cancelled", streaming=True)  # leaves: closes the stream
    return Outcome(started, time.monotonic(), "error", "the stream ended without [DONE]", True)

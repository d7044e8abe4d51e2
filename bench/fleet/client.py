"""bench.fleet's client: each session's turns streamed as chat completions (httpx, raw SSE), each sent when the
last answer has come back plus a think time, with TTFT taken from request sent to first content, and the prompt's
size in tokens from the stream's usage."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Sequence
from dataclasses import dataclass

import httpx
import orjson

from bench.fleet.work import MODEL, Session, Workload

SESSION_HEADER = "x-session-id"


@dataclass
class Record:
    session: str
    turn: int
    prompt_chars: int
    sent_s: float
    ttft_s: float | None = None
    latency_s: float | None = None
    ok: bool = False
    error: str | None = None
    prompt_tokens: int | None = None  # as the workers' tokenizer counted it (the stream's usage)


async def one_request(client: httpx.AsyncClient, messages: list[dict[str, str]], workload: Workload,
                      session: Session, turn: int, t0: float) -> tuple[Record, str]:
    body = orjson.dumps({"messages": messages, "model": MODEL, "max_tokens": workload.max_tokens,
                         "temperature": 0, "stream": True, "stream_options": {"include_usage": True}})
    headers = {"content-type": "application/json"}
    if workload.sessions_named:
        headers[SESSION_HEADER] = session.key
    sent = time.perf_counter()
    record = Record(session.key, turn, sum(len(m["content"]) for m in messages), sent - t0)
    pieces: list[str] = []
    try:
        async with client.stream("POST", "/v1/chat/completions", content=body, headers=headers) as response:
            if response.status_code != 200:
                raise RuntimeError(f"status {response.status_code}: {(await response.aread())[:200]!r}")
            pending, done = b"", False
            async for chunk in response.aiter_raw():
                pending += chunk
                *events, pending = pending.split(b"\n\n")
                for event in events:
                    data = event.strip().removeprefix(b"data:").strip()
                    if data == b"[DONE]":
                        done = True
                    elif data:
                        chunk_body = orjson.loads(data)
                        usage = chunk_body.get("usage")
                        if usage:
                            record.prompt_tokens = usage.get("prompt_tokens")
                        choices = chunk_body.get("choices") or []
                        content = choices[0].get("delta", {}).get("content") if choices else None
                        if content:
                            if record.ttft_s is None:
                                record.ttft_s = time.perf_counter() - sent
                            pieces.append(content)
            if not done:
                raise RuntimeError("the stream ended without [DONE]")
        record.ok = record.ttft_s is not None
        if not record.ok:
            record.error = "no content"
    except (httpx.HTTPError, RuntimeError, orjson.JSONDecodeError, KeyError, IndexError, TypeError) as exc:
        record.error = f"{type(exc).__name__}: {exc}"[:300]
    record.latency_s = time.perf_counter() - sent
    return record, "".join(pieces)


async def run_session(client: httpx.AsyncClient, workload: Workload, session: Session, t0: float,
                      records: list[Record]) -> None:
    delay = t0 + session.start_s - time.perf_counter()
    if delay > 0:
        await asyncio.sleep(delay)
    messages = [{"role": "system", "content": session.system}] if session.system is not None else []
    for turn, (message, think) in enumerate(zip(session.turns, session.think_s, strict=True)):
        messages.append({"role": "user", "content": message})
        record, answer = await one_request(client, messages, workload, session, turn, t0)
        records.append(record)
        if not record.ok:
            return  # a conversation whose answer failed does not go on
        messages.append({"role": "assistant", "content": answer})
        if turn + 1 < len(session.turns) and think > 0:
            await asyncio.sleep(think)


async def drive(url: str, workload: Workload, work: Sequence[Session]) -> tuple[list[Record], float]:
    limits = httpx.Limits(max_connections=1024, max_keepalive_connections=1024)
    records: list[Record] = []
    async with httpx.AsyncClient(base_url=url, limits=limits, timeout=httpx.Timeout(120.0)) as client:
        t0 = time.perf_counter()
        await asyncio.gather(*(run_session(client, workload, s, t0, records) for s in work))
        return records, time.perf_counter() - t0

"""The load generator: its own process, an asyncio closed loop of ``concurrency`` clients.

``python -m bench.driver.loadgen --config CONFIG.json --out RESULT.json``. ``orchestrator`` mode streams from the
orchestrator (or any proxy); ``direct`` mode does the orchestrator's work itself (CTX, then GEN with the relayed
hand-off), so the difference is the orchestrator's hop. The config picks the endpoint (completions or chat) and the
client (httpx, or the cheaper aiohttp). A point is a warm-up, a measurement window and a tail that keeps the load
on until every request of the window has finished; the servers' CPU is read from /proc at both ends of the window.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import os
import random
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import orjson

from bench.driver.bodies import SYNTHETIC_MODEL, client_completion_body, corpus_text, prompt_text
from bench.driver.common import arguments
from bench.driver.machine import cpu_seconds, machine_busy_seconds, tree_cpu_seconds
from entrypoints.bench.load import JSON_HEADERS, Record, StreamError, consume_stream, post_streamed, run_client
from entrypoints.bench.statistics import finite, summarize

PATHS = {"completions": "/v1/completions", "chat": "/v1/chat/completions"}


def endpoint_path(config: dict[str, Any]) -> str:
    return PATHS[config.get("endpoint", "completions")]


def client_body(endpoint: str, prompt_chars: int, max_tokens: int, stream: bool = True,
                text: str = "words") -> dict[str, Any]:
    """The client's body for ``endpoint``: the same prompt text, as ``prompt`` or as one user message; ``words``
    (``bench.driver.bodies.prompt_text``) or, for a real tokenizer, ``corpus`` (``bench.driver.bodies.corpus_text``)."""
    if text not in ("words", "corpus"):
        raise ValueError(f"unknown text {text!r}")
    prompt = corpus_text(prompt_chars) if text == "corpus" else prompt_text(prompt_chars)
    if endpoint == "chat":
        return {"model": SYNTHETIC_MODEL, "messages": [{"role": "user", "content": prompt}],
                "max_tokens": max_tokens, "temperature": 0, "stream": stream}
    if endpoint != "completions":
        raise ValueError(f"unknown endpoint {endpoint!r}")
    return {**client_completion_body(0, max_tokens, stream=stream), "prompt": prompt}


@dataclass
class State:
    phase: str = "warmup"  # warmup -> measure -> tail -> stop
    records: list[Record] = field(default_factory=list)
    completed: int = 0
    window_start: float = 0.0
    window_end: float = 0.0


async def via_orchestrator(client: httpx.AsyncClient, config: dict[str, Any], body: bytes, record: Record) -> None:
    await post_streamed(client, config["url"] + endpoint_path(config), body, record)


async def direct(client: httpx.AsyncClient, config: dict[str, Any], body: dict[str, Any], record: Record) -> None:
    path = endpoint_path(config)
    reply = await client.post(config["ctx_url"] + path, content=context_body(body), headers=JSON_HEADERS)
    if reply.status_code != 200:
        raise StreamError(f"CTX status {reply.status_code}: {reply.content[:200]!r}", f"http_{reply.status_code}")
    async with client.stream("POST", config["gen_url"] + path, content=gen_body_after(body, reply.content),
                             headers=JSON_HEADERS) as response:
        await consume_stream(response, record)


def context_body(body: dict[str, Any]) -> bytes:
    ctx_body = dict(body)
    ctx_body["stream"] = False
    ctx_body.pop("stream_options", None)
    ctx_body["disaggregated_params"] = {"request_type": "context_only",
                                        "disagg_request_id": random.getrandbits(63),
                                        "return_prompt_token_ids_b64": True,
                                        "native_extensions": True}  # as the orchestrator asks: our answer shape
    return orjson.dumps(ctx_body)


def gen_body_after(body: dict[str, Any], ctx_answer: bytes) -> bytes:
    """The GEN body the orchestrator would send after CTX's ``ctx_answer``, built by the direct client."""
    answer = orjson.loads(ctx_answer)
    params = dict(answer["choices"][0]["disaggregated_params"])
    if params.get("encoded_opaque_state") is None:
        raise StreamError("CTX finished the request by itself; use max_tokens > 1", "ctx_finished")
    params["request_type"] = "generation_only"
    gen_body = dict(body)
    gen_body["disaggregated_params"] = params
    gen_body["prompt_token_ids_b64"] = answer["prompt_token_ids_b64"]
    return orjson.dumps(gen_body)


class AiohttpClient:
    """Both modes over aiohttp (C parser, no anyio layer); its errors become ``StreamError``s of the same kinds."""

    def __init__(self, concurrency: int, timeout_s: float) -> None:
        import aiohttp

        self.session = aiohttp.ClientSession(
            connector=aiohttp.TCPConnector(limit=2 * concurrency + 8),
            timeout=aiohttp.ClientTimeout(total=timeout_s, connect=10.0),
            read_bufsize=2**21)  # as the orchestrator's: CTX's 700 KB answer is read whole, not in 64 KiB rounds

    async def consume(self, response: Any, record: Record) -> None:
        if response.status != 200:
            raise StreamError(f"status {response.status}: {(await response.read())[:200]!r}",
                              f"http_{response.status}")
        tail = b""
        async for chunk in response.content.iter_any():
            if record.first is None:
                record.first = time.perf_counter()
            tail = (tail + chunk)[-64:]
        if b"[DONE]" not in tail:
            raise StreamError("the stream ended without [DONE]", "incomplete_stream")

    async def request(self, config: dict[str, Any], body: dict[str, Any], body_bytes: bytes,
                      record: Record) -> None:
        import aiohttp

        try:
            if config["mode"] == "direct":
                await self._direct(config, body, record)
            else:
                async with self.session.post(config["url"] + endpoint_path(config), data=body_bytes,
                                             headers=JSON_HEADERS) as reply:
                    await self.consume(reply, record)
        except TimeoutError as exc:
            raise StreamError(str(exc) or "timed out", "timeout") from exc
        except aiohttp.ClientError as exc:
            raise StreamError(f"{type(exc).__name__}: {exc}", "connection") from exc

    async def _direct(self, config: dict[str, Any], body: dict[str, Any], record: Record) -> None:
        path = endpoint_path(config)
        async with self.session.post(config["ctx_url"] + path, data=context_body(body),
                                     headers=JSON_HEADERS) as reply:
            content = await reply.read()
            if reply.status != 200:
                raise StreamError(f"CTX status {reply.status}: {content[:200]!r}", f"http_{reply.status}")
        async with self.session.post(config["gen_url"] + path, data=gen_body_after(body, content),
                                     headers=JSON_HEADERS) as response:
            await self.consume(response, record)


def distinct_body(body: dict[str, Any], number: int) -> dict[str, Any]:
    """``body`` with its prompt opened by its own number: a prompt no earlier request began with, so no cache of
    what was tokenized (or of KV) holds any of it; a few tokens longer."""
    head = f"Request {number}. "
    if "messages" in body:
        first, *rest = body["messages"]
        return {**body, "messages": [{**first, "content": head + first["content"]}, *rest]}
    return {**body, "prompt": head + body["prompt"]}


_request_numbers = itertools.count()


async def client_loop(client: httpx.AsyncClient | AiohttpClient, config: dict[str, Any], state: State,
                      body: dict[str, Any], body_bytes: bytes) -> None:
    def new_record() -> Record:
        record = Record(time.perf_counter(), in_window=state.phase == "measure")
        state.records.append(record)
        return record

    async def request(record: Record) -> None:
        if config.get("distinct_prompts"):  # each request a new prompt: its body is made (and dumped) per request
            mine = distinct_body(body, next(_request_numbers))
            await send(record, mine, orjson.dumps(mine))
        else:
            await send(record, body, body_bytes)

    async def send(record: Record, body: dict[str, Any], body_bytes: bytes) -> None:
        if isinstance(client, AiohttpClient):
            await client.request(config, body, body_bytes, record)
        elif config["mode"] == "direct":
            await direct(client, config, body, record)
        else:
            await via_orchestrator(client, config, body_bytes, record)

    def finished(_: Record) -> None:
        state.completed += 1

    await run_client(lambda: state.phase != "stop", new_record, request, finished)


def _cpu_snapshot(pids: dict[str, int]) -> dict[str, float]:
    snapshot = {}
    for name, pid in pids.items():
        with contextlib.suppress(OSError, ValueError):
            snapshot[name] = tree_cpu_seconds(pid)
    with contextlib.suppress(OSError):
        snapshot["loadgen"] = cpu_seconds(os.getpid())
    with contextlib.suppress(OSError, ValueError):
        snapshot["machine"] = machine_busy_seconds()
    return snapshot


async def controller(config: dict[str, Any], state: State) -> dict[str, Any]:
    concurrency = config["concurrency"]
    started = time.perf_counter()
    hard_stop = started + config["max_total_s"]
    cpu: dict[str, dict[str, float]] = {}
    while True:  # warm-up
        now = time.perf_counter()
        if (now - started >= config["warmup_s"] and state.completed >= concurrency) or \
                now - started >= config["max_warmup_s"] or now >= hard_stop:
            break
        await asyncio.sleep(0.01)
    cpu["start"] = _cpu_snapshot(config.get("pids", {}))
    state.window_start = time.perf_counter()
    wall_start = time.time()
    state.phase = "measure"
    measured_done = 0
    while True:
        now = time.perf_counter()
        measured_done = sum(1 for r in state.records if r.in_window and r.ended is not None)
        if (now - state.window_start >= config["measure_s"] and measured_done >= config["min_requests"]) or \
                now - state.window_start >= config["max_measure_s"] or now >= hard_stop:
            break
        await asyncio.sleep(0.01)
    state.window_end = time.perf_counter()
    wall_end = time.time()
    cpu["end"] = _cpu_snapshot(config.get("pids", {}))
    state.phase = "tail"
    tail_deadline = min(time.perf_counter() + config["tail_s"], hard_stop)
    while time.perf_counter() < tail_deadline:
        if all(r.ended is not None for r in state.records if r.in_window):
            break
        await asyncio.sleep(0.01)
    state.phase = "stop"
    return {"cpu": cpu, "wall_start": wall_start, "wall_end": wall_end}


async def run(config: dict[str, Any]) -> dict[str, Any]:
    body = client_body(config.get("endpoint", "completions"), config["prompt_chars"], config["max_tokens"],
                       text=config.get("text", "words"))
    body_bytes = orjson.dumps(body)
    concurrency = config["concurrency"]
    limits = httpx.Limits(max_connections=2 * concurrency + 8, max_keepalive_connections=2 * concurrency + 8)
    timeout = httpx.Timeout(config.get("request_timeout_s", 120.0), connect=10.0)
    state = State()
    async with contextlib.AsyncExitStack() as stack:
        client: httpx.AsyncClient | AiohttpClient
        if config.get("client") == "aiohttp":
            client = AiohttpClient(concurrency, config.get("request_timeout_s", 120.0))
            stack.push_async_callback(client.session.close)
        else:
            client = await stack.enter_async_context(httpx.AsyncClient(limits=limits, timeout=timeout))
        clients = [asyncio.create_task(client_loop(client, config, state, body, body_bytes))
                   for _ in range(concurrency)]
        try:
            window = await controller(config, state)
        finally:
            for task in clients:
                task.cancel()
            await asyncio.gather(*clients, return_exceptions=True)
    return summarize_run(config, state, window)


def summarize_run(config: dict[str, Any], state: State, window: dict[str, Any]) -> dict[str, Any]:
    span = max(state.window_end - state.window_start, 1e-9)
    measured = [r for r in state.records if r.in_window and r.ended is not None]
    good = [r for r in measured if r.ok and r.first is not None]
    finished_in_window = [r for r in state.records
                          if r.ok and r.ended is not None and state.window_start <= r.ended <= state.window_end]
    errors = [r.error for r in measured if not r.ok and r.error]
    unfinished = sum(1 for r in state.records if r.in_window and (r.ended is None or (not r.ok and not r.error)))
    completed = len(finished_in_window)
    cpu = window["cpu"]
    cpu_ms = {name: (cpu["end"][name] - cpu["start"][name]) * 1e3 / completed
              for name in cpu["start"] if name in cpu["end"] and completed and name != "machine"}
    cpu_util = {name: (cpu["end"][name] - cpu["start"][name]) / span
                for name in cpu["start"] if name in cpu["end"]}
    if "machine" in cpu_util:
        # Cores busy with anything but this benchmark's processes (other users of the machine, the prober).
        cpu_util["other"] = max(0.0, cpu_util["machine"] - sum(v for k, v in cpu_util.items() if k != "machine"))
    return {
        "mode": config["mode"],
        "endpoint": config.get("endpoint", "completions"),
        "concurrency": config["concurrency"],
        "prompt_tokens": config.get("prompt_tokens", config["prompt_chars"]),  # the size asked for, in tokens
        "max_tokens": config["max_tokens"],
        "distinct_prompts": bool(config.get("distinct_prompts")),
        "window_s": span,
        "window_wall": [window["wall_start"], window["wall_end"]],
        "requests_per_s": completed / span,
        "completed_in_window": completed,
        "measured_requests": len(measured),
        "ok_requests": len(good),
        "errors": len(errors),
        "error_samples": sorted(set(errors))[:5],
        "unfinished": unfinished,
        "ttft_ms": summarize([(r.first - r.started) * 1e3 for r in good if r.first is not None]),
        "latency_ms": summarize([(r.ended - r.started) * 1e3 for r in good if r.ended is not None]),
        "cpu_ms_per_request": cpu_ms,
        "cpu_utilisation": cpu_util,
    }


def main(argv: list[str] | None = None) -> int:
    parser = arguments(__doc__)
    parser.add_argument("--config", required=True, help="JSON file with the run's settings")
    parser.add_argument("--out", required=True, help="where to write the JSON result")
    args = parser.parse_args(argv)
    config = orjson.loads(Path(args.config).read_bytes())
    import uvloop  # a dependency of uvicorn[standard]: the driver runs on the same loop as the servers

    result = uvloop.run(run(config))
    Path(args.out).write_bytes(orjson.dumps(finite(result)))
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""Test helpers for real CTX / GEN / orchestrator servers on loopback (no mocks).

``Recorder`` is a pure ASGI middleware that keeps what went over the wire; ``RecordingEngine`` is a real
``SyntheticEngine`` that also keeps every ``GenerationRequest`` it was handed. Both let tests look at what a
worker really received without replacing any part of the path.
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import AsyncGenerator, Iterator
from dataclasses import dataclass, field
from typing import Any

import httpx
import orjson
from fastapi import FastAPI
from starlette.types import Message, Receive, Scope, Send

from frontend.config import parse_config
from frontend.metrics import Metrics
from orchestrator.server import create_orchestrator_app
from tests.servers import running
from workers.engines.outputs import EngineOutput
from workers.engines.request import GenerationRequest
from workers.engines.synthetic import SyntheticConfig, SyntheticEngine
from workers.server import create_worker_app
from workers.settings import Role, WorkerSettings

MODEL = "synthetic"


@dataclass
class Exchange:
    method: str
    path: str
    request_body: bytes = b""
    status: int | None = None
    response_body: bytes = b""
    done: bool = False
    headers: dict[str, str] = field(default_factory=dict)  # the request's headers, names lower-cased

    def request_json(self) -> Any:
        return orjson.loads(self.request_body)

    def response_json(self) -> Any:
        return orjson.loads(self.response_body)


class Recorder:
    """ASGI middleware that records every HTTP exchange it passes through, bytes as they were."""

    def __init__(self, app: FastAPI) -> None:
        self.app = app
        self.exchanges: list[Exchange] = []
        self._lock = threading.Lock()

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        headers = {name.decode("latin-1").lower(): value.decode("latin-1") for name, value in scope["headers"]}
        exchange = Exchange(scope["method"], scope["path"], headers=headers)
        with self._lock:
            self.exchanges.append(exchange)

        async def recording_receive() -> Message:
            message = await receive()
            if message["type"] == "http.request":
                exchange.request_body += message.get("body", b"")
            return message

        async def recording_send(message: Message) -> None:
            if message["type"] == "http.response.start":
                exchange.status = message["status"]
            elif message["type"] == "http.response.body":
                exchange.response_body += message.get("body", b"")
                if not message.get("more_body", False):
                    exchange.done = True
            await send(message)

        await self.app(scope, recording_receive, recording_send)

    def posts(self, path: str | None = None) -> list[Exchange]:
        with self._lock:
            return [e for e in self.exchanges if e.method == "POST" and (path is None or e.path == path)]

    def count(self) -> int:
        return len(self.posts())


class RecordingEngine(SyntheticEngine):
    """The synthetic engine, keeping every request it was asked to run (a real engine, not a stand-in)."""

    def __init__(self, config: SyntheticConfig | None = None) -> None:
        super().__init__(config)
        self.requests: list[GenerationRequest] = []

    def generate(self, request: GenerationRequest) -> AsyncGenerator[EngineOutput, None]:
        self.requests.append(request)
        return super().generate(request)


@dataclass
class Node:
    url: str
    app: FastAPI
    recorder: Recorder
    engine: RecordingEngine | None = None

    @property
    def metrics(self) -> Metrics:
        metrics: Metrics = self.app.state.metrics
        return metrics


@dataclass
class Cluster:
    ctx: Node
    gen: Node
    orchestrator: Node
    aggregated: Node
    extras: dict[str, Node] = field(default_factory=dict)


def start_worker(stack: contextlib.ExitStack, role: Role, config: SyntheticConfig | None = None,
                 **settings: Any) -> Node:
    engine = RecordingEngine(config)
    app = create_worker_app(engine, WorkerSettings(role=role, **settings))
    recorder = Recorder(app)
    url = stack.enter_context(running(recorder))
    return Node(url, app, recorder, engine)


def start_orchestrator(stack: contextlib.ExitStack, ctx_urls: list[str], gen_urls: list[str],
                       **options: Any) -> Node:
    config = parse_config({
        "context_servers": {"urls": ctx_urls},
        "generation_servers": {"urls": gen_urls},
        **options,
    })
    app = create_orchestrator_app(config)
    recorder = Recorder(app)
    url = stack.enter_context(running(recorder))
    return Node(url, app, recorder)


@contextlib.contextmanager
def cluster_running() -> Iterator[Cluster]:
    with contextlib.ExitStack() as stack:
        ctx = start_worker(stack, "context")
        gen = start_worker(stack, "generation")
        aggregated = start_worker(stack, "both")
        orchestrator = start_orchestrator(stack, [ctx.url], [gen.url], max_body_bytes=64 * 1024)
        yield Cluster(ctx, gen, orchestrator, aggregated)


# -- reading metrics ---------------------------------------------------------------------------------------
def sample(metrics: Metrics, name: str, **labels: str) -> float:
    value = metrics.registry.get_sample_value(name, labels)
    return 0.0 if value is None else value


def total(metrics: Metrics, name: str) -> float:
    """The sum of every sample called ``name``, whatever its labels."""
    return sum(s.value for family in metrics.registry.collect() for s in family.samples if s.name == name)


def assert_a_null_stream_is_a_whole_answer(url: str, path: str) -> None:
    """An explicit ``"stream": null`` (and ``stream_options: null``) takes the field's default: a whole JSON
    answer, not a 400."""
    body: dict[str, Any] = {"model": MODEL, "stream": None, "stream_options": None}
    if path == "/v1/responses":
        body.update(input="x", max_output_tokens=2)
    else:
        body.update({"messages": [{"role": "user", "content": "hi"}]} if "chat" in path else {"prompt": "x"},
                    max_tokens=2)
    reply = httpx.post(url + path, json=body, timeout=30)
    assert reply.status_code == 200, reply.text
    assert reply.headers["content-type"].startswith("application/json")
    assert reply.json()["usage"] is not None

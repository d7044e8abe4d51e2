"""Reference-engine servers for tests: CTX, GEN and aggregated workers plus an orchestrator, on loopback.

Every worker runs a real ``ReferenceEngine`` with its own engine core process; BLAS is pinned to one thread
on every side so that prefill is bitwise the same in CTX and in the aggregated worker.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import openai
from fastapi import FastAPI

from frontend.config import parse_config
from orchestrator.server import create_orchestrator_app
from tests.cluster import Recorder
from tests.servers import running
from tests.workers.engines.reference.ledger import ADMIN_KEY
from workers.engines.reference.engine import ReferenceEngine
from workers.engines.reference.options import ReferenceOptions
from workers.server import create_worker_app
from workers.settings import Role, WorkerSettings


@dataclass
class RefNode:
    url: str
    app: FastAPI
    engine: ReferenceEngine | None = None
    recorder: Recorder | None = None

    def client(self) -> openai.OpenAI:
        return openai.OpenAI(base_url=self.url + "/v1", api_key="test", max_retries=0, timeout=120)


@dataclass
class RefCluster:
    ctx: RefNode
    gen: RefNode
    aggregated: RefNode
    orchestrator: RefNode
    model: str


def start_reference_worker(stack: contextlib.ExitStack, role: Role, options: ReferenceOptions,
                           admin_key: str | None = ADMIN_KEY) -> RefNode:
    engine = ReferenceEngine(options)
    app = create_worker_app(engine, WorkerSettings(role=role, admin_key=admin_key))
    recorder = Recorder(app)  # keeps the bytes each request carried, so tests can read GEN's bodies
    return RefNode(stack.enter_context(running(recorder)), app, engine, recorder)


def start_orchestrator(stack: contextlib.ExitStack, ctx: list[str], gen: list[str], **options: Any) -> RefNode:
    config = parse_config({"context_servers": {"urls": ctx}, "generation_servers": {"urls": gen}, **options})
    app = create_orchestrator_app(config)
    return RefNode(stack.enter_context(running(app)), app)


@contextlib.contextmanager
def reference_cluster(
    options: ReferenceOptions, gen_options: ReferenceOptions | None = None, **orchestrator_options: Any
) -> Iterator[RefCluster]:
    with contextlib.ExitStack() as stack:
        ctx = start_reference_worker(stack, "context", options)
        gen = start_reference_worker(stack, "generation", gen_options or options)
        aggregated = start_reference_worker(stack, "both", options)
        orchestrator = start_orchestrator(stack, [ctx.url], [gen.url], **orchestrator_options)
        assert ctx.engine is not None
        yield RefCluster(ctx, gen, aggregated, orchestrator, ctx.engine.info.model)

"""Pool members for router unit tests: real ``PoolMember`` objects, healthy and idle, whose transports are never
used (only closed)."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Iterator

from orchestrator.member import PoolMember
from orchestrator.upstream.base import WorkerTimeouts
from orchestrator.upstream.choice import make_transport


@contextlib.contextmanager
def idle_members(count: int, first_port: int) -> Iterator[list[PoolMember]]:
    workers = [PoolMember(make_transport(f"http://127.0.0.1:{first_port + i}", WorkerTimeouts()))
               for i in range(count)]
    for worker in workers:
        worker.healthy = True
    try:
        yield workers
    finally:
        async def close() -> None:
            for worker in workers:
                await worker.transport.aclose()

        asyncio.run(close())

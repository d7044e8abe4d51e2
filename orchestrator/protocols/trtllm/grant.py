"""A generation grant under lifecycle v1: the GEN worker that gives one before it is sent anything, and the loss of
a grant (its renewal failed), which ends the request's GEN call."""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable
from typing import TypeVar

from frontend.errors import UpstreamError, UpstreamUnavailableError
from orchestrator.member import PoolMember
from orchestrator.pool import WorkerPool
from orchestrator.protocols.trtllm.lifecycle import (
    Attempt,
    LifecycleClient,
    generation_first_capable,
    speaks_v1,
)
from orchestrator.routers import RoutingKey

T = TypeVar("T")


async def granting_gen(gen_pool: WorkerPool, lifecycle: LifecycleClient, attempt: Attempt, key: RoutingKey,
                       generation_first: bool = False) -> PoolMember:
    """The GEN that granted ``attempt``: the router's choice among v1 GEN workers (for generation first, those
    that advertise GENERATION_FIRST), or one other if it refused."""
    capable = generation_first_capable if generation_first else speaks_v1
    excluded = [w for w in gen_pool.workers if not capable(w)]
    tried: list[PoolMember] = []
    for _ in range(2):
        try:
            gen = gen_pool.pick(key, [*excluded, *tried])
        except UpstreamUnavailableError:
            break
        tried.append(gen)
        if await lifecycle.admit(attempt, gen):
            return gen
    raise UpstreamError("the GEN step failed: no GEN worker granted the request "
                        f"(tried {', '.join(w.url for w in tried) or 'none'})")


def mark_lost(lost: asyncio.Future[None]) -> None:
    """The renewal's callback when the grant is lost: ``lost`` done, once."""
    if not lost.done():
        lost.set_result(None)


async def until_lost(call: Awaitable[T], lost: asyncio.Future[None]) -> T:
    """``call``'s result, unless the grant is lost first (its renewal failed): then the call is dropped."""
    task = asyncio.ensure_future(call)
    try:
        await asyncio.wait((task, lost), return_when=asyncio.FIRST_COMPLETED)
    finally:
        if not task.done():
            task.cancel()
    if not task.done() or task.cancelled():
        raise UpstreamError("the GEN step failed: the generation grant could not be renewed")
    return task.result()

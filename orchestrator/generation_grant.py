"""GEN under TensorRT-LLM's lifecycle v1 (docs/interop.md): which workers speak it, the grant a GEN worker must give
before it is sent anything, and the GEN step of a context-first request under that grant, renewed while the
request lives and settled (released or aborted, with CTX's artifact) once it ends."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable
from dataclasses import replace
from functools import partial
from typing import TYPE_CHECKING, TypeVar

from frontend.errors import RelayedError, UpstreamError, UpstreamUnavailableError
from orchestrator.flow_request import Answer, FlowRequest, WholeAnswer
from orchestrator.member import PoolMember
from orchestrator.pool import WorkerPool
from orchestrator.protocols.trtllm_lifecycle import Attempt, LifecycleClient, SettledStream
from orchestrator.retry import Attempted
from orchestrator.routers import RoutingKey
from orchestrator.worker_call import count_as_held, post
from orchestrator.worker_protocol import ContextAnswer

if TYPE_CHECKING:
    from orchestrator.disagg_flow import DisaggFlow

T = TypeVar("T")


def speaks_v1(worker: PoolMember) -> bool:
    return worker.protocol == "trtllm" and worker.lifecycle is not None


def generation_first_capable(worker: PoolMember) -> bool:
    return speaks_v1(worker) and worker.lifecycle is not None and "GENERATION_FIRST" in worker.lifecycle.capabilities


async def run_generation_step_v1(flow: DisaggFlow, request: FlowRequest, ctx: ContextAnswer, attempt: Attempt
                                 ) -> Answer:
    """GEN under lifecycle v1: a grant on the chosen GEN first (one other GEN if it refuses, then an error),
    renewed while the request lives; GEN's request is sent once, never retried; any failure, the client's
    leaving before GEN sent the stream's end marker included, aborts the grant and CTX's artifact."""
    key = replace(request.key, only=None, prefill_tokens={})
    key.prefill_tokens.update((w.url, 0) for w in flow.gen_pool.workers)
    reason = "context-first coordinator request failed"
    try:
        gen = await admit_gen(flow.gen_pool, flow.lifecycle, attempt, key)
        carriage, fallback = flow.prompt_carriage(request, ctx, gen)
        if fallback is not None:
            flow.metrics.metadata_only_fallback.labels(reason=fallback.value).inc()
        body = flow.trtllm.generation_request(request.body, ctx, carriage, conversation_id=request.conversation_id,
                                              generation_endpoint=attempt.endpoint)
        request.gen_worker = gen.url
        lost = asyncio.get_running_loop().create_future()
        if not request.streaming:
            flow.lifecycle.start_renewal(attempt, partial(resolve, lost))
            reply = await until_lost(post(flow.gen_pool, gen, request, body, key), lost)
            if reply.status_code != 200:
                raise RelayedError(reply.status_code, reply.content)
            await flow.lifecycle.settle(attempt, ok=True, reason="")
            return WholeAnswer(reply.content)
        count_as_held(flow.gen_pool, gen, key)
        started = time.perf_counter()
        flow.lifecycle.start_renewal(attempt, partial(resolve, lost))
        opened = await until_lost(gen.transport.open_stream(request.path, body, request.headers), lost)
        if opened.status_code != 200:
            raise RelayedError(opened.status_code, await opened.read())
        flow.gen_first_byte(gen.url).observe(time.perf_counter() - started)
        reason = "generation stream was abandoned"
        stream = SettledStream(opened, lambda ok: flow.lifecycle.settle(attempt, ok=ok, reason=reason), lost)
        return flow.gen_answer(request, Attempted(stream, gen, 1, ()), key, on_end=stream.answered)
    except BaseException:
        await flow.lifecycle.settle(attempt, ok=False, reason=reason)
        raise


async def admit_gen(gen_pool: WorkerPool, lifecycle: LifecycleClient, attempt: Attempt, key: RoutingKey,
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


def resolve(future: asyncio.Future[None]) -> None:
    """The renewal's callback when the grant is lost: ``future`` done, once."""
    if not future.done():
        future.set_result(None)


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

"""TensorRT-LLM's generation-first schedule (``trtllm.schedule_style: generation_first``) for a trtllm-serve pair,
v0 or lifecycle v1: GEN gets its request (after its grant under v1) before CTX, so that its admission and KV
reservation hide behind the prefill. The two legs are bound to each other: neither is retried on another worker;
a GEN that fails first ends the request with its error, and a CTX that finishes the request alone drops GEN's leg.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from dataclasses import dataclass, replace
from functools import partial
from typing import Any

from frontend.errors import RelayedError, UpstreamError
from frontend.trtllm.lifecycle import ScheduleStyle
from orchestrator.flow.request import Answer, FlowRequest, WholeAnswer
from orchestrator.flow.retry import Attempted
from orchestrator.flow.steps import GenAnswer, Steps
from orchestrator.flow.worker_call import post
from orchestrator.member import PoolMember
from orchestrator.protocols.trtllm.grant import granting_gen, mark_lost, until_lost
from orchestrator.protocols.trtllm.lifecycle import LifecycleClient, SettledStream
from orchestrator.protocols.trtllm.wire import TrtllmProtocol, new_request_id
from orchestrator.upstream.base import Reply


class GenerationFirst:
    def __init__(self, lifecycle: LifecycleClient, wire: TrtllmProtocol) -> None:
        self.lifecycle = lifecycle
        self.wire = wire

    def on(self, ctx: PoolMember, v1: bool) -> GenerationFirstPair:
        """The schedule of a request whose CTX is ``ctx`` (the router's pick), under lifecycle v1 or not."""
        return GenerationFirstPair(self, ctx, v1)

    async def run_on(self, ctx: PoolMember, v1: bool, request: FlowRequest, steps: Steps) -> Answer:
        gen_pool = steps.gen_pool
        key = replace(request.key, only=None, prefill_tokens={})
        request_id = new_request_id()
        attempt = self.lifecycle.begin(ctx, request_id, ScheduleStyle.GENERATION_FIRST) if v1 else None
        reason = "generation-first coordinator request failed"
        tasks: list[asyncio.Future[Any]] = []
        lost = asyncio.get_running_loop().create_future()
        try:
            if attempt is not None:
                gen = await granting_gen(gen_pool, self.lifecycle, attempt, key, generation_first=True)
                self.lifecycle.start_renewal(attempt, partial(mark_lost, lost))
            else:
                gen = gen_pool.pick(key, [w for w in gen_pool.workers if w.protocol != "trtllm"])
            request.ctx_worker, request.gen_worker = ctx.url, gen.url
            # GEN's request names the CTX it will ask for its hand-off: signed where trtllm-serve requires it.
            self.wire.sign(request.headers, {"ctx_info_endpoint": (ctx.disagg_info or {}).get("ctx_info_endpoint")})
            ctx_body, gen_body = self.wire.generation_first_requests(
                request.body, disagg_request_id=request_id, conversation_id=request.conversation_id,
                ctx_info=ctx.disagg_info, lifecycle=attempt.ctx_params() if attempt is not None else None)
            started = time.perf_counter()
            gen_call = (gen.transport.open_stream(request.path, gen_body, request.headers) if request.streaming
                        else post(gen_pool, gen, request, gen_body, key))
            tasks.append(asyncio.ensure_future(gen_call))
            await asyncio.sleep(0)  # GEN's request goes out first (TensorRT-LLM yields once here too)
            if attempt is not None:
                attempt.ctx_sent = True
            tasks.append(asyncio.ensure_future(post(steps.ctx_pool, ctx, request, ctx_body, request.key)))
            ctx_reply = await _ctx_unless_gen_fails(tasks[0], tasks[1], lost)
            steps.ctx_latency(ctx.url).observe(time.perf_counter() - started)
            if ctx_reply.status_code != 200:
                raise RelayedError(ctx_reply.status_code, ctx_reply.content)
            answer = request.ctx = self.wire.read_context_answer(ctx_reply.content)
            if attempt is not None:
                self.lifecycle.verify_echo(attempt, request_id, answer.handoff)
            if answer.finished:  # CTX finished the request alone: GEN's leg is dropped, below
                steps.metrics.ctx_finished.inc()
                reason = "context finished the request"
                finished = steps.answer_from_context(request, answer)
            else:
                gen_answer = await until_lost(tasks[0], lost)
                if isinstance(gen_answer, Reply):
                    if gen_answer.status_code != 200:
                        raise RelayedError(gen_answer.status_code, gen_answer.content)
                    if attempt is not None:
                        await self.lifecycle.settle(attempt, ok=True, reason="")
                    return WholeAnswer(gen_answer.content)
                if gen_answer.status_code != 200:
                    raise RelayedError(gen_answer.status_code, await gen_answer.read())
                steps.gen_first_byte(gen.url).observe(time.perf_counter() - started)
                if attempt is None:
                    return steps.gen_answer(request, Attempted(gen_answer, gen, 1, ()), key)
                reason = "generation stream was abandoned"
                settled = SettledStream(gen_answer, lambda ok: self.lifecycle.settle(attempt, ok=ok, reason=reason),
                                        lost)
                return steps.gen_answer(request, Attempted(settled, gen, 1, ()), key, on_end=settled.answered)
        except BaseException:
            for task in tasks:
                await _drop(task)
            if attempt is not None:
                await self.lifecycle.settle(attempt, ok=False, reason=reason)
            raise
        await _drop(tasks[0])
        if attempt is not None:
            await self.lifecycle.settle(attempt, ok=False, reason=reason)
        return finished


@dataclass(frozen=True, slots=True)
class GenerationFirstPair:
    """Generation first for one request's pair: the CTX the router picked is where GEN will ask for its hand-off."""

    schedule: GenerationFirst
    ctx: PoolMember
    v1: bool

    async def run(self, request: FlowRequest, steps: Steps) -> Answer:
        return await self.schedule.run_on(self.ctx, self.v1, request, steps)


async def _drop(task: asyncio.Future[Any]) -> None:
    """A leg no longer wanted: cancelled, or its opened stream closed."""
    if not task.done():
        task.cancel()
    # ``wait``, not ``await task``: the leg's own failure or cancellation is not ours to raise, while a cancellation
    # of the caller (its client left) still ends the caller.
    await asyncio.wait([task])
    if task.cancelled() or task.exception() is not None:
        return
    result = task.result()
    if hasattr(result, "aclose"):
        with contextlib.suppress(Exception):  # closing a stream nobody reads: a failure there changes nothing
            await result.aclose()


async def _ctx_unless_gen_fails(gen: asyncio.Future[GenAnswer], ctx: asyncio.Future[Reply],
                                lost: asyncio.Future[None]) -> Reply:
    """Generation first: CTX's answer, unless GEN's leg fails first (refused, an error answer, a broken
    connection: its error ends the request now, not once CTX has prefilled) or the grant is lost."""
    pending: set[asyncio.Future[Any]] = {gen, ctx, lost}
    while True:
        await asyncio.wait(pending, return_when=asyncio.FIRST_COMPLETED)
        if ctx.done():
            return ctx.result()
        if lost.done():
            raise UpstreamError("the GEN step failed: the generation grant could not be renewed")
        if gen.done() and gen in pending:
            pending.discard(gen)
            answer = gen.result()  # GEN's own failure, raised
            if answer.status_code != 200:
                raise RelayedError(answer.status_code,
                                   answer.content if isinstance(answer, Reply) else await answer.read())

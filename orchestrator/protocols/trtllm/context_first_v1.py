"""Context first under TensorRT-LLM's lifecycle v1, the schedule of a CTX pool where workers advertise v1.

Each CTX try on a worker that advertises v1 is a new attempt identity (a v1 body is never sent twice), which CTX
must echo unchanged; GEN is sent its request only under a generation grant, renewed while the request lives, and
sent once, never retried. Any failure, the client's leaving before GEN sent the stream's end marker included,
aborts the grant and CTX's artifact (docs/interop.md). A try on a CTX that advertises no v1 is a plain one, and
its request goes on as plain context first.
"""

from __future__ import annotations

import asyncio
import time
from dataclasses import replace
from functools import partial

from frontend.errors import RelayedError, UpstreamError
from orchestrator.flow.context_first import ContextFirst
from orchestrator.flow.request import Answer, FlowRequest, WholeAnswer
from orchestrator.flow.retry import Attempted
from orchestrator.flow.steps import Steps
from orchestrator.flow.worker_call import count_as_held, post
from orchestrator.member import PoolMember
from orchestrator.protocols.base import ContextAnswer
from orchestrator.protocols.trtllm.grant import granting_gen, mark_lost, until_lost
from orchestrator.protocols.trtllm.lifecycle import Attempt, LifecycleClient, SettledStream, speaks_v1
from orchestrator.protocols.trtllm.wire import TrtllmProtocol, new_request_id
from orchestrator.upstream.base import Reply

CTX_FAILED = "context-first coordinator request failed"


class ContextFirstV1:
    def __init__(self, plain: ContextFirst, lifecycle: LifecycleClient, wire: TrtllmProtocol) -> None:
        self.plain = plain  # for a request whose CTX advertised no v1
        self.lifecycle = lifecycle
        self.wire = wire

    async def run(self, request: FlowRequest, steps: Steps) -> Answer:
        attempt: Attempt | None = None  # the last CTX try's, when it was a v1 one

        async def ctx_try(request: FlowRequest, member: PoolMember, return_tokens: bool) -> Reply:
            nonlocal attempt
            if not speaks_v1(member):
                attempt = None
                return await steps.call_ctx(request, member, return_tokens)
            # A new try, a new identity: a v1 body is never sent twice (TensorRT-LLM refuses to retry one).
            attempt = self.lifecycle.begin(member, new_request_id())
            return await self._ctx_try_v1(request, member, return_tokens, attempt, steps)

        ctx = await steps.run_context_step(request, ctx_try)
        if attempt is None:
            return await self.plain.after_context(request, ctx, steps)
        try:
            self.lifecycle.verify_echo(attempt, attempt.identity["logical_request_id"], ctx.handoff)
        except UpstreamError:
            await self.lifecycle.settle(attempt, ok=False, reason=CTX_FAILED)
            raise
        if ctx.finished:
            steps.metrics.ctx_finished.inc()
            await self.lifecycle.settle(attempt, ok=True, reason="")  # CTX holds nothing for GEN
            return steps.answer_from_context(request, ctx)
        try:
            return await self.run_generation_step(request, ctx, attempt, steps)
        except BaseException:
            # GEN refused the request, no GEN could take it, or the client left: free CTX's parked KV now.
            steps.releaser.release(request.ctx, request.ctx_worker, request.headers)
            raise

    async def _ctx_try_v1(self, request: FlowRequest, member: PoolMember, return_tokens: bool, attempt: Attempt,
                          steps: Steps) -> Reply:
        body = self.wire.context_request(request.body, return_prompt_tokens=return_tokens,
                                         conversation_id=request.conversation_id,
                                         disagg_request_id=attempt.identity["logical_request_id"],
                                         lifecycle=attempt.ctx_params())
        attempt.ctx_sent = True
        try:
            reply = await post(steps.ctx_pool, member, request, body, request.key)
        except BaseException:
            await self.lifecycle.settle(attempt, ok=False, reason=CTX_FAILED)
            raise
        if reply.status_code != 200:
            await self.lifecycle.settle(attempt, ok=False, reason=CTX_FAILED)
        return reply

    async def run_generation_step(self, request: FlowRequest, ctx: ContextAnswer, attempt: Attempt, steps: Steps
                                  ) -> Answer:
        """GEN under a grant on the chosen GEN (one other GEN if it refuses, then an error), renewed while the
        request lives; its request is sent once."""
        gen_pool = steps.gen_pool
        key = replace(request.key, only=None, prefill_tokens={})
        key.prefill_tokens.update((w.url, 0) for w in gen_pool.workers)
        reason = CTX_FAILED
        try:
            gen = await granting_gen(gen_pool, self.lifecycle, attempt, key)
            carriage, fallback = steps.prompt_carriage(request, ctx, gen)
            if fallback is not None:
                steps.metrics.metadata_only_fallback.labels(reason=fallback.value).inc()
            body = self.wire.generation_request(request.body, ctx, carriage, conversation_id=request.conversation_id,
                                                generation_endpoint=attempt.endpoint)
            request.gen_worker = gen.url
            lost = asyncio.get_running_loop().create_future()
            if not request.streaming:
                self.lifecycle.start_renewal(attempt, partial(mark_lost, lost))
                reply = await until_lost(post(gen_pool, gen, request, body, key), lost)
                if reply.status_code != 200:
                    raise RelayedError(reply.status_code, reply.content)
                await self.lifecycle.settle(attempt, ok=True, reason="")
                return WholeAnswer(reply.content)
            count_as_held(gen_pool, gen, key)
            started = time.perf_counter()
            self.lifecycle.start_renewal(attempt, partial(mark_lost, lost))
            opened = await until_lost(gen.transport.open_stream(request.path, body, request.headers), lost)
            if opened.status_code != 200:
                raise RelayedError(opened.status_code, await opened.read())
            steps.gen_first_byte(gen.url).observe(time.perf_counter() - started)
            reason = "generation stream was abandoned"
            stream = SettledStream(opened, lambda ok: self.lifecycle.settle(attempt, ok=ok, reason=reason), lost)
            return steps.gen_answer(request, Attempted(stream, gen, 1, ()), key, on_end=stream.answered)
        except BaseException:
            await self.lifecycle.settle(attempt, ok=False, reason=reason)
            raise

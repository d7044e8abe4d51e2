"""Context first, the schedule of every pair that speaks no other: CTX -> hand-off -> GEN -> relay.

A GEN that fails before its first byte is retried on another; one that finds the hand-off gone (an earlier GEN
took it before failing) makes CTX run again, once. Whatever ends the request before GEN took the hand-off frees
it on CTX at once rather than at its expiry.
"""

from __future__ import annotations

from dataclasses import replace

from frontend import tracing
from frontend.errors import UpstreamError
from frontend.guardrail import FallbackReason
from orchestrator.flow import spans
from orchestrator.flow.request import Answer, FlowRequest
from orchestrator.flow.steps import Steps
from orchestrator.member import PoolMember
from orchestrator.protocols.base import ContextAnswer
from orchestrator.upstream.base import Body


class ContextFirst:
    async def run(self, request: FlowRequest, steps: Steps) -> Answer:
        ctx = await steps.run_context_step(request)
        return await self.after_context(request, ctx, steps)

    async def after_context(self, request: FlowRequest, ctx: ContextAnswer, steps: Steps) -> Answer:
        """The request once CTX answered: CTX's own answer if it finished the request, else GEN's."""
        if ctx.finished:
            steps.metrics.ctx_finished.inc()
            return steps.answer_from_context(request, ctx)
        try:
            return await self.run_generation_step(request, ctx, steps)
        except BaseException:
            # GEN refused the request, no GEN could take it, or the client left: free CTX's parked KV now.
            steps.releaser.release(request.ctx, request.ctx_worker, request.headers, request.wire)
            raise

    async def run_generation_step(self, request: FlowRequest, ctx: ContextAnswer, steps: Steps) -> Answer:
        fallback: FallbackReason | None = None  # counted once per request, however many GEN attempts

        def body_for(gen: PoolMember) -> Body:
            nonlocal fallback
            with tracing.span("handoff", request.span) as span:
                carriage, reason = steps.prompt_carriage(request, ctx, gen)
                fallback = fallback or reason
                body = steps.wire(request, gen).generation_request(request.body, ctx, carriage,
                                                                   conversation_id=request.conversation_id)
                spans.handed_off(span, ctx, carriage, reason, body)
            return body

        failed: tuple[PoolMember, ...] = ()  # GEN workers that failed this request: not the first choice again
        try:
            while True:
                # GEN computes none of the prompt: its queue of prefill work does not grow.
                prompt_tokens = ctx.prompt_len if ctx.prompt_len is not None else request.key.prompt_tokens
                key = replace(request.key, prompt_tokens=prompt_tokens, only=None, prefill_tokens={})
                key.prefill_tokens.update((w.url, 0) for w in steps.gen_pool.workers)
                answered = await steps.call_gen(request, key, body_for, avoid=failed)
                if not steps.handoff_lost(request, answered):
                    return steps.gen_answer(request, answered, key)
                if request.ctx_redone:
                    # Lost twice: failing GEN workers, not the client's request. Once only, so a flapping GEN
                    # pool cannot make CTX prefill forever.
                    raise UpstreamError("the GEN step failed: the KV hand-off was lost twice with failing GEN "
                                        f"workers (last tried {answered.member.url})")
                failed = (*failed, *answered.failed)
                ctx = await steps.redo_context(request)
                if ctx.finished:
                    return steps.answer_from_context(request, ctx)
        finally:
            if fallback is not None:
                steps.metrics.metadata_only_fallback.labels(reason=fallback.value).inc()

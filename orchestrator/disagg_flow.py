"""The two-step flow, top to bottom: admit -> CTX -> hand-off -> GEN -> relay.

The orchestrator never decodes the prompt. It parses CTX's answer once, without its ``prompt_token_ids_b64``,
and sends those very bytes to GEN as a chunk of GEN's body (``b64_splice``). Short prompts
(``max_local_prefill_length``) skip the split and go to a GEN worker alone, and so does a request whose uncached
remainder is that short on a GEN worker that holds the rest (a conversation's next turn, where GEN decoded the
last one: conditional disaggregation on what is cached, not on the prompt's length). How each step is written on
the wire is the ``WorkerProtocol``'s business; which worker, and what happens when one fails, is the ``RetryPolicy``'s.

Around the flow, each in its own module: which GEN worker holds most of a prompt (``conditional_disagg``), one call
to a worker (``worker_call``), GEN under TensorRT-LLM's lifecycle v1 grant (``generation_grant``) and its
generation-first schedule (``generation_first``).
"""

from __future__ import annotations

import logging
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import replace
from typing import Any

import orjson

from frontend import tracing
from frontend.config import OrchestratorConfig
from frontend.errors import RelayedError, UpstreamError
from frontend.guardrail import FallbackReason, decide_for_reading
from frontend.metrics import LabelledChildren, Metrics
from frontend.openai_output import Endpoint, replay_as_stream
from frontend.prefix_chain import CHAIN_HEADER
from orchestrator import flow_tracing
from orchestrator.admission import Admission
from orchestrator.client_body import encode
from orchestrator.conditional_disagg import gen_holding_prefix
from orchestrator.flow_request import Answer, FlowRequest, StreamedAnswer, WholeAnswer
from orchestrator.generation_first import run_generation_first
from orchestrator.generation_grant import run_generation_step_v1, speaks_v1
from orchestrator.handoff_release import HandoffReleaser
from orchestrator.member import PoolMember
from orchestrator.metric_labels import CTX_STEP, GEN_STEP, HANDOFF_LOST, ON_CTX, ON_GEN_CACHED, ON_GEN_SHORT
from orchestrator.pool import WorkerPool
from orchestrator.protocols.registry import DEFAULT_PROTOCOL, build_protocols
from orchestrator.protocols.trtllm import TrtllmProtocol, new_request_id
from orchestrator.protocols.trtllm_lifecycle import LifecycleClient
from orchestrator.relay import RelayedStream
from orchestrator.retry import Attempted, RetryPolicy
from orchestrator.routers import CacheAwareRouter, RoutingKey, routing_key
from orchestrator.upstream.base import Body, OpenStream, Reply
from orchestrator.worker_call import count_as_held, post
from orchestrator.worker_protocol import ContextAnswer, PromptCarriage, WorkerProtocol

logger = logging.getLogger(__name__)

GenAnswer = Reply | OpenStream  # a whole answer, or a 200 stream whose body is still to come


class DisaggFlow:
    def __init__(self, config: OrchestratorConfig, ctx_pool: WorkerPool, gen_pool: WorkerPool, metrics: Metrics,
                 protocol: WorkerProtocol | None = None, trtllm_auth_key: str | None = None) -> None:
        self.config = config
        self.ctx_pool = ctx_pool
        self.gen_pool = gen_pool
        self.metrics = metrics
        self.fixed_protocol = protocol  # one protocol for every worker (tests); else each worker's own
        self.protocols = build_protocols(config)
        self.retry = RetryPolicy(config.max_retries, metrics)
        self.retry_once = RetryPolicy(0, metrics)  # one worker, the one chosen: for a prompt only it holds
        self.releaser = HandoffReleaser(ctx_pool, self.protocol_of)
        # trtllm_auth_key: TensorRT-LLM's internal_request_auth_key, for trtllm-serve workers that require it.
        self.trtllm = TrtllmProtocol(strip_message_history=config.gen_strip_message_history, auth_key=trtllm_auth_key)
        self.lifecycle = LifecycleClient(config.trtllm, metrics, trtllm_auth_key)  # v1 to trtllm-serve pairs
        self.ctx_latency = LabelledChildren(metrics.ctx_latency)  # by worker, looked up once per worker
        self.gen_first_byte = LabelledChildren(metrics.gen_first_byte)
        # The prefix chain costs one pass over the prompt: computed only where something reads it.
        self.needs_chain = (config.max_local_prefill_length > 0
                            or any(isinstance(p.router, CacheAwareRouter) for p in (ctx_pool, gen_pool)))
        self.prefill_placement = LabelledChildren(metrics.prefill_placement)
        # Each CTX worker's running window (context_servers.max_running_prefills): prefills past the room of the
        # workers that take requests wait here, by priority, instead of in an engine's queue.
        window = config.context_servers.max_running_prefills
        self.prefill_gate = None if not window else Admission(
            lambda: window * sum(w.routable for w in ctx_pool.workers), config.admission, metrics,
            has_workers=lambda: any(w.routable for w in ctx_pool.workers), gate="prefill")
        if self.prefill_gate is not None:
            ctx_pool.on_health_change.append(self.prefill_gate.poke)

    def protocol_of(self, member: PoolMember | None) -> WorkerProtocol:
        """The wire ``member`` speaks, as its pool detected it (``orchestrator.protocols.registry``)."""
        if self.fixed_protocol is not None:
            return self.fixed_protocol
        return self.protocols[member.protocol if member is not None else DEFAULT_PROTOCOL]

    def new_request(self, endpoint: Endpoint, body: dict[str, Any], started: float,
                    headers: dict[str, str] | None = None, session: str | None = None,
                    conversation_id: str | None = None) -> FlowRequest:
        prefix_chars = self.config.context_servers.router.prefix_chars
        headers = headers if headers is not None else {}
        # Exact chains where a GEN worker may be sent a prompt to prefill alone: a sampled link could claim a
        # prompt edited inside it is held (frontend/prefix_chain.py), and GEN would prefill it all.
        key = routing_key(body, prefix_chars, self.needs_chain, session,
                          exact=self.config.max_local_prefill_length > 0)
        if key.chain.links:
            headers[CHAIN_HEADER] = key.chain.header_value()  # both workers record what they now hold under it
        return FlowRequest(endpoint, body, key, started, headers, conversation_id=conversation_id)

    async def run(self, request: FlowRequest) -> Answer:
        """The request's answer; a worker's own error answer is raised as ``RelayedError``."""
        threshold = self.config.max_local_prefill_length
        if request.key.prompt_tokens < threshold:
            self.metrics.local_prefill.inc()
            self.prefill_placement(ON_GEN_SHORT).inc()
            return await self.run_on_gen_alone(request)
        if threshold:
            holder = gen_holding_prefix(self.gen_pool, request.key, threshold)
            if holder is not None:
                try:
                    answer = await self.run_on_gen_alone(request, holder, self.retry_once)
                except UpstreamError as exc:
                    # Never another GEN worker instead: it holds none of the prompt. Through CTX, as any other.
                    logger.warning("GEN worker %s, which holds the prompt, failed (%s); it goes through CTX",
                                   holder.only, exc.message)
                else:
                    self.prefill_placement(ON_GEN_CACHED).inc()
                    return answer
        self.prefill_placement(ON_CTX).inc()
        if self.config.trtllm.schedule_style == "generation_first" and self.fixed_protocol is None:
            first = await run_generation_first(self, request)
            if first is not None:
                return first
        ctx = await self.run_context_step(request)
        if ctx.finished:
            self.metrics.ctx_finished.inc()
            if request.lifecycle is not None:
                await self.lifecycle.settle(request.lifecycle, ok=True, reason="")  # CTX holds nothing for GEN
            return self.answer_from_context(request, ctx)
        try:
            if request.lifecycle is not None:
                return await run_generation_step_v1(self, request, ctx, request.lifecycle)
            return await self.run_generation_step(request, ctx)
        except BaseException:
            # GEN refused the request, no GEN could take it, or the client left: free CTX's parked KV now.
            self.releaser.release(request.ctx, request.ctx_worker, request.headers)
            raise

    # -- step 1: CTX --------------------------------------------------------------------------------------
    async def run_context_step(self, request: FlowRequest) -> ContextAnswer:
        gate = self.prefill_gate
        if gate is None:
            return await self._context_step(request)
        await gate.admit(request.priority)
        try:
            return await self._context_step(request)
        finally:
            gate.release(request.priority)

    async def _context_step(self, request: FlowRequest) -> ContextAnswer:
        return_tokens = self._ctx_returns_tokens(request)

        def body_for(ctx: PoolMember) -> Body:
            return self.protocol_of(ctx).context_request(request.body, return_prompt_tokens=return_tokens,
                                                       conversation_id=request.conversation_id)

        started = time.perf_counter()
        with tracing.span("ctx.call", request.span, headers=request.headers, client=True) as span:
            # Past the prefill gate some worker has room in its window: those without are picked last.
            full = [w for w in self.ctx_pool.workers if not w.has_room] if self.prefill_gate is not None else ()
            done = await self.retry.run(CTX_STEP, self.ctx_pool, request.key,
                                        lambda member: self._ctx_attempt(request, member, body_for, return_tokens),
                                        avoid=full)
            flow_tracing.called(span, done)
        request.ctx_worker = done.member.url
        self.ctx_latency(done.member.url).observe(time.perf_counter() - started)
        if done.answer.status_code != 200:
            raise RelayedError(done.answer.status_code, done.answer.content)
        request.ctx = self.protocol_of(done.member).read_context_answer(done.answer.content)
        if request.lifecycle is not None:
            try:
                self.lifecycle.verify_echo(request.lifecycle, request.lifecycle.identity["logical_request_id"],
                                           request.ctx.handoff)
            except UpstreamError:
                await self.lifecycle.settle(request.lifecycle, ok=False, reason="context-first coordinator "
                                            "request failed")
                raise
        self.trtllm.sign(request.headers, request.ctx.handoff)  # for GEN, sent what CTX handed off
        return request.ctx

    def ctx_speaks_v1(self, ctx: PoolMember) -> bool:
        """Lifecycle v1 for a CTX that advertises it (a v1 worker refuses a v0 request); its GEN is then one that
        advertises v1 too. TensorRT-LLM has no per-request downgrade: a fleet is set up consistently."""
        return (self.config.trtllm.lifecycle_protocol == "auto" and self.fixed_protocol is None
                and speaks_v1(ctx))

    async def _ctx_attempt(self, request: FlowRequest, member: PoolMember, body_for: Callable[[PoolMember], Body],
                           return_tokens: bool) -> Reply:
        if not self.ctx_speaks_v1(member):
            request.lifecycle = None
            return await post(self.ctx_pool, member, request, body_for(member), request.key)
        # A new attempt, a new identity: a v1 body is never sent twice (TensorRT-LLM refuses to retry one).
        request_id = new_request_id()
        attempt = request.lifecycle = self.lifecycle.begin(member, request_id)
        body = self.trtllm.context_request(request.body, return_prompt_tokens=return_tokens,
                                           conversation_id=request.conversation_id, disagg_request_id=request_id,
                                           lifecycle=attempt.ctx_params())
        attempt.ctx_sent = True
        try:
            reply = await post(self.ctx_pool, member, request, body, request.key)
        except BaseException:
            await self.lifecycle.settle(attempt, ok=False, reason="context-first coordinator request failed")
            raise
        if reply.status_code != 200:
            await self.lifecycle.settle(attempt, ok=False, reason="context-first coordinator request failed")
        return reply

    def _ctx_returns_tokens(self, request: FlowRequest) -> bool:
        """Ask CTX for the b64 prompt only if GEN may need it: in metadata-only mode, only if some healthy GEN
        worker would make this request fall back (a 131k-token prompt is ~700 KB that would be parsed and
        dropped)."""
        if not self.config.gen_tokids_metadata_only:
            return self.config.gen_tokids_ctxbytes
        return any(decide_for_reading(request.guardrail_reading, 1, w.engine_facts) is not None
                   for w in self.gen_pool.workers if w.healthy) or not self.gen_pool.has_healthy

    def answer_from_context(self, request: FlowRequest, ctx: ContextAnswer) -> Answer:
        """CTX finished the request by itself (EOS, a stop string, or max_tokens at the first token)."""
        ctx_worker = next((w for w in self.ctx_pool.workers if w.url == request.ctx_worker), None)
        response = self.protocol_of(ctx_worker).finished_response(ctx)
        if not request.streaming:
            return WholeAnswer(orjson.dumps(response))
        options = request.body.get("stream_options")
        include_usage = isinstance(options, dict) and options.get("include_usage") is True
        return StreamedAnswer(_iterate(replay_as_stream(request.endpoint, response, include_usage)))

    async def redo_context(self, request: FlowRequest) -> ContextAnswer:
        request.ctx_redone = True
        self.metrics.retries.labels(step=CTX_STEP, reason=HANDOFF_LOST).inc()
        logger.warning("the KV hand-off was lost with a failed GEN; running CTX again")
        return await self.run_context_step(request)

    # -- step 2: the hand-off: what of the prompt travels with it -----------------------------------------
    def prompt_carriage(self, request: FlowRequest, ctx: ContextAnswer, gen: PoolMember
                        ) -> tuple[PromptCarriage, FallbackReason | None]:
        """What of the prompt goes to ``gen``, and why metadata-only was not taken when it was asked for."""
        fallback = None
        if self.config.gen_tokids_metadata_only:
            facts = gen.engine_facts
            fallback = decide_for_reading(request.guardrail_reading, ctx.prompt_len, facts)
            if fallback is None:
                return (PromptCarriage.NOTHING if facts.prompt_tokens_in_handoff else PromptCarriage.LENGTH_ONLY), None
        relays_tokens = self.config.gen_tokids_ctxbytes or self.config.gen_tokids_metadata_only
        if relays_tokens and ctx.prompt_b64 is not None:
            return PromptCarriage.CTX_TOKENS, fallback
        return PromptCarriage.CLIENT_PROMPT, fallback

    # -- step 3: GEN, then the relay ----------------------------------------------------------------------
    async def run_generation_step(self, request: FlowRequest, ctx: ContextAnswer) -> Answer:
        fallback: FallbackReason | None = None  # counted once per request, however many GEN attempts

        def body_for(gen: PoolMember) -> Body:
            nonlocal fallback
            with tracing.span("handoff", request.span) as span:
                carriage, reason = self.prompt_carriage(request, ctx, gen)
                fallback = fallback or reason
                body = self.protocol_of(gen).generation_request(request.body, ctx, carriage,
                                                                 conversation_id=request.conversation_id)
                flow_tracing.handed_off(span, ctx, carriage, reason, body)
            return body

        failed: tuple[PoolMember, ...] = ()  # GEN workers that failed this request: not the first choice again
        try:
            while True:
                # GEN computes none of the prompt: its queue of prefill work does not grow.
                prompt_tokens = ctx.prompt_len if ctx.prompt_len is not None else request.key.prompt_tokens
                key = replace(request.key, prompt_tokens=prompt_tokens, only=None, prefill_tokens={})
                key.prefill_tokens.update((w.url, 0) for w in self.gen_pool.workers)
                done = await self._call_gen(request, key, body_for, avoid=failed)
                if not self._handoff_lost(request, done):
                    return self.gen_answer(request, done, key)
                if request.ctx_redone:
                    # Lost twice: failing GEN workers, not the client's request. Once only, so a flapping GEN
                    # pool cannot make CTX prefill forever.
                    raise UpstreamError("the GEN step failed: the KV hand-off was lost twice with failing GEN "
                                        f"workers (last tried {done.member.url})")
                failed = (*failed, *done.failed)
                ctx = await self.redo_context(request)
                if ctx.finished:
                    return self.answer_from_context(request, ctx)
        finally:
            if fallback is not None:
                self.metrics.metadata_only_fallback.labels(reason=fallback.value).inc()

    async def run_on_gen_alone(self, request: FlowRequest, key: RoutingKey | None = None,
                               retry: RetryPolicy | None = None) -> Answer:
        """Conditional disaggregation: a short prompt, or a short uncached remainder on the GEN worker ``key``
        prefers, is cheaper to prefill where it is decoded than to send through CTX and a KV transfer."""
        body = encode(request.body)
        key = key or request.key
        done = await self._call_gen(request, key, lambda _: body, retry=retry)
        return self.gen_answer(request, done, key)

    async def _call_gen(self, request: FlowRequest, key: RoutingKey, body_for: Callable[[PoolMember], Body],
                        avoid: tuple[PoolMember, ...] = (), retry: RetryPolicy | None = None
                        ) -> Attempted[GenAnswer]:
        """GEN's answer: whole, or (streaming) opened, moving to another GEN on a failure before the first byte."""
        async def whole(gen: PoolMember) -> GenAnswer:
            request.gen_worker = gen.url
            return await post(self.gen_pool, gen, request, body_for(gen), key)

        async def streamed(gen: PoolMember) -> GenAnswer:
            request.gen_worker = gen.url
            count_as_held(self.gen_pool, gen, key)
            stream = await gen.transport.open_stream(request.path, body_for(gen), request.headers)
            if stream.status_code == 200:
                return stream
            return Reply(stream.status_code, await stream.read())  # an error answer is whole: read, closed

        started = time.perf_counter()
        with tracing.span("gen.call", request.span, headers=request.headers, client=True) as span:
            done = await (retry or self.retry).run(GEN_STEP, self.gen_pool, key,
                                                   streamed if request.streaming else whole, avoid)
            flow_tracing.called(span, done)
        if not isinstance(done.answer, Reply):
            self.gen_first_byte(done.member.url).observe(time.perf_counter() - started)
        return done

    def _handoff_lost(self, request: FlowRequest, done: Attempted[GenAnswer]) -> bool:
        """A retried GEN found the hand-off gone (an earlier GEN took it before failing): CTX must run again.
        After a CTX rerun any such answer counts, first attempt included: the hand-off was fresh."""
        return (isinstance(done.answer, Reply) and (done.attempts >= 2 or request.ctx_redone)
                and self.protocol_of(done.member).handoff_lost(done.answer))

    def gen_answer(self, request: FlowRequest, done: Attempted[GenAnswer], key: RoutingKey,
                   on_end: Callable[[], None] | None = None) -> Answer:
        """GEN's answer for the client; a stream is relayed, and ``on_end`` told when its end marker has passed."""
        answer = done.answer
        if isinstance(answer, Reply):
            if answer.status_code != 200:
                raise RelayedError(answer.status_code, answer.content)
            return WholeAnswer(answer.content)
        relayed = RelayedStream(answer, done.member, key.prompt_tokens, request.endpoint, request.started,
                                self.metrics, on_end)
        if request.span is None:  # nothing reads the pieces on the way: they may be pushed
            return StreamedAnswer(relayed.frames(), answer.aclose, pushed=relayed)
        return StreamedAnswer(tracing.traced_frames("stream", request.span, relayed.frames()), answer.aclose)


async def _iterate(frames: list[bytes]) -> AsyncIterator[bytes]:
    for frame in frames:
        yield frame

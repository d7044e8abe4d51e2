"""The steps a schedule composes: the CTX step, what of the prompt travels to GEN, the GEN call, GEN's answer.

Each step is one method over the two pools, the retry policy and each worker's own wire (``wire``); a
schedule (``orchestrator.flow.context_first``, ``orchestrator.protocols.trtllm``) says in which order they run.
The orchestrator never decodes the prompt: CTX's answer is parsed once, without its ``prompt_token_ids_b64``, and
those very bytes go to GEN as a chunk of GEN's body (``b64_splice``).
"""

from __future__ import annotations

import logging
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Mapping
from typing import Any

import orjson

from frontend import tracing
from frontend.config import OrchestratorConfig
from frontend.errors import RelayedError
from frontend.guardrail import FallbackReason, decide_for_reading
from frontend.metrics import LabelledChildren, Metrics
from frontend.openai_output import replay_as_stream
from orchestrator.admission import Admission
from orchestrator.flow import spans
from orchestrator.flow.handoff_release import HandoffReleaser
from orchestrator.flow.migration import Migrations
from orchestrator.flow.request import Answer, FlowRequest, StreamedAnswer, WholeAnswer
from orchestrator.flow.retry import Attempted, RetryPolicy
from orchestrator.flow.worker_call import count_as_held, post
from orchestrator.member import PoolMember
from orchestrator.metric_labels import CTX_STEP, GEN_STEP, HANDOFF_LOST
from orchestrator.pair_health import PairHealth
from orchestrator.pool import WorkerPool
from orchestrator.protocols.base import ContextAnswer, PromptCarriage, WorkerProtocol
from orchestrator.protocols.registry import DEFAULT_PROTOCOL, build_protocols
from orchestrator.recompute_watch import RecomputeWatch
from orchestrator.relay import RelayedStream
from orchestrator.routers import RoutingKey, learn_from_answer
from orchestrator.upstream.base import Body, OpenStream, Reply

logger = logging.getLogger("disagg_serve.flow")

GenAnswer = Reply | OpenStream  # a whole answer, or a 200 stream whose body is still to come
# One CTX attempt on a worker the retry policy picked: (request, worker, whether CTX returns the b64 prompt).
CtxAttempt = Callable[[FlowRequest, PoolMember, bool], Awaitable[Reply]]
# Adds to a request's headers what GEN needs to accept CTX's hand-off (a signature over it, where required).
SignForGen = Callable[[dict[str, str], Mapping[str, Any] | None], None]


class Steps:
    def __init__(self, config: OrchestratorConfig, ctx_pool: WorkerPool, gen_pool: WorkerPool, metrics: Metrics,
                 retry: RetryPolicy, sign_for_gen: SignForGen) -> None:
        self.config = config
        self.ctx_pool = ctx_pool
        self.gen_pool = gen_pool
        self.metrics = metrics
        self.retry = retry
        self.protocols = build_protocols(config)
        self.releaser = HandoffReleaser(ctx_pool, self.protocol_of)
        self.migrations = Migrations(config.migration_limit, self)  # streams that break mid-way move on
        self.sign_for_gen = sign_for_gen
        self.ctx_latency = LabelledChildren(metrics.ctx_latency)  # by worker, looked up once per worker
        self.gen_first_byte = LabelledChildren(metrics.gen_first_byte)
        self.recomputes = RecomputeWatch(metrics, gen_pool.name)  # what of the prompt each GEN computed itself
        self.pairs = PairHealth()  # CTX/GEN pairs the pair probe keeps out of routing (orchestrator/pair_probe.py)
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
        return self.protocols[member.protocol if member is not None else DEFAULT_PROTOCOL]

    def wire(self, request: FlowRequest, member: PoolMember | None) -> WorkerProtocol:
        """The wire ``member`` is spoken to in for ``request``: its own, unless the request set one for both."""
        return request.wire or self.protocol_of(member)

    # -- CTX ------------------------------------------------------------------------------------------------------
    async def run_context_step(self, request: FlowRequest, attempt: CtxAttempt | None = None) -> ContextAnswer:
        """CTX's answer (also ``request.ctx``), each try made by ``attempt`` (a plain ``call_ctx`` by default),
        past the prefill gate; a CTX's own error answer is raised as ``RelayedError``."""
        gate = self.prefill_gate
        if gate is None:
            return await self._context_step(request, attempt or self.call_ctx)
        await gate.admit(request.priority)
        try:
            return await self._context_step(request, attempt or self.call_ctx)
        finally:
            gate.release(request.priority)

    async def _context_step(self, request: FlowRequest, attempt: CtxAttempt) -> ContextAnswer:
        return_tokens = self._ctx_returns_tokens(request)
        started = time.perf_counter()
        with tracing.span("ctx.call", request.span, headers=request.headers, client=True) as span:
            # Past the prefill gate some worker has room in its window: those without are picked last.
            full = [w for w in self.ctx_pool.workers if not w.has_room] if self.prefill_gate is not None else []
            if self.pairs:  # and those whose every routable GEN partner failed the pair probe
                full = [*full, *self.pairs.ctxs_to_avoid(self.ctx_pool.workers, self.gen_pool.workers)]
            answered = await self.retry.run(CTX_STEP, self.ctx_pool, request.key,
                                            lambda member: attempt(request, member, return_tokens), avoid=full,
                                            wait_from=request.started)
            spans.called(span, answered)
        request.ctx_worker = answered.member.url
        self.ctx_latency(answered.member.url).observe(time.perf_counter() - started)
        if answered.answer.status_code != 200:
            raise RelayedError(answered.answer.status_code, answered.answer.content)
        request.ctx = self.wire(request, answered.member).read_context_answer(answered.answer.content)
        learn_from_answer(self.ctx_pool.index, answered.member.url, request.key, request.ctx.response,
                          request.ctx.handoff, request.ctx.prompt_len)
        self.sign_for_gen(request.headers, request.ctx.handoff)  # for GEN, sent what CTX handed off
        return request.ctx

    async def call_ctx(self, request: FlowRequest, member: PoolMember, return_tokens: bool) -> Reply:
        """One CTX try on ``member``, in its own wire."""
        body = self.wire(request, member).context_request(request.body, return_prompt_tokens=return_tokens,
                                                          conversation_id=request.conversation_id)
        return await post(self.ctx_pool, member, request, body, request.key)

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
        wire = request.wire or self.protocol_of(next((w for w in self.ctx_pool.workers
                                                      if w.url == request.ctx_worker), None))
        response = wire.finished_response(ctx)
        if not request.streaming:
            return WholeAnswer(orjson.dumps(response))
        options = request.body.get("stream_options")
        options = options if isinstance(options, dict) else {}
        include_usage = options.get("include_usage") is True
        continuous = include_usage and options.get("continuous_usage_stats") is True
        return StreamedAnswer(_iterate(replay_as_stream(request.endpoint, response, include_usage, continuous)))

    async def redo_context(self, request: FlowRequest) -> ContextAnswer:
        request.ctx_redone = True
        self.metrics.retries.labels(step=CTX_STEP, reason=HANDOFF_LOST).inc()
        logger.warning("the KV hand-off was lost with a failed GEN; running CTX again")
        return await self.run_context_step(request)

    # -- the hand-off: what of the prompt travels with it --------------------------------------------------------
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

    # -- GEN, then the relay -------------------------------------------------------------------------------------
    async def call_gen(self, request: FlowRequest, key: RoutingKey, body_for: Callable[[PoolMember], Body],
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

        if self.pairs:  # GEN workers that failed the pair probe with this request's CTX: picked last
            avoid = (*avoid, *self.pairs.gens_to_avoid(request.ctx_worker, self.gen_pool.workers))
        started = time.perf_counter()
        with tracing.span("gen.call", request.span, headers=request.headers, client=True) as span:
            answered = await (retry or self.retry).run(GEN_STEP, self.gen_pool, key,
                                                       streamed if request.streaming else whole, avoid,
                                                       wait_from=request.started)
            spans.called(span, answered)
        if not isinstance(answered.answer, Reply):
            self.gen_first_byte(answered.member.url).observe(time.perf_counter() - started)
        self.recomputes.saw(answered.member.url, answered.answer.status_code, answered.answer.prompt_report,
                            request.ctx_worker)
        return answered

    def handoff_lost(self, request: FlowRequest, answered: Attempted[GenAnswer]) -> bool:
        """A retried GEN found the hand-off gone (an earlier GEN took it before failing): CTX must run again.
        After a CTX rerun any such answer counts, first attempt included: the hand-off was fresh."""
        return (isinstance(answered.answer, Reply) and (answered.attempts >= 2 or request.ctx_redone)
                and self.wire(request, answered.member).handoff_lost(answered.answer))

    def gen_answer(self, request: FlowRequest, answered: Attempted[GenAnswer], key: RoutingKey,
                   on_end: Callable[[], None] | None = None) -> Answer:
        """GEN's answer for the client; a stream is relayed, and ``on_end`` told when its end marker has passed."""
        answer = answered.answer
        if isinstance(answer, Reply):
            if answer.status_code != 200:
                raise RelayedError(answer.status_code, answer.content)
            return WholeAnswer(answer.content)
        relayed = RelayedStream(answer, answered.member, key.prompt_tokens, request.endpoint, request.started,
                                self.metrics, on_end, migration=self.migrations.for_request(request, answered.member))
        if request.span is None:  # nothing reads the pieces on the way: they may be pushed
            return StreamedAnswer(relayed.frames(), relayed.aclose, pushed=relayed)
        return StreamedAnswer(tracing.traced_frames("stream", request.span, relayed.frames()), relayed.aclose)


async def _iterate(frames: list[bytes]) -> AsyncIterator[bytes]:
    for frame in frames:
        yield frame

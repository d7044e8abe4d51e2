"""Which schedule a request's pair of workers runs: the one place a variant of the flow is chosen.

Context first for every pair, except TensorRT-LLM's variants, chosen from the config and what the workers
advertise (their ``GET /server_info``, read at their health checks): generation first where the config asks for it
(``trtllm.schedule_style``) and the CTX the router picks is a trtllm-serve worker that can run it (under lifecycle
v1: it and some GEN advertise GENERATION_FIRST); lifecycle v1 (``trtllm.lifecycle_protocol: auto``) where a CTX
advertises it. TensorRT-LLM has no per-request downgrade: a fleet is set up consistently.
"""

from __future__ import annotations

from frontend.config import OrchestratorConfig
from frontend.metrics import Metrics
from orchestrator.flow.context_first import ContextFirst
from orchestrator.flow.request import FlowRequest
from orchestrator.flow.schedule import Schedule
from orchestrator.member import PoolMember
from orchestrator.pool import WorkerPool
from orchestrator.protocols.trtllm.context_first_v1 import ContextFirstV1
from orchestrator.protocols.trtllm.generation_first import GenerationFirst
from orchestrator.protocols.trtllm.lifecycle import LifecycleClient, generation_first_capable, speaks_v1
from orchestrator.protocols.trtllm.wire import TrtllmProtocol


class ScheduleChoice:
    def __init__(self, config: OrchestratorConfig, ctx_pool: WorkerPool, gen_pool: WorkerPool, metrics: Metrics,
                 trtllm_auth_key: str | None = None) -> None:
        """``trtllm_auth_key``: TensorRT-LLM's internal_request_auth_key, for trtllm-serve workers that require it."""
        self.ctx_pool = ctx_pool
        self.gen_pool = gen_pool
        wire = TrtllmProtocol(strip_message_history=config.gen_strip_message_history, auth_key=trtllm_auth_key)
        lifecycle = LifecycleClient(config.trtllm, metrics, trtllm_auth_key)
        self.sign_for_gen = wire.sign  # a GEN request's signature, where trtllm-serve workers require one
        self.context_first = ContextFirst()
        self.v1 = config.trtllm.lifecycle_protocol == "auto"  # v1 with the workers that advertise it
        self.context_first_v1 = ContextFirstV1(self.context_first, lifecycle, wire)
        self.generation_first = (GenerationFirst(lifecycle, wire)
                                 if config.trtllm.schedule_style == "generation_first" else None)
        # Whether some CTX advertises v1, read again whenever a CTX's health changes (its advertisement is read
        # before it turns healthy): the pools of other fleets never run v1's schedule.
        self.v1_ctx = False
        ctx_pool.on_health_change.append(self._read_ctx_pool)
        self._read_ctx_pool()

    def choose(self, request: FlowRequest) -> Schedule:
        if self.generation_first is not None:
            ctx = self.ctx_pool.pick(request.key)
            if self._runs_generation_first(ctx):
                return self.generation_first.on(ctx, v1=self.v1 and speaks_v1(ctx))
        return self.context_first_v1 if self.v1_ctx else self.context_first

    def _runs_generation_first(self, ctx: PoolMember) -> bool:
        if ctx.protocol != "trtllm":
            return False
        if not (self.v1 and speaks_v1(ctx)):
            return True  # v0
        # A v1 CTX that can take part in generation first, and a v1 GEN that can: else the pair stays context first.
        return generation_first_capable(ctx) and any(w.routable and generation_first_capable(w)
                                                     for w in self.gen_pool.workers)

    def _read_ctx_pool(self) -> None:
        self.v1_ctx = self.v1 and any(speaks_v1(w) for w in self.ctx_pool.workers)

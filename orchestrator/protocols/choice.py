"""Which schedule a request's pair of workers runs: the one place a variant of the flow is chosen.

Context first for every pair, except TensorRT-LLM's variants, chosen from the config and what the workers
advertise (their ``GET /server_info``, read at their health checks): generation first where the config asks for it
(``trtllm.schedule_style``) and the CTX the router picks is a trtllm-serve worker that can run it (under lifecycle
v1: it and some GEN advertise GENERATION_FIRST); lifecycle v1 (``trtllm.lifecycle_protocol: auto``) where a CTX
advertises it. TensorRT-LLM has no per-request downgrade: a fleet is set up consistently.

A request TensorRT-LLM's wire cannot carry (``trtllm.wire.uncarried``) goes over our native wire where every
worker spoken to in TensorRT-LLM's also speaks ours, and is refused, whatever its placement, where one does not.
"""

from __future__ import annotations

from frontend.config import OrchestratorConfig
from frontend.errors import UnsupportedParameterError, UpstreamUnavailableError
from frontend.metrics import Metrics
from orchestrator.flow.context_first import ContextFirst
from orchestrator.flow.request import FlowRequest
from orchestrator.flow.schedule import Schedule
from orchestrator.member import PoolMember
from orchestrator.pool import WorkerPool
from orchestrator.protocols.native import NativeProtocol
from orchestrator.protocols.registry import TRTLLM
from orchestrator.protocols.trtllm.context_first_v1 import ContextFirstV1
from orchestrator.protocols.trtllm.generation_first import GenerationFirst
from orchestrator.protocols.trtllm.lifecycle import (
    LIFECYCLE_FLAG,
    LifecycleClient,
    generation_first_capable,
    speaks_v1,
)
from orchestrator.protocols.trtllm.wire import TrtllmProtocol, echoes_logprobs, uncarried


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
        self.native = NativeProtocol()
        # What the workers advertise, read again whenever one's health changes (its advertisement is read before it
        # turns healthy), so that a request of another fleet pays nothing for TensorRT-LLM's variants: some CTX
        # advertises v1; some worker is spoken to in TensorRT-LLM's wire; every such worker also speaks ours; some
        # worker advertises v1 to an orchestrator set to v0.
        self.v1_ctx = self.trtllm_wire = self.native_too = self.v1_unspoken = False
        for pool in (ctx_pool, gen_pool):
            pool.on_health_change.append(self._read_pools)
        self._read_pools()

    def choose_wire(self, request: FlowRequest) -> None:
        """Where some worker is spoken to in TensorRT-LLM's wire (``trtllm_wire``): a request it cannot carry goes
        over our native wire (``request.wire``) if every such worker speaks it too, else is refused; raised too
        where the workers advertise a lifecycle this orchestrator was set not to speak."""
        if self.v1_unspoken:
            raise UpstreamUnavailableError(
                f"the workers were started with lifecycle protocol v1 ({LIFECYCLE_FLAG}) and this orchestrator "
                "speaks v0 to them (trtllm.lifecycle_protocol: v0), which they refuse: start them without, or set "
                "trtllm.lifecycle_protocol: auto")
        what = uncarried(request.endpoint, request.body)
        if self.native_too and (what is not None or echoes_logprobs(request.endpoint, request.body)):
            request.wire = self.native
            return
        if what is None:
            return
        raise UnsupportedParameterError(
            f"{what[0]} is not served over TensorRT-LLM's disaggregated wire, the only one some of these workers "
            "speak (trtllm-serve): serve it with workers that also speak disagg-serve's native wire (announced in "
            "engine_info.disagg_protocols), as disagg-serve's own workers do", param=what[1])

    def choose(self, request: FlowRequest) -> Schedule:
        if request.wire is not None:
            return self.context_first  # the wire the request needs, whatever the pair's own
        if self.generation_first is not None:
            ctx = self.ctx_pool.pick(request.key)
            if self._runs_generation_first(ctx):
                return self.generation_first.on(ctx, v1=self.v1 and speaks_v1(ctx))
        return self.context_first_v1 if self.v1_ctx else self.context_first

    def _runs_generation_first(self, ctx: PoolMember) -> bool:
        if ctx.protocol != TRTLLM:
            return False
        if not (self.v1 and speaks_v1(ctx)):
            return True  # v0
        # A v1 CTX that can take part in generation first, and a v1 GEN that can: else the pair stays context first.
        return generation_first_capable(ctx) and any(w.routable and generation_first_capable(w)
                                                     for w in self.gen_pool.workers)

    def _read_pools(self) -> None:
        workers = [*self.ctx_pool.workers, *self.gen_pool.workers]
        self.v1_ctx = self.v1 and any(speaks_v1(w) for w in self.ctx_pool.workers)
        self.v1_unspoken = not self.v1 and any(speaks_v1(w) for w in workers)
        on_trtllm = [w for w in workers if w.protocol == TRTLLM]
        self.trtllm_wire = bool(on_trtllm) or self.v1_unspoken
        # Ours, started with lifecycle v1, serves our wire too (v1 governs TensorRT-LLM's wire only).
        self.native_too = all("native" in w.wires for w in on_trtllm)

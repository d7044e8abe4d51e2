"""One request, top to bottom: placement (GEN alone, or through CTX) -> the pair's schedule -> its answer.

How each step is written on the wire is the ``WorkerProtocol``'s business; which worker, and what happens when one
fails, the ``RetryPolicy``'s; which schedule a pair runs, ``orchestrator.protocols.choice``'s.
"""

from __future__ import annotations

from typing import Any

from frontend.config import OrchestratorConfig
from frontend.metrics import Metrics
from frontend.openai_output import Endpoint
from frontend.prefix_chain import CHAIN_HEADER
from orchestrator.flow.placement import Placement
from orchestrator.flow.request import Answer, FlowRequest
from orchestrator.flow.retry import RetryPolicy
from orchestrator.flow.steps import Steps
from orchestrator.pool import WorkerPool
from orchestrator.protocols.choice import ScheduleChoice
from orchestrator.routers import CacheAwareRouter, routing_key


class DisaggFlow:
    def __init__(self, config: OrchestratorConfig, ctx_pool: WorkerPool, gen_pool: WorkerPool, metrics: Metrics,
                 trtllm_auth_key: str | None = None) -> None:
        """``trtllm_auth_key``: TensorRT-LLM's internal_request_auth_key, for trtllm-serve workers that require it."""
        self.config = config
        self.ctx_pool = ctx_pool
        self.gen_pool = gen_pool
        self.metrics = metrics
        self.retry = RetryPolicy(config.max_retries, metrics)
        self.schedules = ScheduleChoice(config, ctx_pool, gen_pool, metrics, trtllm_auth_key)
        self.steps = Steps(config, ctx_pool, gen_pool, metrics, self.retry, self.schedules.sign_for_gen)
        self.placement = Placement(config.max_local_prefill_length, gen_pool, metrics)
        # The prefix chain costs one pass over the prompt: computed only where something reads it.
        self.needs_chain = (config.max_local_prefill_length > 0
                            or any(isinstance(p.router, CacheAwareRouter) for p in (ctx_pool, gen_pool)))

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
        request = FlowRequest(endpoint, body, key, started, headers, conversation_id=conversation_id)
        self.steps.migrations.ask_for_token_ids(request)
        return request

    async def run(self, request: FlowRequest) -> Answer:
        """The request's answer; a worker's own error answer is raised as ``RelayedError``."""
        if self.schedules.trtllm_wire:  # a request TensorRT-LLM's wire cannot carry: over ours, or refused
            self.schedules.choose_wire(request)
        if self.placement.may_skip_ctx:
            answer = await self.placement.run_on_gen_alone(request, self.steps)
            if answer is not None:
                return answer
        self.placement.count_on_ctx()
        schedule = self.schedules.choose(request)
        return await schedule.run(request, self.steps)

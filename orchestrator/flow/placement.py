"""Where a request's prompt is prefilled: on a GEN worker alone, or through CTX.

Conditional disaggregation (``max_local_prefill_length``): a short prompt is cheaper to prefill where it is decoded
than to send through CTX and a KV transfer, and so is a prompt whose uncached remainder is that short on the GEN
worker that holds the rest (a conversation's next turn, where GEN decoded the last one). Held means by that
worker's own KV events, never by a guess from what was sent there.
"""

from __future__ import annotations

import logging
from dataclasses import replace

from frontend.errors import UpstreamError
from frontend.metrics import LabelledChildren, Metrics
from frontend.prefix_chain import MAX_LINKS
from orchestrator.client_body import encode
from orchestrator.flow.request import Answer, FlowRequest
from orchestrator.flow.retry import RetryPolicy
from orchestrator.flow.steps import Steps
from orchestrator.metric_labels import ON_CTX, ON_GEN_CACHED, ON_GEN_SHORT
from orchestrator.pool import WorkerPool
from orchestrator.routers import RoutingKey, matched_tokens

logger = logging.getLogger("disagg_serve.flow")


class Placement:
    def __init__(self, threshold: int, gen_pool: WorkerPool, metrics: Metrics) -> None:
        self.threshold = threshold  # max_local_prefill_length
        self.may_skip_ctx = threshold > 0  # else every prompt goes through CTX
        self.gen_pool = gen_pool
        self.metrics = metrics
        self.single_attempt = RetryPolicy(0, metrics)  # the one GEN worker that holds the prompt, no other
        self.counted = LabelledChildren(metrics.prefill_placement)

    def count_on_ctx(self) -> None:
        self.counted(ON_CTX).inc()

    async def run_on_gen_alone(self, request: FlowRequest, steps: Steps) -> Answer | None:
        """The answer of a GEN worker that prefilled the prompt itself; None where the prompt goes through CTX
        (a long one, or one whose holder failed: never another GEN worker instead, it holds none of it)."""
        if request.key.prompt_tokens < self.threshold:
            self.metrics.local_prefill.inc()
            self.counted(ON_GEN_SHORT).inc()
            return await self._on_gen(request, request.key, steps.retry, steps)
        holder = prefix_holder_key(self.gen_pool, request.key, self.threshold)
        if holder is None:
            return None
        try:
            answer = await self._on_gen(request, holder, self.single_attempt, steps)
        except UpstreamError as exc:
            logger.warning("GEN worker %s, which holds the prompt, failed (%s); it goes through CTX",
                           holder.only, exc.message)
            return None
        self.counted(ON_GEN_CACHED).inc()
        return answer

    async def _on_gen(self, request: FlowRequest, key: RoutingKey, retry: RetryPolicy, steps: Steps) -> Answer:
        body = encode(request.body)
        answered = await steps.call_gen(request, key, lambda _: body, retry=retry)
        return steps.gen_answer(request, answered, key)


def prefix_holder_key(gen_pool: WorkerPool, key: RoutingKey, threshold: int) -> RoutingKey | None:
    """A key that sends the request to the GEN worker holding all but fewer than ``threshold`` of its prompt
    tokens, by that worker's own KV events (a guess from what was sent there is not enough to prefill a long
    prompt on GEN); None if no GEN worker does."""
    index = gen_pool.index
    best, best_matched = None, 0
    for worker in gen_pool.workers:
        if worker.healthy and index.publishes(worker.url):
            matched = matched_tokens(index, worker, key, events_only=True)
            if matched > best_matched or (matched == best_matched and best is not None
                                          and worker.inflight < best.inflight):
                best, best_matched = worker, matched
    # A prompt's tail shorter than its link is never named, so a follow-up's held part ends up to one link
    # before the previous prompt's end: allowed for, up to 512 B (a long prompt's tail, up to 32 KiB, is
    # not: that many tokens are more than the threshold means to let GEN prefill).
    tail = min(512, key.chain.link_bytes(min(len(key.chain.links), MAX_LINKS - 1)))
    allowance = key.prompt_tokens * tail // key.chain.total_bytes if key.chain.total_bytes else 0
    uncached = key.prompt_tokens - best_matched
    if best is None or not best_matched or uncached - allowance >= threshold:
        return None
    return replace(key, only=best.url, prefill_tokens={best.url: max(1, uncached)})

"""Conditional disaggregation on what is cached: the GEN worker that already holds all but a short remainder of a
prompt (a conversation's next turn, where GEN decoded the last one) may prefill that remainder itself, skipping CTX
and the KV transfer. Held means by that worker's own KV events, never by a guess from what was sent there.
"""

from __future__ import annotations

from dataclasses import replace

from frontend.prefix_chain import MAX_LINKS
from orchestrator.pool import WorkerPool
from orchestrator.routers import RoutingKey, matched_tokens


def gen_holding_prefix(gen_pool: WorkerPool, key: RoutingKey, threshold: int) -> RoutingKey | None:
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

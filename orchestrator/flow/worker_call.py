"""One call to a pool member, as the flow makes it: while it runs the member counts as carrying the prompt (its
load, for routing), and from then on as holding it, until its own KV events say otherwise."""

from __future__ import annotations

from orchestrator.flow.request import FlowRequest
from orchestrator.member import PoolMember
from orchestrator.metric_labels import GEN_POOL_NAME
from orchestrator.pool import WorkerPool
from orchestrator.routers import RoutingKey
from orchestrator.upstream.base import Body, Reply


def count_as_held(pool: WorkerPool, member: PoolMember, key: RoutingKey) -> None:
    """Until its events say so, ``member`` counts as holding the prompt it is sent. Not a GEN worker that
    publishes no events: whether it keeps a handed-off prompt is its engine's business, and a wrong guess would
    make it prefill a long prompt by itself."""
    if not key.chain.links or (member.facts is not None and not member.facts.kv_block_reuse):
        return  # a worker that says it reuses no KV holds nothing for anyone
    if pool.name != GEN_POOL_NAME or pool.index.publishes(member.url):
        pool.index.note_sent(member.url, key.chain)


async def post(pool: WorkerPool, member: PoolMember, request: FlowRequest, body: Body, key: RoutingKey) -> Reply:
    count_as_held(pool, member, key)
    with member.carrying(key.prompt_tokens, key.prefill_at(member.url)):
        return await member.transport.post(request.path, body, request.headers)

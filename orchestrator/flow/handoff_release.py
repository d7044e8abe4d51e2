"""Freeing a CTX's parked KV hand-off that no GEN will take, in the background, now rather than at its expiry.

Called when the client left, when no GEN could take the request, or when GEN refused it. Best effort: a
release that fails is only logged, since the hand-off expires on the CTX worker anyway.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable

from frontend.errors import UpstreamError
from orchestrator.member import PoolMember
from orchestrator.pool import WorkerPool
from orchestrator.protocols.base import ContextAnswer, WorkerProtocol

logger = logging.getLogger("disagg_serve.handoff_release")


class HandoffReleaser:
    def __init__(self, ctx_pool: WorkerPool, protocol_of: Callable[[PoolMember], WorkerProtocol],
                 timeout_s: float = 10.0) -> None:
        self.ctx_pool = ctx_pool
        self.protocol_of = protocol_of  # each CTX worker's own wire: a mixed pool releases each its own way
        self.timeout_s = timeout_s
        self._tasks: set[asyncio.Task[None]] = set()  # held so that a running release is not collected

    def release(self, ctx: ContextAnswer | None, ctx_worker: str | None, headers: dict[str, str],
                wire: WorkerProtocol | None = None) -> None:
        """Release ``ctx``'s hand-off on the CTX worker at URL ``ctx_worker``, if it is still in the pool, in ``wire``
        (the one it was made in) or else that worker's own."""
        member = next((w for w in self.ctx_pool.workers if w.url == ctx_worker), None)
        if member is None or ctx is None:
            return
        request = (wire or self.protocol_of(member)).release_request(ctx)
        if request is None:
            return
        path, body = request
        transport = member.transport

        async def release() -> None:
            try:
                await asyncio.wait_for(transport.post(path, body, headers), timeout=self.timeout_s)
            except (UpstreamError, TimeoutError) as exc:
                logger.info("could not release a hand-off on %s (%s); it expires on its own", member.url, exc)

        task = asyncio.get_running_loop().create_task(release())
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

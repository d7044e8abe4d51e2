"""Worker pools: membership, active health checks, and the router that picks a worker per request."""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import logging
from collections.abc import Iterable

import orjson

from frontend.errors import UpstreamError, UpstreamUnavailableError
from frontend.guardrail import GenEngineFacts
from orchestrator.upstream import WorkerClient

logger = logging.getLogger(__name__)


class RoundRobinRouter:
    """Cycles over the healthy workers; skips the ones already tried for this request."""

    def __init__(self) -> None:
        self._counter = itertools.count()

    def pick(self, workers: list[WorkerClient], exclude: Iterable[WorkerClient] = ()) -> WorkerClient | None:
        excluded = set(map(id, exclude))
        candidates = [w for w in workers if w.healthy and id(w) not in excluded]
        if not candidates:
            return None
        return candidates[next(self._counter) % len(candidates)]


class WorkerPool:
    def __init__(self, name: str, workers: list[WorkerClient], router: RoundRobinRouter) -> None:
        self.name = name
        self.workers = workers
        self.router = router

    @property
    def has_healthy(self) -> bool:
        return any(w.healthy for w in self.workers)

    def pick(self, exclude: Iterable[WorkerClient] = ()) -> WorkerClient:
        worker = self.router.pick(self.workers, exclude)
        if worker is None:
            tried = list(exclude)
            detail = f" (tried {', '.join(w.url for w in tried)})" if tried else ""
            raise UpstreamUnavailableError(f"no healthy {self.name} worker is available{detail}")
        return worker

    async def check_health(self, timeout_s: float) -> None:
        await asyncio.gather(*(self._check(worker, timeout_s) for worker in self.workers))

    async def _check(self, worker: WorkerClient, timeout_s: float) -> None:
        try:
            reply = await worker.get("/health", timeout_s)
            healthy = reply.status_code == 200
            if healthy and not worker.healthy:
                worker.facts = await self._engine_facts(worker, timeout_s)
        except UpstreamError:
            healthy = False
        if healthy != worker.healthy:
            logger.info("%s worker %s is now %s", self.name, worker.url, "healthy" if healthy else "unhealthy")
        worker.healthy = healthy

    @staticmethod
    async def _engine_facts(worker: WorkerClient, timeout_s: float) -> GenEngineFacts:
        # The guardrail needs GEN's real engine facts: ask the worker, never trust our own config.
        reply = await worker.get("/v1/models", timeout_s)
        try:
            info = orjson.loads(reply.content)["data"][0]["engine_info"]
            return GenEngineFacts(bool(info["kv_block_reuse"]), bool(info["prompt_tokens_in_handoff"]))
        except (orjson.JSONDecodeError, KeyError, IndexError, TypeError):
            logger.warning("worker %s reports no engine_info; assuming the most restrictive facts", worker.url)
            return GenEngineFacts(kv_block_reuse=True, prompt_tokens_in_handoff=False)

    async def aclose(self) -> None:
        await asyncio.gather(*(w.aclose() for w in self.workers))


class HealthMonitor:
    """Polls every pool on an interval so that routing only ever sees workers that answered lately."""

    def __init__(self, pools: list[WorkerPool], interval_s: float, timeout_s: float) -> None:
        self.pools = pools
        self.interval_s = interval_s
        self.timeout_s = timeout_s
        self._task: asyncio.Task[None] | None = None

    async def check_now(self) -> None:
        await asyncio.gather(*(pool.check_health(self.timeout_s) for pool in self.pools))

    async def _run(self) -> None:
        while True:
            try:
                await self.check_now()
            except Exception:  # a monitor that dies silently would freeze membership: log and go on
                logger.exception("health check round failed")
            await asyncio.sleep(self.interval_s)

    def start(self) -> None:
        self._task = asyncio.create_task(self._run(), name="health-monitor")

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task

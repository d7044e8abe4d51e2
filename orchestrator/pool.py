"""Worker pools: membership, active health checks with thresholds, and routing through a ``Router``.

The pool owns each member's state (``PoolMember``); the members' transports only move bytes.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Callable, Iterable
from dataclasses import dataclass

import orjson

from frontend.background import BackgroundLoop
from frontend.errors import UpstreamError, UpstreamUnavailableError
from frontend.guardrail import GenEngineFacts
from frontend.kv_events import reachable_endpoint
from orchestrator.cache_index import CacheIndex, EventSource
from orchestrator.circuit_breaker import CLOSED, CircuitBreaker
from orchestrator.member import UNKNOWN_ENGINE_FACTS, PoolMember
from orchestrator.protocols.registry import DEFAULT_PROTOCOL, announced_protocols, detect_protocol, read_advertisement
from orchestrator.routers import Router, RoutingKey
from orchestrator.upstream.base import Transport, WorkerTimeouts
from orchestrator.upstream.choice import make_transport

logger = logging.getLogger(__name__)

# While requests wait for a worker of an empty pool (``wait_for_worker``), the members that are down are checked this
# often, and the first good check takes one back: a restarted worker is used the moment it answers.
PROBE_WHILE_WAITING_S = 0.05
_RECHECK_S = 0.25  # a waiter also looks again this often: a circuit breaker turns half-open without an event


@dataclass(frozen=True)
class BreakerSettings:
    """Each member's circuit breaker (orchestrator/circuit_breaker.py), and where its state is reported."""

    failures: int = 5
    cooldown_s: float = 10.0
    on_change: Callable[[str, int], None] | None = None  # (worker url, new state)

    def make(self, url: str) -> CircuitBreaker:
        report = self.on_change
        breaker = CircuitBreaker(self.failures, self.cooldown_s,
                                 on_change=None if report is None else lambda state: report(url, state))
        if report is not None:
            report(url, CLOSED)
        return breaker


class WorkerPool:
    def __init__(
        self,
        name: str,
        router: Router,
        timeouts: WorkerTimeouts,
        *,
        failure_threshold: int = 2,
        recovery_threshold: int = 1,
        transport_factory: Callable[[str, WorkerTimeouts], Transport] = make_transport,
        protocol: str | None = None,
        index: CacheIndex | None = None,
        breaker: BreakerSettings | None = None,
        max_running: int | None = None,
        wait_for_worker_s: float = 0.0,
    ) -> None:
        self.name = name
        # What each member holds, from the KV events its card announces (and what was sent where); routers that
        # weigh caches read it, and so does conditional disaggregation.
        self.index = index if index is not None else CacheIndex()
        self.router = router
        self.timeouts = timeouts
        self.transport_factory = transport_factory
        self.protocol = protocol  # set in the config for the whole group; None: each worker's, from its card
        self.failure_threshold = failure_threshold
        self.recovery_threshold = recovery_threshold
        self.breaker = breaker or BreakerSettings()
        self.max_running = max_running  # each member's window (None: none)
        # How long a request that finds no worker waits for one to come back (``wait_for_worker``); 0: not at all.
        self.wait_for_worker_s = wait_for_worker_s
        self.on_health_change: list[Callable[[], None]] = []  # e.g. the prefill gate: room came or went
        self.on_added: list[Callable[[str], None]] = []  # told each new member's URL (its metric series at 0)
        self.workers: list[PoolMember] = []
        self._sources: dict[str, str] = {}  # url -> "static" | "dns" | "registered"
        self._closing: set[asyncio.Task[None]] = set()
        self._checking: set[PoolMember] = set()  # members whose health check is under way (monitor or probe)
        self._waiting = 0  # requests in ``wait_for_worker`` now
        self._came_back: asyncio.Event | None = None  # set (and replaced) each time a member turns healthy
        self._prober: asyncio.Task[None] | None = None  # checks the members that are down while requests wait

    # -- membership ---------------------------------------------------------------------------------------
    def add(self, url: str, source: str = "static") -> PoolMember:
        url = url.rstrip("/")
        for worker in self.workers:
            if worker.url == url:
                return worker
        worker = PoolMember(self.transport_factory(url, self.timeouts))
        worker.breaker = self.breaker.make(url)
        worker.max_running = self.max_running
        if self.protocol is not None:
            worker.protocol = self.protocol
        self.workers.append(worker)
        self._sources[url] = source
        logger.info("%s pool: added %s (%s)", self.name, url, source)
        for added in self.on_added:
            added(url)
        return worker

    def remove(self, url: str) -> bool:
        url = url.rstrip("/")
        worker = next((w for w in self.workers if w.url == url), None)
        if worker is None:
            return False
        self.workers.remove(worker)
        self._sources.pop(url, None)
        self.index.forget(url)
        worker.healthy = False
        logger.info("%s pool: removed %s (%d requests still finishing)", self.name, url, worker.inflight)
        task = asyncio.get_running_loop().create_task(self._close_when_idle(worker))
        self._closing.add(task)
        task.add_done_callback(self._closing.discard)
        return True

    def sync(self, urls: Iterable[str], source: str) -> None:
        """Make this source's members exactly ``urls``; members from other sources are left alone."""
        wanted = {u.rstrip("/") for u in urls}
        for url in wanted:
            self.add(url, source)
        for url, owner in list(self._sources.items()):
            if owner == source and url not in wanted:
                self.remove(url)

    async def _close_when_idle(self, worker: PoolMember) -> None:
        deadline = asyncio.get_running_loop().time() + self.timeouts.request_s
        # inflight is a plain counter bumped by many tasks; a poll twice a second is plenty for a drain.
        while worker.inflight and asyncio.get_running_loop().time() < deadline:  # noqa: ASYNC110
            await asyncio.sleep(0.5)
        await worker.transport.aclose()

    # -- routing ------------------------------------------------------------------------------------------
    @property
    def has_healthy(self) -> bool:
        return any(w.healthy for w in self.workers)

    def expects_worker(self) -> bool:
        """Whether a worker of this pool is expected to take requests again soon: one said it is draining (a
        restart or a rollout: it or its replacement comes back). A pool emptied by its configuration, its DNS name
        or the admin API expects none, nor one whose workers crashed or never answered: nothing says they return."""
        return any(w.draining and w.unroutable is None for w in self.workers)

    async def wait_for_worker(self, timeout_s: float | None = None) -> bool:
        """Wait up to ``timeout_s`` (default ``wait_for_worker_s``) until some member takes requests: True once one
        does, False at once when none is expected back (``expects_worker``), or when the time is up. While anyone
        waits, the members that are down are checked every ``PROBE_WHILE_WAITING_S`` and one good check takes a
        member back."""
        if any(w.routable for w in self.workers):
            return True
        if timeout_s is None:
            timeout_s = self.wait_for_worker_s
        if timeout_s <= 0:
            return False
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout_s
        self._waiting += 1
        if self._prober is None or self._prober.done():
            self._prober = loop.create_task(self._probe_while_waiting(), name=f"{self.name}-pool-probe")
        try:
            while not any(w.routable for w in self.workers):
                left = deadline - loop.time()
                if left <= 0 or not self.expects_worker():
                    return False
                if self._came_back is None:
                    self._came_back = asyncio.Event()
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(self._came_back.wait(), min(left, _RECHECK_S))
            return True
        finally:
            self._waiting -= 1

    async def _probe_while_waiting(self) -> None:
        while self._waiting:
            try:
                await asyncio.gather(*(self._check(w) for w in list(self.workers) if not w.healthy))
            except Exception:  # a probe that died silently would leave the waiters to the monitor's pace
                logger.exception("%s pool: checking the workers that are down failed", self.name)
            await asyncio.sleep(PROBE_WHILE_WAITING_S)

    def catching_up(self) -> list[str]:
        """Healthy workers whose KV-event history this process is still reading (``CacheIndex.catching_up``)."""
        return [w.url for w in self.workers if w.healthy and self.index.catching_up(w.url)]

    def pick(self, key: RoutingKey, exclude: Iterable[PoolMember] = ()) -> PoolMember:
        tried = list(exclude)
        only = key.only  # a request only one worker can take goes there or nowhere
        worker = self._only(only, tried) if only is not None else self.router.pick(self.workers, key, tried)
        if worker is None:
            detail = f" (tried {', '.join(w.url for w in tried)})" if tried else ""
            # A deployment mismatch is the operator's to fix: said, rather than left for the logs.
            detail += "".join(f"; {w.url} takes no requests: {w.unroutable}" for w in self.workers if w.unroutable)
            raise UpstreamUnavailableError(f"no healthy {self.name} worker is available{detail}")
        return worker

    def _only(self, url: str, tried: list[PoolMember]) -> PoolMember | None:
        """The one worker a request may go to (it holds what no other does), if it can take it."""
        return next((w for w in self.workers if w.url == url and w.routable and w not in tried), None)

    # -- health -------------------------------------------------------------------------------------------
    async def check_health(self) -> None:
        await asyncio.gather(*(self._check(worker) for worker in list(self.workers)))

    async def _check(self, worker: PoolMember) -> None:
        if worker in self._checking:  # the monitor's round and the waiters' probe met: one check is enough
            return
        self._checking.add(worker)
        try:
            await self._check_once(worker)
        finally:
            self._checking.discard(worker)

    async def _check_once(self, worker: PoolMember) -> None:
        try:
            reply = await worker.transport.get("/health", self.timeouts.health_s)
            ok = reply.status_code == 200
            if not ok and _says_draining(reply.content):
                self._draining(worker)
                return
            if ok and worker.facts is None:
                facts, worker.protocol = await self._describe(worker)
                # A worker whose advertisement could not be read (a trtllm-serve one's lifecycle) is not taken for
                # one that advertises nothing, nor one that cannot be spoken to for one that can: its facts stay
                # unset, it is not healthy yet, the next check reads it again.
                ok = await read_advertisement(worker, wire_fixed=self.protocol is not None)
                if ok:
                    worker.facts = facts
        except UpstreamError:
            ok = False
        was_healthy = worker.healthy
        # Requests waiting for a worker take one back on its first good check, not after the recovery threshold.
        worker.record_health(ok, self.failure_threshold, 1 if self._waiting else self.recovery_threshold)
        if worker.healthy != was_healthy:
            logger.info("%s worker %s is now %s", self.name, worker.url, "healthy" if worker.healthy else "unhealthy")
            if worker.healthy:
                # What its circuit breaker counted while it was down (refused connections, a restart's cut
                # streams) is health's, and said nothing of the process that answers now.
                if worker.breaker.state != CLOSED:
                    worker.breaker = self.breaker.make(worker.url)
                if self._came_back is not None:
                    self._came_back.set()
                    self._came_back = None
            for listener in self.on_health_change:
                listener()
            if not worker.healthy:
                # A worker that comes back may come back with another engine (and, restarted, with a new events
                # incarnation on its card: the index then starts its picture afresh).
                worker.facts = None

    def _draining(self, worker: PoolMember) -> None:
        """``worker`` says it is draining (its /health, or a 503 ``worker_draining`` answer): out of routing now,
        and not a failure (its breaker counts nothing)."""
        was_routable = worker.healthy
        worker.mark_draining()
        worker.facts = None  # it comes back as a new process, maybe with another engine
        if was_routable:
            logger.info("%s worker %s is draining: no new requests go there", self.name, worker.url)
            for listener in self.on_health_change:
                listener()

    def draining(self, worker: PoolMember) -> None:
        """A worker answered a request with 503 ``worker_draining``: as its /health would say (``_draining``)."""
        self._draining(worker)

    async def _describe(self, worker: PoolMember) -> tuple[GenEngineFacts, str]:
        """The worker's engine facts and the protocol it speaks, from its own model card."""
        # The guardrail needs GEN's real engine facts: ask the worker, never trust our own config.
        reply = await worker.transport.get("/v1/models", self.timeouts.health_s)
        try:
            card = orjson.loads(reply.content)["data"][0]
        except (orjson.JSONDecodeError, KeyError, IndexError, TypeError):
            card = {}
        if self.protocol is not None:
            protocol = self.protocol
        else:
            protocol = detect_protocol(card, worker.url) if isinstance(card, dict) else DEFAULT_PROTOCOL
        worker.wires = announced_protocols(card) if isinstance(card, dict) else frozenset()
        logger.info("%s worker %s speaks %s", self.name, worker.url, protocol)
        if worker in self.workers:  # not one removed while its card was being read: nothing would close it
            self.index.subscribe(worker.url, _event_source(card, worker.url))
            await self.index.describe(worker.url, card, worker.transport, self.timeouts.health_s)
        try:
            info = card["engine_info"]
            return GenEngineFacts(bool(info["kv_block_reuse"]), bool(info["prompt_tokens_in_handoff"])), protocol
        except (KeyError, TypeError):
            logger.warning("worker %s reports no engine_info; assuming the most restrictive facts", worker.url)
            return UNKNOWN_ENGINE_FACTS, protocol

    async def aclose(self) -> None:
        await self.index.aclose()
        if self._prober is not None:
            self._prober.cancel()
        for task in list(self._closing):
            task.cancel()
        await asyncio.gather(*(w.transport.aclose() for w in self.workers), *self._closing,
                             return_exceptions=True)


def _says_draining(content: bytes) -> bool:
    """Whether a worker's non-200 /health body says it is draining (workers/drain.py), not that it is broken."""
    try:
        return bool(orjson.loads(content).get("status") == "draining")
    except (orjson.JSONDecodeError, AttributeError):
        return False


def _event_source(card: object, worker_url: str) -> EventSource | None:
    """Where the worker publishes its KV events (``engine_info.kv_events`` on its card), if it does."""
    try:
        events = card["engine_info"]["kv_events"]  # type: ignore[index]
        endpoint = reachable_endpoint(str(events["endpoint"]), worker_url)
        replay = events.get("replay_endpoint")
        capacity = events.get("capacity_tokens", 0)
        return EventSource(endpoint, reachable_endpoint(str(replay), worker_url) if replay else None,
                           str(events.get("incarnation", "")), capacity if isinstance(capacity, int) else 0)
    except (KeyError, TypeError, AttributeError):
        return None


class PoolsWait:
    """The pools a request needs, for the admission queue (``orchestrator.admission.WorkerWait``): whether each
    that has no healthy worker expects one back, and waiting until they all have one."""

    def __init__(self, pools: list[WorkerPool]) -> None:
        self.pools = pools

    def expected(self) -> bool:
        lacking = [pool for pool in self.pools if not pool.has_healthy]
        return bool(lacking) and all(pool.expects_worker() for pool in lacking)

    async def back(self, timeout_s: float) -> None:
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout_s
        for pool in self.pools:
            if not pool.has_healthy and not await pool.wait_for_worker(max(0.0, deadline - loop.time())):
                raise UpstreamUnavailableError(f"no healthy {pool.name} worker is available: none came back "
                                               f"within {timeout_s:g} s")


class HealthMonitor(BackgroundLoop):
    """Polls every pool on an interval so that routing only ever sees workers that answered lately."""

    task_name = "health-monitor"

    def __init__(self, pools: list[WorkerPool], interval_s: float) -> None:
        self.pools = pools
        self.interval_s = interval_s

    async def check_now(self) -> None:
        await asyncio.gather(*(pool.check_health() for pool in self.pools))

    async def _run(self) -> None:
        while True:
            try:
                await self.check_now()
            except Exception:  # a monitor that dies silently would freeze membership: log and go on
                logger.exception("health check round failed")
            await asyncio.sleep(self.interval_s)


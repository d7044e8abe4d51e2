"""The one retry policy of every step that calls a worker: which worker next, after what, and when to give up.

A step is tried on one worker after another (the router picks, never one already tried) while it fails before
its answer: a transport error, or a 5xx status (for a stream: before the first byte). After ``max_retries``
retries, or once no untried worker is left, the last failure stands: a transport error is raised naming the step,
a 5xx answer is returned for the caller to relay with the worker's own message. A refused connection also takes
the worker out of routing at once (passive health). A 503 ``worker_draining`` (the worker is shutting down and ran
nothing) is no failure and no try: the request goes elsewhere. When no worker can take a request now but one of
the pool's may come back, it waits for one (``WorkerPool.wait_for_worker``), once. Any other status is an answer,
returned as it is.

Each outcome also feeds the worker's circuit breaker (orchestrator/circuit_breaker.py): a transport error or a
5xx that is not deterministic counts as the worker's failure, any other answer as its success.

A 4xx is never retried: the request is wrong, and would be on any worker. Nor is a *deterministic* failure: a 5xx
whose OpenAI error body has a ``code`` in ``frontend.errors.DETERMINISTIC_FAILURE_CODES`` — the worker's way of
saying "this request failed the engine, and would fail it anywhere". Only a worker that failed for reasons of its
own (a dead engine core, a full KV store, a timeout) is worth another try.
"""

from __future__ import annotations

import time
from collections.abc import Awaitable, Callable, Collection
from dataclasses import dataclass
from typing import Generic, Protocol, TypeVar

import orjson

from frontend.errors import (
    DETERMINISTIC_FAILURE_CODES,
    UpstreamError,
    UpstreamUnavailableError,
    WorkerDrainingError,
)
from frontend.metrics import Metrics
from orchestrator.circuit_breaker import Trial
from orchestrator.member import PoolMember
from orchestrator.pool import WorkerPool
from orchestrator.routers import RoutingKey


class _Answered(Protocol):
    @property
    def status_code(self) -> int: ...


AnswerT = TypeVar("AnswerT", bound=_Answered)


@dataclass(frozen=True, slots=True)
class Attempted(Generic[AnswerT]):
    answer: AnswerT
    member: PoolMember  # the worker that gave it
    attempts: int  # workers tried, this one included
    failed: tuple[PoolMember, ...] = ()  # the workers tried before it, which failed


class RetryPolicy:
    def __init__(self, max_retries: int, metrics: Metrics) -> None:
        self.max_retries = max_retries
        self.metrics = metrics

    async def run(
        self,
        step: str,
        pool: WorkerPool,
        key: RoutingKey,
        attempt: Callable[[PoolMember], Awaitable[AnswerT]],
        avoid: Collection[PoolMember] = (),
        judges_workers: bool = True,
        wait_from: float | None = None,
    ) -> Attempted[AnswerT]:
        """Run ``attempt`` on workers of ``pool`` until one answers (``step`` names it in errors and metrics).

        ``attempt`` must not leave a 5xx answer open: the policy drops it and moves on. ``avoid`` are workers that
        already failed this request in an earlier round (a health check may still find them fine): they are
        picked only when no other worker is left. ``judges_workers``: whether outcomes feed the workers' circuit
        breakers (not for a cheap GET that says nothing of how a worker serves requests). ``wait_from``: when the
        request began (``time.perf_counter``): its wait for a worker expected back is what is left of the pool's
        bound since then, so that the admission queue's wait and each step's add up to that bound, not to one each.
        """
        tried: list[PoolMember] = []
        last: Attempted[AnswerT] | UpstreamError | None = None  # the failure that stands if no worker is left
        waited = False
        while True:
            try:
                member = _pick(pool, key, tried, avoid)
            except UpstreamUnavailableError:
                # None to take it now, but one may come back (restarting, draining): the request waits for it,
                # once, up to the pool's bound (the admission queue's timeout).
                if not waited and await pool.wait_for_worker(_left(pool, wait_from)):
                    waited = True
                    continue
                # No untried worker left: the last failure stands. A healthy worker that answered 5xx is not
                # 'unavailable': its own answer is what the client gets.
                if isinstance(last, UpstreamError):
                    raise _named(step, len(tried), last) from last
                if last is None:
                    raise
                return last
            tried.append(member)
            breaker = member.breaker if judges_workers else _UNJUDGED
            trial = breaker.started()
            try:
                answer = await attempt(member)
            except UpstreamError as exc:
                breaker.failed(trial)
                if isinstance(exc, UpstreamUnavailableError):
                    member.mark_unreachable()
                if self._out_of_retries(tried):
                    raise _named(step, len(tried), exc) from exc
                self.metrics.retries.labels(step=step, reason=type(exc).__name__).inc()
                self.metrics.failovers.labels(step=step).inc()
                last = exc
                continue
            except BaseException:  # cancelled (the client left): no outcome for the worker
                breaker.abandoned(trial)
                raise
            if answer.status_code == 503 and is_draining(answer):
                # Refused unrun by a worker that is shutting down: not its failure, and not a try of this request.
                breaker.abandoned(trial)
                pool.draining(member)
                tried.pop()
                continue
            answered = Attempted(answer, member, len(tried), tuple(tried[:-1]))
            worker_failed = answer.status_code >= 500 and not is_deterministic(answer)
            if worker_failed:
                breaker.failed(trial)
            else:
                breaker.succeeded(trial)
            if worker_failed and not self._out_of_retries(tried):
                self.metrics.retries.labels(step=step, reason="status_5xx").inc()
                last = answered
                continue
            return answered

    def _out_of_retries(self, tried: list[PoolMember]) -> bool:
        return len(tried) > self.max_retries


class _Unjudged:
    """The breaker of a call whose outcome says nothing of the worker: it records nothing."""

    def started(self) -> Trial:
        return Trial(0, False)

    def failed(self, trial: Trial) -> None: ...

    def succeeded(self, trial: Trial) -> None: ...

    def abandoned(self, trial: Trial) -> None: ...


_UNJUDGED = _Unjudged()


def _pick(pool: WorkerPool, key: RoutingKey, tried: list[PoolMember], avoid: Collection[PoolMember]) -> PoolMember:
    if avoid:
        try:
            return pool.pick(key, [*tried, *avoid])
        except UpstreamUnavailableError:
            pass  # only workers that failed before are left: one of them may do now
    return pool.pick(key, tried)


def _named(step: str, attempts: int, exc: UpstreamError) -> UpstreamError:
    return type(exc)(f"the {step.upper()} step failed after {attempts} attempt(s): {exc.message}")


def is_deterministic(answer: _Answered) -> bool:
    """Whether a worker's 5xx says the request itself failed the engine (``DETERMINISTIC_FAILURE_CODES``)."""
    return _error_code(answer) in DETERMINISTIC_FAILURE_CODES


def _left(pool: WorkerPool, wait_from: float | None) -> float | None:
    """How long a request that began at ``wait_from`` may still wait for one of ``pool``'s workers."""
    if wait_from is None:
        return None  # the pool's whole bound
    return max(0.0, pool.wait_for_worker_s - (time.perf_counter() - wait_from))


def is_draining(answer: _Answered) -> bool:
    """Whether a worker's answer is its refusal while it drains (``WorkerDrainingError``: nothing of it ran)."""
    return _error_code(answer) == WorkerDrainingError.default_code


def _error_code(answer: _Answered) -> object:
    content = getattr(answer, "content", None)
    if not isinstance(content, bytes):
        return None
    try:
        return orjson.loads(content)["error"]["code"]
    except (orjson.JSONDecodeError, KeyError, TypeError):
        return None

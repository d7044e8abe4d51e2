"""The one retry policy of every step that calls a worker: which worker next, after what, and when to give up.

A step is tried on one worker after another (the router picks, never one already tried) while it fails before
its answer: a transport error, or a 5xx status (for a stream: before the first byte). After ``max_retries``
retries a transport error is raised naming the step, and a 5xx answer is returned for the caller to relay. A
refused connection also takes the worker out of routing at once (passive health). Any other status is an
answer, returned as it is.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Generic, Protocol, TypeVar

from frontend.errors import UpstreamError, UpstreamUnavailableError
from frontend.metrics import Metrics
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
    ) -> Attempted[AnswerT]:
        """Run ``attempt`` on workers of ``pool`` until one answers (``step`` names it in errors and metrics).

        ``attempt`` must not leave a 5xx answer open: the policy drops it and moves on.
        """
        tried: list[PoolMember] = []
        while True:
            member = pool.pick(key, tried)
            tried.append(member)
            try:
                answer = await attempt(member)
            except UpstreamError as exc:
                if isinstance(exc, UpstreamUnavailableError):
                    member.mark_unreachable()
                if self._out_of_retries(tried):
                    raise type(exc)(f"the {step.upper()} step failed after {len(tried)} attempt(s): "
                                    f"{exc.message}") from exc
                self.metrics.retries.labels(step=step, reason=type(exc).__name__).inc()
                self.metrics.failovers.labels(step=step).inc()
                continue
            if answer.status_code >= 500 and not self._out_of_retries(tried):
                self.metrics.retries.labels(step=step, reason="status_5xx").inc()
                continue
            return Attempted(answer, member, len(tried))

    def _out_of_retries(self, tried: list[PoolMember]) -> bool:
        return len(tried) > self.max_retries

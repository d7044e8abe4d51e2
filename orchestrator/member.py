"""One worker as its pool knows it: its transport, its health, its load as counted here, and its engine facts.

The transport only moves bytes; everything a router or the guardrail reads about a worker lives here.
"""

from __future__ import annotations

from types import TracebackType
from typing import Any

from frontend.guardrail import GenEngineFacts
from frontend.trtllm.lifecycle import TransceiverLifecycleAdvertisement
from orchestrator.circuit_breaker import CircuitBreaker
from orchestrator.upstream.base import Transport

# Until a worker has told us, assume the facts under which metadata-only is never admitted.
UNKNOWN_ENGINE_FACTS = GenEngineFacts(kv_block_reuse=True, prompt_tokens_in_handoff=False)


class PoolMember:
    def __init__(self, transport: Transport) -> None:
        self.transport = transport
        self.url = transport.url
        self.healthy = False
        self.facts: GenEngineFacts | None = None  # from the worker's /v1/models, once it is healthy
        self.protocol = "native"  # the wire it is spoken to in (orchestrator.protocols.registry), read with the facts
        self.wires: frozenset[str] = frozenset()  # every wire its card announces that this orchestrator knows
        # A trtllm-serve worker's lifecycle v1 advertisement (its GET /server_info), read with the facts; None: v0.
        self.lifecycle: TransceiverLifecycleAdvertisement | None = None
        self.disagg_info: dict[str, Any] | None = None  # its GET /server_info's disaggregated_params
        self.unroutable: str | None = None  # why it takes no requests though it answers (a deployment mismatch)
        # It said it is draining (its /health, or a 503 ``worker_draining`` answer): out of routing at once, not
        # counted as a failure; a check that finds it healthy again (a new process on the address) clears it.
        self.draining = False
        self.inflight = 0
        self.inflight_prompt_tokens = 0
        self.inflight_prefill_tokens = 0  # of those, the ones a cache-aware router expects it to compute
        self._failures = 0  # health checks failed in a row
        self._successes = 0  # health checks passed in a row
        # Request outcomes (orchestrator/circuit_breaker.py); the pool gives each member its own settings.
        self.breaker = CircuitBreaker(failures=5, cooldown_s=10.0)

        self.max_running: int | None = None  # requests it may be given at once (a CTX worker's prefill window)

    @property
    def routable(self) -> bool:
        """Whether a router may give it a request now: healthy, and its circuit breaker lets one through."""
        return self.healthy and self.breaker.allows()

    @property
    def has_room(self) -> bool:
        """Below its window (``max_running``), if it has one."""
        return self.max_running is None or self.inflight < self.max_running

    @property
    def engine_facts(self) -> GenEngineFacts:
        return self.facts or UNKNOWN_ENGINE_FACTS

    def record_health(self, ok: bool, failure_threshold: int, recovery_threshold: int) -> None:
        if ok:
            self._failures = 0
            self._successes += 1
            if not self.healthy and self._successes >= recovery_threshold:
                self.healthy = True
                self.draining = False
        else:
            self._successes = 0
            self._failures += 1
            if self.healthy and self._failures >= failure_threshold:
                self.healthy = False

    def mark_draining(self) -> None:
        """The worker is shutting down gracefully: no new request goes there until a health check passes again."""
        self.draining = True
        self.healthy = False
        self._successes = 0

    def mark_unreachable(self) -> None:
        """Passive health: a refused connection takes the worker out at once; the monitor brings it back."""
        self.healthy = False
        self._successes = 0

    def carrying(self, prompt_tokens: int, prefill_tokens: int | None = None) -> Carrying:
        """Count one request (its prompt tokens, and those of them not cached here) in flight on this worker
        while the ``with`` block runs."""
        return Carrying(self, prompt_tokens, prompt_tokens if prefill_tokens is None else prefill_tokens)

    def __repr__(self) -> str:
        return f"PoolMember({self.url!r}, healthy={self.healthy}, inflight={self.inflight})"


class Carrying:
    """``PoolMember.carrying``: a class, not a ``@contextmanager`` generator, because every upstream call of every
    request enters one (the generator's machinery was ~1 % of the orchestrator's samples at 131k metadata-only)."""

    __slots__ = ("_member", "_prefill_tokens", "_prompt_tokens")

    def __init__(self, member: PoolMember, prompt_tokens: int, prefill_tokens: int) -> None:
        self._member = member
        self._prompt_tokens = prompt_tokens
        self._prefill_tokens = prefill_tokens

    def __enter__(self) -> None:
        self._member.inflight += 1
        self._member.inflight_prompt_tokens += self._prompt_tokens
        self._member.inflight_prefill_tokens += self._prefill_tokens

    def __exit__(self, kind: type[BaseException] | None, error: BaseException | None,
                 traceback: TracebackType | None) -> None:
        self._member.inflight -= 1
        self._member.inflight_prompt_tokens -= self._prompt_tokens
        self._member.inflight_prefill_tokens -= self._prefill_tokens

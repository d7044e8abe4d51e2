"""Tenants: who a request is (by its API key) and what it may still spend, before it waits for a running slot.

Every rate is a token bucket. Prompt tokens are charged in three steps (the body's size, the estimate of the
expanded prompt, the workers' own count) so that a limit holds in tokens over time; completion tokens as they
stream, so an overspent tenant waits until its debt is paid. Limits are per process. See docs/admission.md#tenants."""

from __future__ import annotations

import hmac
import math
import os
import re
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass

from frontend.config import TenantConfig
from frontend.errors import OverloadedError
from frontend.metrics import Metrics
from frontend.sse import close_frames
from orchestrator.admission import PRIORITIES

BYTES_PER_TOKEN = 4  # the estimate's ratio, as the routers' (orchestrator/routers.py: routing_key)
# A whole answer's output tokens: chat and completions say completion_tokens, Responses say output_tokens.
_USAGE = re.compile(rb'"(?:completion|output)_tokens"\s*:\s*(\d+)')
# ... and its prompt's: chat and completions say prompt_tokens, Responses say input_tokens.
_PROMPT_USAGE = re.compile(rb'"(?:prompt|input)_tokens"\s*:\s*(\d+)')
_EVENT = b"data: "
LIMITS = ("concurrent", "requests_per_s", "prompt_tokens_per_s", "completion_tokens_per_s")  # the metric's label


class TenantLimitError(OverloadedError):
    default_code = "tenant_rate_limited"


class TokenBucket:
    """``rate`` units a second, up to ``capacity`` held; spending may take it below zero (a debt)."""

    def __init__(self, rate: float, capacity: float, clock: Callable[[], float]) -> None:
        self.rate = rate
        self.capacity = capacity
        self._clock = clock
        self._level = capacity
        self._at = clock()

    def level(self) -> float:
        now = self._clock()
        self._level = min(self.capacity, self._level + (now - self._at) * self.rate)
        self._at = now
        return self._level

    def seconds_until(self, amount: float) -> float:
        """0 when ``amount`` can be spent now, else how long until it can."""
        missing = min(amount, self.capacity) - self.level()
        return max(0.0, missing / self.rate)

    def spend(self, amount: float) -> None:
        self.level()
        self._level -= amount


@dataclass(eq=False)
class Tenant:
    name: str
    key: bytes
    priority: int
    max_concurrent: int | None
    requests: TokenBucket | None
    prompt_tokens: TokenBucket | None
    completion_tokens: TokenBucket | None
    running: int = 0

    @property
    def counts_completions(self) -> bool:
        return self.completion_tokens is not None


def _bucket(rate: float | None, config: TenantConfig, share: float, clock: Callable[[], float]) -> TokenBucket | None:
    if rate is None:
        return None
    per_process = rate * share
    return TokenBucket(per_process, max(1.0, per_process * config.burst_s), clock)


class Tenants:
    def __init__(self, configs: list[TenantConfig], metrics: Metrics, *, process_share: float = 1.0,
                 environ: dict[str, str] | None = None, clock: Callable[[], float] = time.monotonic) -> None:
        env = os.environ if environ is None else environ
        self._tenants: list[Tenant] = []
        for config in configs:
            key = env.get(config.api_key_env, "")
            if not key:
                raise ValueError(f"tenant '{config.name}': the environment variable {config.api_key_env} that "
                                 "holds its API key is not set")
            concurrent = None if config.max_concurrent is None else max(1, math.floor(
                config.max_concurrent * process_share))
            self._tenants.append(Tenant(
                config.name, key.encode(), PRIORITIES.index(config.priority), concurrent,
                _bucket(config.requests_per_s, config, process_share, clock),
                _bucket(config.prompt_tokens_per_s, config, process_share, clock),
                _bucket(config.completion_tokens_per_s, config, process_share, clock)))
        self._refused = metrics.tenant_refusals
        for tenant in self._tenants:  # exported at 0 from start-up, so rate() has its zero
            for limit in LIMITS:
                self._refused.labels(tenant=tenant.name, limit=limit)

    def __bool__(self) -> bool:
        return bool(self._tenants)

    def identify(self, authorization: str | None) -> Tenant | None:
        """The tenant whose key the request presents; None if it presents none of theirs. Every key is compared
        (in constant time), so the time taken says nothing of which matched."""
        scheme, _, presented = (authorization or "").partition(" ")
        if scheme.lower() != "bearer":
            return None
        candidate = presented.strip().encode()
        found = None
        for tenant in self._tenants:
            if hmac.compare_digest(candidate, tenant.key):
                found = tenant
        return found

    def admit(self, tenant: Tenant, body_bytes: int) -> int:
        """Count the request against its tenant's limits, or raise a 429 that names the one it is over. Returns
        the prompt tokens charged for it (an estimate from its body's size, corrected by ``charge_prompt`` and
        ``settle_prompt`` once more is known)."""
        prompt_tokens = body_bytes // BYTES_PER_TOKEN + 1
        if tenant.max_concurrent is not None and tenant.running >= tenant.max_concurrent:
            self._refuse(tenant, "concurrent", f"max_concurrent: {tenant.max_concurrent} requests at once", 1.0)
        for bucket, limit, amount in ((tenant.requests, "requests_per_s", 1),
                                      (tenant.prompt_tokens, "prompt_tokens_per_s", prompt_tokens),
                                      (tenant.completion_tokens, "completion_tokens_per_s", 1)):
            if bucket is not None and (wait := bucket.seconds_until(amount)) > 0:
                unit = limit.removesuffix("_per_s").replace("_", " ")
                self._refuse(tenant, limit, f"{limit}: {bucket.rate:g} {unit} per second", wait)
        if tenant.requests is not None:
            tenant.requests.spend(1)
        if tenant.prompt_tokens is not None:
            tenant.prompt_tokens.spend(prompt_tokens)
        tenant.running += 1
        return prompt_tokens

    def charge_prompt(self, tenant: Tenant, charged: int, expected: int) -> int:
        """The prompt the workers will be sent is ``expected`` tokens (estimated from the parsed body, a stored
        conversation included), where ``charged`` were charged for it: if that is more, the whole prompt is
        checked as ``admit`` checks it, as if ``charged`` had never been spent, and spent, or a 429 that names the
        limit (and the charge given back: nothing will be prefilled). Returns what is now charged."""
        bucket = tenant.prompt_tokens
        if bucket is None or expected <= charged:
            return charged  # (a body's bytes count its JSON too: what was charged stays until it is settled)
        bucket.spend(-charged)
        if (wait := bucket.seconds_until(expected)) > 0:
            self._refuse(tenant, "prompt_tokens_per_s", f"prompt_tokens_per_s: {bucket.rate:g} prompt tokens per "
                         "second", wait)
        bucket.spend(expected)
        return expected

    @staticmethod
    def settle_prompt(tenant: Tenant, charged: int, counted: int | None) -> None:
        """The workers counted the prompt (``counted`` tokens; None: they did not say): the difference from what was
        charged is spent, or given back, so the limit holds in real tokens however the text tokenizes."""
        if tenant.prompt_tokens is not None and counted is not None:
            tenant.prompt_tokens.spend(counted - charged)

    @staticmethod
    def prompt_tokens_of(content: bytes) -> int | None:
        """A whole answer's prompt tokens, from its ``usage`` (None when it has none)."""
        found = _PROMPT_USAGE.search(content)
        return None if found is None else int(found[1])

    def _refuse(self, tenant: Tenant, limit: str, what: str, wait_s: float) -> None:
        self._refused.labels(tenant=tenant.name, limit=limit).inc()
        raise TenantLimitError(f"tenant '{tenant.name}' is over its limit {what}",
                               retry_after_s=max(1, math.ceil(wait_s)))

    @staticmethod
    def finished(tenant: Tenant) -> None:
        tenant.running -= 1

    @staticmethod
    def spend_whole(tenant: Tenant, content: bytes) -> None:
        """A whole answer's completion tokens, from its ``usage`` (every choice's, summed by the worker; a
        Responses answer's ``output_tokens``)."""
        if tenant.completion_tokens is not None and (found := _USAGE.search(content)) is not None:
            tenant.completion_tokens.spend(int(found[1]))

    @staticmethod
    async def spend_streamed(tenant: Tenant, frames: AsyncIterator[bytes]) -> AsyncIterator[bytes]:
        """``frames``, passed through, each streamed event spent as one completion token as it goes."""
        bucket = tenant.completion_tokens
        assert bucket is not None
        try:
            async for chunk in frames:
                bucket.spend(chunk.count(_EVENT))
                yield chunk
        finally:
            await close_frames(frames)

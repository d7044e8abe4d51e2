"""The settings of TensorRT-LLM's lifecycle protocol v1 on a worker (``workers.trtllm.lifecycle``)."""

from __future__ import annotations

import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

from frontend.trtllm.lifecycle import (
    ARTIFACT_TTL_ENV,
    DEFAULT_ARTIFACT_TTL_S,
    DEFAULT_GRANT_TTL_S,
    GENERATION_SAFE,
    GRANT_TTL_ENV,
    protocol_version_from_env,
)

DEFAULT_REPLAY_FILTER_CAPACITY = 262144  # TensorRT-LLM's replay_filter_capacity


@dataclass(frozen=True, slots=True)
class LifecycleSettings:
    """``protocol_version`` 1 turns v1 on (TensorRT-LLM's env var or ``--lifecycle-protocol-version``)."""

    protocol_version: int = 0
    grant_ttl_s: float = DEFAULT_GRANT_TTL_S
    artifact_ttl_s: float = DEFAULT_ARTIFACT_TTL_S
    max_live_grants: int = 512
    replay_filter_capacity: int = DEFAULT_REPLAY_FILTER_CAPACITY  # live entries and tombstones, each role
    sweep_interval_s: float = 1.0
    generation_first_wait_s: float = 30.0  # how long a GEN that came first waits for its CTX's hand-off
    # A grant must be bound to its GEN request within this lease, or it is revoked: an orchestrator sends GEN its
    # request right after the grant (each grant call is bounded by TensorRT-LLM's 30 s admission timeout), so only a
    # caller that hoards grants ever reaches it, and credit it holds without a request is back within the lease,
    # not after the grant's TTL (600 s). Renewals do not extend it.
    grant_bind_lease_s: float = 60.0
    # Unbound grants one caller (one peer address) may hold at once; None: an eighth of max_live_grants (at least
    # 8). A real orchestrator holds one per admission in flight, for milliseconds; this keeps one peer from taking
    # all the credit even within the lease.
    max_unbound_grants_per_caller: int | None = None
    clock: Callable[[], float] = time.monotonic

    @property
    def enabled(self) -> bool:
        return self.protocol_version == GENERATION_SAFE

    @property
    def unbound_grants_per_caller(self) -> int:
        if self.max_unbound_grants_per_caller is not None:
            return self.max_unbound_grants_per_caller
        return max(8, self.max_live_grants // 8)

    @property
    def replay_horizon_s(self) -> float:
        return 2.0 * max(self.grant_ttl_s, self.artifact_ttl_s)  # TensorRT-LLM's default


def lifecycle_settings_from_env(environ: Mapping[str, str], protocol_version: int | None = None,
                                **overrides: Any) -> LifecycleSettings:
    """Settings as TensorRT-LLM's workers read them from the environment; an explicit flag wins over the env."""
    version = protocol_version if protocol_version is not None else protocol_version_from_env(environ)
    values: dict[str, Any] = {"protocol_version": version}
    for key, env in (("grant_ttl_s", GRANT_TTL_ENV), ("artifact_ttl_s", ARTIFACT_TTL_ENV)):
        if environ.get(env):
            values[key] = float(environ[env])
    values.update({k: v for k, v in overrides.items() if v is not None})
    for key in ("grant_ttl_s", "artifact_ttl_s"):
        if values.get(key, 1.0) <= 0:
            raise ValueError(f"{key} must be positive")
    return LifecycleSettings(**values)

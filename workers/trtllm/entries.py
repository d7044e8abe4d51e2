"""The entries of TensorRT-LLM's lifecycle v1 (``workers.trtllm.lifecycle``): a grant (GEN) or an artifact (CTX), live
or a tombstone, the attempt identity both are matched by, and the error for a call that contradicts them.

Up to 262,144 tombstones of each are kept for the replay horizon, so an entry keeps only fixed-size digests of what a
replay is compared with, never the caller's request: a few hundred bytes whatever was sent.
"""

from __future__ import annotations

import asyncio
import hashlib
from collections import OrderedDict
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any
from uuid import UUID

import orjson

from frontend.trtllm.identity import IDENTITY_FIELDS
from frontend.trtllm.lifecycle import ArtifactState, GenerationGrantRequest, GrantState

MAX_REASON = 256  # characters of a caller's reason kept (and answered back) for a terminal entry


@dataclass(slots=True)
class Grant:
    """A grant, live (``request`` kept: an abort tells its CTX to free the KV) or a tombstone (``request`` None)."""

    grant_id: UUID  # its consumer_grant_id
    request: GenerationGrantRequest | None
    attempt: bytes  # attempt_of(the request): what renew / abort / bind are matched by
    facts: bytes  # admission_facts(the request): what a replay of the grant call is matched by
    transfer_session_id: UUID
    expires_at: float
    bind_by: float = float("inf")  # the admission lease: bound to a request by then, or revoked
    caller: str | None = None  # who asked for it, while it is unbound (counted per caller)
    state: GrantState = GrantState.ACTIVE
    reason: str = ""
    last_sequence: int = -1
    request_id: str | None = None  # the engine request bound to it
    handoff_taken: bool = False  # the bound request has its KV: CTX holds nothing more for it
    retain_until: float = 0.0
    ended: asyncio.Event | None = None  # set when the grant ends: wakes a request waiting under it


@dataclass(slots=True)
class Artifact:
    key: str  # its prefill_artifact_id
    attempt: bytes  # attempt_of(the identity it was created for)
    ctx_request_id: str | None = None
    handoff_state: bytes | None = None
    expires_at: float = 0.0
    state: ArtifactState = ArtifactState.ACTIVE
    reason: str = ""
    retain_until: float = 0.0


def attempt_of(fields: Any) -> bytes:
    """The attempt identity as one fixed-size digest (UUIDs and their canonical strings alike): equal attempts,
    equal digests."""
    get = fields.get if isinstance(fields, Mapping) else lambda name: getattr(fields, name)
    return hashlib.sha256("\0".join(str(get(name)) for name in IDENTITY_FIELDS).encode()).digest()


def admission_facts(request: GenerationGrantRequest) -> bytes:
    """A digest of everything a grant was admitted on but the TTL asked for: a replay must match it exactly."""
    return hashlib.sha256(orjson.dumps(request.model_dump(mode="json", exclude={"ttl_s"}),
                                       option=orjson.OPT_SORT_KEYS)).digest()


def short_reason(reason: str) -> str:
    return reason if len(reason) <= MAX_REASON else reason[:MAX_REASON - 3] + "..."


def forget_expired(tombstones: OrderedDict[Any, Any], entries: dict[Any, Any], now: float) -> None:
    """Pop the tombstones past their replay horizon, from the front of their order of expiry."""
    while tombstones:
        key, entry = next(iter(tombstones.items()))
        if now < entry.retain_until:
            return
        del tombstones[key]
        if entries.get(key) is entry:
            del entries[key]


class LifecycleConflict(Exception):
    """A control call that contradicts what this worker holds: TensorRT-LLM answers 409 with the message."""

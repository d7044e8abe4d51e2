"""What ``workers.lifecycle.LifecycleControl`` keeps: a grant (GEN) or an artifact (CTX), live or a tombstone, and
the attempt identity both are matched by, and the error for a call that contradicts them."""

from __future__ import annotations

import asyncio
from collections import OrderedDict
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from frontend.trtllm_identity import IDENTITY_FIELDS
from frontend.trtllm_lifecycle import ArtifactState, GenerationGrantRequest, GrantState


@dataclass(slots=True)
class Grant:
    request: GenerationGrantRequest
    expires_at: float
    state: GrantState = GrantState.ACTIVE
    reason: str = ""
    last_sequence: int = -1
    request_id: str | None = None  # the engine request bound to it
    handoff_taken: bool = False  # the bound request has its KV: CTX holds nothing more for it
    retain_until: float = 0.0
    ended: asyncio.Event | None = None  # set when the grant ends: wakes a request waiting under it


@dataclass(slots=True)
class Artifact:
    identity: dict[str, Any]
    ctx_request_id: str | None = None
    handoff_state: bytes | None = None
    expires_at: float = 0.0
    state: ArtifactState = ArtifactState.ACTIVE
    reason: str = ""
    retain_until: float = 0.0


def attempt_of(fields: Any) -> tuple[Any, ...]:
    """The attempt identity as comparable values (UUIDs and canonical strings alike)."""
    get = fields.get if isinstance(fields, Mapping) else lambda name: getattr(fields, name)
    return tuple(str(get(name)) for name in IDENTITY_FIELDS)


def identity_of(fields: Any) -> dict[str, Any]:
    get = fields.get if isinstance(fields, Mapping) else lambda name: getattr(fields, name)
    return {name: str(get(name)) if name not in ("logical_request_id", "artifact_version") else get(name)
            for name in IDENTITY_FIELDS}


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

"""Which wire each worker speaks: the registry of worker protocols, and detection from a worker's model card.

A protocol is one module under ``orchestrator/protocols/`` and one ``ProtocolSpec`` line here. The pool reads each
worker's ``/v1/models`` once it answers ``/health``; the flow then speaks to that worker in its own protocol, so a
fleet may mix workers of several kinds (docs/interop.md).

Detection, in order: the protocols the worker announces in ``engine_info.disagg_protocols`` (the first this
orchestrator knows; disagg-serve workers announce theirs), then the card's ``owned_by`` (what an unmodified
``trtllm-serve`` answers), then ``native``.
"""

from __future__ import annotations

import logging
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any

from frontend.config import OrchestratorConfig
from orchestrator.member import PoolMember
from orchestrator.protocols.base import WorkerProtocol
from orchestrator.protocols.native import NativeProtocol
from orchestrator.protocols.trtllm.lifecycle import read_server_info
from orchestrator.protocols.trtllm.wire import TrtllmProtocol
from orchestrator.protocols.vllm import VllmProtocol

logger = logging.getLogger("disagg_serve.protocols")

DEFAULT_PROTOCOL = "native"


@dataclass(frozen=True, slots=True)
class ProtocolSpec:
    name: str
    build: Callable[[OrchestratorConfig], WorkerProtocol]
    owned_by: frozenset[str]  # the /v1/models ``owned_by`` of a worker that speaks this protocol and announces none
    # What else a worker of this protocol advertises, read before it is taken as healthy: False where the read failed
    # (it is read again at the next health check), never a guess.
    read_advertisement: Callable[[PoolMember], Awaitable[bool]] | None = None


PROTOCOLS: dict[str, ProtocolSpec] = {spec.name: spec for spec in (
    ProtocolSpec("native", lambda config: NativeProtocol(), frozenset({"disagg-serve"})),
    ProtocolSpec("trtllm", lambda config: TrtllmProtocol(strip_message_history=config.gen_strip_message_history),
                 frozenset({"tensorrt_llm"}), read_server_info),
    ProtocolSpec("vllm", lambda config: VllmProtocol(), frozenset({"vllm"})),
)}


def build_protocols(config: OrchestratorConfig) -> dict[str, WorkerProtocol]:
    return {name: spec.build(config) for name, spec in PROTOCOLS.items()}


async def read_advertisement(worker: PoolMember) -> bool:
    """Read what ``worker``'s protocol needs to know of it beyond its card (a trtllm-serve worker's lifecycle
    advertisement); False where that read failed."""
    spec = PROTOCOLS.get(worker.protocol)
    return spec is None or spec.read_advertisement is None or await spec.read_advertisement(worker)


def detect_protocol(card: dict[str, Any], url: str = "") -> str:
    """The protocol to speak to the worker whose first ``/v1/models`` entry is ``card``."""
    info = card.get("engine_info")
    announced = info.get("disagg_protocols") if isinstance(info, dict) else None
    if isinstance(announced, list):
        for name in announced:
            if name in PROTOCOLS:
                return str(name)
    owner = card.get("owned_by")
    for spec in PROTOCOLS.values():
        if owner in spec.owned_by:
            return spec.name
    logger.warning("worker %s does not say which disaggregation protocol it speaks (owned_by=%r); assuming %s",
                   url, owner, DEFAULT_PROTOCOL)
    return DEFAULT_PROTOCOL

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
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from frontend.config import OrchestratorConfig
from orchestrator.member import PoolMember
from orchestrator.protocols.base import WorkerProtocol
from orchestrator.protocols.native import NativeProtocol
from orchestrator.protocols.trtllm.lifecycle import LIFECYCLE_FLAG, not_routable, read_server_info
from orchestrator.protocols.trtllm.wire import TrtllmProtocol
from orchestrator.protocols.vllm import VllmProtocol

logger = logging.getLogger("disagg_serve.protocols")

DEFAULT_PROTOCOL = "native"
TRTLLM = "trtllm"


@dataclass(frozen=True, slots=True)
class ProtocolSpec:
    name: str
    build: Callable[[OrchestratorConfig], WorkerProtocol]
    owned_by: frozenset[str]  # the /v1/models ``owned_by`` of a worker that speaks this protocol and announces none


PROTOCOLS: dict[str, ProtocolSpec] = {spec.name: spec for spec in (
    ProtocolSpec("native", lambda config: NativeProtocol(), frozenset({"disagg-serve"})),
    ProtocolSpec("trtllm", lambda config: TrtllmProtocol(strip_message_history=config.gen_strip_message_history),
                 frozenset({"tensorrt_llm"})),
    ProtocolSpec("vllm", lambda config: VllmProtocol(), frozenset({"vllm"})),
)}


def build_protocols(config: OrchestratorConfig) -> dict[str, WorkerProtocol]:
    return {name: spec.build(config) for name, spec in PROTOCOLS.items()}


async def read_advertisement(worker: PoolMember, wire_fixed: bool) -> bool:
    """Read what ``worker`` advertises beyond its card where its wire needs it (TensorRT-LLM's: the lifecycle version,
    in ``GET /server_info``). False, and it is read again at the next health check, where the read failed or the
    worker cannot be spoken to (``worker.unroutable`` says why).

    A worker started with lifecycle v1 refuses a cross-side request without v1's attempt identity, which only
    TensorRT-LLM's wire carries here: one that announces that wire beside ours is spoken to in it; one that the
    config (``wire_fixed``) keeps on another takes no requests."""
    if worker.protocol != TRTLLM and TRTLLM not in worker.wires:
        return True
    if not await read_server_info(worker):
        return False
    if worker.lifecycle is not None and worker.protocol != TRTLLM:
        if wire_fixed:
            not_routable(worker, f"it was started with lifecycle protocol v1 ({LIFECYCLE_FLAG}), which only "
                         f"TensorRT-LLM's wire carries, and the config speaks {worker.protocol} to it: start it "
                         "without, or set protocol: trtllm (or detect)")
            return False
        logger.info("worker %s advertises lifecycle protocol v1, which only TensorRT-LLM's wire carries: it is "
                    "spoken to in that wire", worker.url)
        worker.protocol = TRTLLM
    worker.unroutable = None
    return True


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


def announced_protocols(card: dict[str, Any]) -> frozenset[str]:
    """Every wire the worker whose first ``/v1/models`` entry is ``card`` announces that this orchestrator knows."""
    info = card.get("engine_info")
    announced = info.get("disagg_protocols") if isinstance(info, dict) else None
    return frozenset(name for name in announced if name in PROTOCOLS) if isinstance(announced, list) else frozenset()

"""Worker protocols the orchestrator speaks, one module each, all implementing ``orchestrator.worker_protocol``."""

from __future__ import annotations

from orchestrator.worker_protocol import WorkerProtocol


def protocol_named(name: str) -> WorkerProtocol:
    """The protocol a server group's ``protocol`` setting names (``frontend.config.ServerGroupConfig``)."""
    if name == "vllm":
        from orchestrator.protocols.vllm import VllmProtocol

        return VllmProtocol()
    from orchestrator.protocols.native import NativeProtocol

    return NativeProtocol()

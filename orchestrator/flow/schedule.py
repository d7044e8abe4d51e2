"""What a schedule is: one method that answers a request by composing the flow's steps in its own order.

Context first (``orchestrator.flow.context_first``) and TensorRT-LLM's variants (``orchestrator.protocols.trtllm``)
implement it; ``orchestrator.protocols.choice`` picks one for each request's pair of workers.
"""

from __future__ import annotations

from typing import Protocol

from orchestrator.flow.request import Answer, FlowRequest
from orchestrator.flow.steps import Steps


class Schedule(Protocol):
    async def run(self, request: FlowRequest, steps: Steps) -> Answer:
        """The request's answer; a worker's own error answer is raised as ``RelayedError``."""
        ...

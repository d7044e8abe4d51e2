"""One client request as the flow carries it from step to step, what it admits, and what it answers."""

from __future__ import annotations

from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from frontend.asgi_fast_path import PushedStream
from frontend.errors import InvalidRequestError
from frontend.guardrail import BodyReading, read_body
from frontend.openai_output import Endpoint
from orchestrator.admission import DEFAULT
from orchestrator.protocols.base import ContextAnswer, WorkerProtocol
from orchestrator.routers import RoutingKey

if TYPE_CHECKING:
    from opentelemetry.trace import Span

PATHS: dict[Endpoint, str] = {
    "chat": "/v1/chat/completions",
    "completions": "/v1/completions",
    "responses": "/v1/responses",
}


@dataclass(slots=True)
class FlowRequest:
    """One client request as the flow carries it from step to step."""

    endpoint: Endpoint
    body: dict[str, Any]
    key: RoutingKey
    started: float
    headers: dict[str, str] = field(default_factory=dict)  # forwarded to both workers (X-Request-Id)
    ctx_worker: str | None = None
    gen_worker: str | None = None
    ctx: ContextAnswer | None = None  # the latest CTX answer: the hand-off to release if GEN never takes it
    ctx_redone: bool = False
    span: Span | None = None  # the request's trace span (frontend.tracing); None when tracing is off
    priority: int = DEFAULT  # its class (orchestrator/admission.py), for the prefill gate
    conversation_id: str | None = None  # told to workers whose wire carries one (orchestrator/conversation.py)
    # The wire both workers are spoken to in, where their own cannot carry this request; None: each worker's own.
    wire: WorkerProtocol | None = None
    _guardrail_reading: BodyReading | None = None

    @property
    def guardrail_reading(self) -> BodyReading:
        """What the metadata-only guardrail reads of the body: read once, judged per GEN worker and attempt."""
        if self._guardrail_reading is None:
            self._guardrail_reading = read_body(self.body)
        return self._guardrail_reading

    @property
    def path(self) -> str:
        return PATHS[self.endpoint]

    @property
    def streaming(self) -> bool:
        return self.body.get("stream") is True


@dataclass(frozen=True, slots=True)
class WholeAnswer:
    """A 200 answer, whole (error answers are raised, never returned)."""

    content: bytes


async def _nothing_to_close() -> None:
    pass


@dataclass(frozen=True, slots=True)
class StreamedAnswer:
    frames: AsyncIterator[bytes]
    # Closes the upstream stream behind ``frames`` (idempotent; a no-op once ``frames`` closed it). Whoever serves
    # the answer calls it however serving ended: ``frames`` is a chain of async generators, and one that was never
    # started (the client left while the status line was being sent) runs no ``finally`` when it is closed.
    close_upstream: Callable[[], Awaitable[None]] = _nothing_to_close
    # The same stream as one that can be pushed (``frontend.asgi_fast_path.PushedStream``), while ``frames`` is its
    # own iterator, unwrapped: whoever wraps ``frames`` drops it.
    pushed: PushedStream | None = None


Answer = WholeAnswer | StreamedAnswer


def check_client_body(body: dict[str, Any]) -> None:
    """The few checks the orchestrator needs to route; the CTX worker validates everything else."""
    if not isinstance(body.get("model"), str):
        raise InvalidRequestError("'model' is required and must be a string", param="model")
    # An explicit null is the default (false), as the workers read it; ``streaming`` takes only ``true``.
    if body.get("stream") is not None and not isinstance(body["stream"], bool):
        raise InvalidRequestError("'stream' must be a boolean", param="stream")
    if "disaggregated_params" in body:
        raise InvalidRequestError("disaggregated_params is set by the orchestrator, not by clients",
                                  param="disaggregated_params")

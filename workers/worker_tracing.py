"""What a worker's spans say about its request (attributes), kept out of the routes so they stay thin.

Every function takes a span from ``frontend.tracing``, None when tracing is off, and returns at once then.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from frontend import tracing
from workers.engines.request import Phase
from workers.prepared_generation import PreparedGeneration

if TYPE_CHECKING:
    from opentelemetry.trace import Span

# The engine's span for a request answered whole: CTX's is its prefill (up to the parked hand-off).
_ENGINE_STEP = {Phase.CONTEXT_ONLY: "prefill", Phase.GENERATION_ONLY: "generate", Phase.AGGREGATED: "generate"}


def engine_step(prepared: PreparedGeneration) -> str:
    return _ENGINE_STEP.get(prepared.request.phase, "generate")


def prepared(span: Span | None, prepared: PreparedGeneration) -> None:
    if span is None:
        return
    request = prepared.request
    tracing.set_attributes(span, {
        "disagg.phase": request.phase.value,
        "disagg.prompt_tokens": request.prompt_len,
        "disagg.prompt_path": request.prompt_path.value,
        "disagg.engine_request_id": request.request_id,
    })


def completed(span: Span | None, result: dict[str, Any]) -> None:
    """A whole answer: its output tokens, and for CTX the size of the hand-off state it answered."""
    if span is None:
        return
    usage = result.get("usage") or {}
    attributes: dict[str, Any] = {"disagg.completion_tokens": usage.get("completion_tokens")
                                  or usage.get("output_tokens") or 0}
    params = (result.get("choices") or [result])[0].get("disaggregated_params") or {}
    state = params.get("encoded_opaque_state")
    if isinstance(state, str):
        attributes["disagg.handoff_state_bytes"] = len(state)
    tracing.set_attributes(span, attributes)

"""What the flow's spans say about each step (attributes), kept out of the flow so it reads top to bottom.

Every function takes the span ``frontend.tracing.span`` gave the step, None when tracing is off, and returns at
once then: nothing here is computed for an untraced request.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from frontend import tracing
from frontend.guardrail import FallbackReason
from orchestrator.flow.retry import Attempted
from orchestrator.protocols.base import ContextAnswer, PromptCarriage
from orchestrator.upstream.base import Body, Reply, body_length

if TYPE_CHECKING:
    from opentelemetry.trace import Span


def called(span: Span | None, answered: Attempted[Any]) -> None:
    """A worker call (CTX, or GEN up to its first byte): who answered, after how many tries, with what."""
    if span is None:
        return
    status = answered.answer.status_code
    tracing.set_attributes(span, {
        "disagg.worker": answered.member.url,
        "disagg.attempts": answered.attempts,
        "http.status_code": status,
        "disagg.answer": "whole" if isinstance(answered.answer, Reply) else "stream",
    })


def handed_off(span: Span | None, ctx: ContextAnswer, carriage: PromptCarriage, fallback: FallbackReason | None,
               gen_body: Body) -> None:
    """The hand-off as the orchestrator relays it: what of the prompt travels, and how many bytes."""
    if span is None:
        return
    state = ctx.handoff.get("encoded_opaque_state")
    attributes: dict[str, Any] = {
        "disagg.carriage": carriage.value,
        "disagg.gen_body_bytes": body_length(gen_body),
        "disagg.prompt_b64_bytes": len(ctx.prompt_b64) if carriage is PromptCarriage.CTX_TOKENS and ctx.prompt_b64
        else 0,
        "disagg.handoff_state_bytes": len(state) if isinstance(state, str) else 0,
    }
    if ctx.prompt_len is not None:
        attributes["disagg.prompt_tokens"] = ctx.prompt_len
    if fallback is not None:
        attributes["disagg.metadata_only_fallback"] = fallback.value
    tracing.set_attributes(span, attributes)

"""A request's conversation id and routing id, read as TensorRT-LLM's disaggregated server reads them.

The body's ``conversation_params.conversation_id`` first, else the first of its headers in TensorRT-LLM's order.
Sub-agent affinity (``x-trtllm-subagent-affinity-id``) becomes the routing id (the session key of docs/routing.md),
while the workers are still told the conversation id."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

# TensorRT-LLM's CONVERSATION_ID_HEADERS, in its priority order.
CONVERSATION_ID_HEADERS = (b"x-session-id", b"x-correlation-id", b"x-session-affinity", b"x-multi-turn-session-id")
SUBAGENT_AFFINITY_HEADER = b"x-trtllm-subagent-affinity-id"


@dataclass(frozen=True, slots=True)
class Conversation:
    conversation_id: str | None  # what the workers are told
    routing_id: str | None  # what session affinity keys on: the sub-agent's parent, else the conversation


def header_order(session_header: bytes) -> tuple[bytes, ...]:
    """The headers read for a conversation id, the configured one first (computed once per server)."""
    return (session_header, *(h for h in CONVERSATION_ID_HEADERS if h != session_header))


def read_conversation(body: dict[str, Any], header: Callable[[bytes], str | None],
                      headers: tuple[bytes, ...] = CONVERSATION_ID_HEADERS) -> Conversation:
    conversation_id = body_conversation_id(body)
    if conversation_id is None:
        conversation_id = next((v for v in (_stripped(header(name)) for name in headers) if v), None)
    affinity = _stripped(header(SUBAGENT_AFFINITY_HEADER))
    return Conversation(conversation_id, affinity or conversation_id)


def body_conversation_id(body: dict[str, Any]) -> str | None:
    conversation = body.get("conversation_params")
    if isinstance(conversation, dict):
        return _stripped(conversation.get("conversation_id")) or None
    return None


def _stripped(value: object) -> str | None:
    # TensorRT-LLM strips the id and treats an empty one as absent.
    return value.strip() if isinstance(value, str) else None

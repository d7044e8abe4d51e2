"""The seam between the two-step flow and the wire a pair of CTX/GEN workers speaks.

The flow decides *what* happens (which worker, what of the prompt travels to GEN, when to retry); a
``WorkerProtocol`` says *how* it is written on the wire: the CTX request, reading CTX's answer, the GEN request,
and the two follow-ups (a lost hand-off, releasing a hand-off no GEN will take). Today's native protocol is
``orchestrator.protocols.native``; another project's protocol is one more module implementing this interface.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass
from typing import Any, Protocol

from orchestrator.upstream.base import Body, Reply


class PromptCarriage(enum.Enum):
    """What of the prompt travels to GEN beside the hand-off (the flow chooses, the protocol writes it)."""

    CLIENT_PROMPT = "client_prompt"  # the client's own prompt: its text (GEN tokenizes it) or its own token list
    CTX_TOKENS = "ctx_tokens"  # the b64 token ids CTX sent, relayed as the very object; no prompt text
    LENGTH_ONLY = "length_only"  # metadata-only: the length and the text, no token ids
    NOTHING = "nothing"  # metadata-only, GEN reads the real tokens from the hand-off: no text, no token ids


@dataclass(frozen=True, slots=True)
class ContextAnswer:
    """CTX's answer, read once: everything the flow needs from it, and the parsed answer itself."""

    response: dict[str, Any]  # the whole answer, parsed once
    handoff: dict[str, Any]  # what GEN needs to continue (the KV hand-off and the first token), as CTX wrote it
    finished: bool  # CTX finished the request by itself: GEN is never called
    prompt_len: int | None  # the prompt's length in tokens, when CTX reported it
    # The prompt's token ids as CTX encoded them: relayed, never decoded; a view of CTX's answer bytes when the
    # protocol cut it out unparsed (b64_splice.py), else the str the parser made.
    prompt_b64: str | memoryview | None


class WorkerProtocol(Protocol):
    def context_request(self, body: dict[str, Any], *, return_prompt_tokens: bool,
                        conversation_id: str | None = None) -> Body:
        """The CTX step's body for the client's ``body``: a context-only, whole (not streamed) request (chunks when a
        long prompt is kept as the client's bytes: ``orchestrator.client_body``). ``conversation_id`` is the
        request's conversation (``orchestrator.conversation``), for a wire that tells workers of it."""
        ...

    def read_context_answer(self, content: bytes) -> ContextAnswer:
        """CTX's 200 answer; ``UpstreamError`` if it is not one this protocol can continue from."""
        ...

    def finished_response(self, ctx: ContextAnswer) -> dict[str, Any]:
        """CTX's answer as the client gets it when CTX finished the request: the hand-off fields removed."""
        ...

    def generation_request(self, body: dict[str, Any], ctx: ContextAnswer, carriage: PromptCarriage, *,
                           conversation_id: str | None = None) -> Body:
        """The GEN step's body: the client's ``body``, the hand-off from ``ctx``, and the prompt as ``carriage``
        says. ``CTX_TOKENS`` must put ``ctx.prompt_b64`` itself in the body, never a decoded or re-encoded copy
        (a view is sent as a chunk of its own)."""
        ...

    def handoff_lost(self, reply: Reply) -> bool:
        """Whether GEN's error answer says the hand-off is gone (an earlier GEN took it), so CTX must run again."""
        ...

    def release_request(self, ctx: ContextAnswer) -> tuple[str, bytes] | None:
        """(path, body) that frees a hand-off no GEN will take, on the CTX worker that made it; None if it
        cannot be released early (it then expires on its own)."""
        ...


def without_handoff_fields(response: dict[str, Any]) -> dict[str, Any]:
    """CTX's answer as the client's (CTX finished the request): the prompt tokens and hand-off fields removed."""
    for name in ("prompt_token_ids_b64", "prompt_token_ids", "disaggregated_params"):
        response.pop(name, None)
    for choice in response.get("choices", ()):
        choice.pop("disaggregated_params", None)
    return response

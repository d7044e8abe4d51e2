"""The metadata-only guardrail: may GEN decode on a length-only placeholder instead of the real prompt?

One pure function over (request body, CTX's prompt_len, GEN engine facts). The orchestrator runs it to decide
what to send GEN; the GEN server runs it again on what it received, so a placeholder never reaches a feature that
reads prompt token values. It reads the raw JSON body (a dict), so both sides judge exactly the same thing.
"""

from __future__ import annotations

import enum
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any


class FallbackReason(enum.Enum):
    NO_PROMPT_LEN = "no_prompt_len"
    FREQUENCY_PENALTY = "frequency_penalty"
    PRESENCE_PENALTY = "presence_penalty"
    REPETITION_PENALTY = "repetition_penalty"
    NO_REPEAT_NGRAM = "no_repeat_ngram_size"
    ECHO = "echo"
    PROMPT_LOGPROBS = "prompt_logprobs"
    LOGIT_BIAS = "logit_bias"
    MULTIMODAL = "multimodal"
    HARMONY = "harmony"
    KV_BLOCK_REUSE = "kv_block_reuse"


@dataclass(frozen=True, slots=True)
class GenEngineFacts:
    """What the orchestrator learns from a GEN worker itself (its /v1/models card), never from its own config."""

    kv_block_reuse: bool = False
    prompt_tokens_in_handoff: bool = False


# Features that read prompt token *values*; the hand-off's real tokens make them safe.
_VALUE_READERS: tuple[tuple[FallbackReason, str], ...] = (
    (FallbackReason.FREQUENCY_PENALTY, "frequency_penalty"),
    (FallbackReason.PRESENCE_PENALTY, "presence_penalty"),
    (FallbackReason.REPETITION_PENALTY, "repetition_penalty"),
    (FallbackReason.NO_REPEAT_NGRAM, "no_repeat_ngram_size"),
    (FallbackReason.ECHO, "echo"),
    (FallbackReason.PROMPT_LOGPROBS, "prompt_logprobs"),
    (FallbackReason.LOGIT_BIAS, "logit_bias"),
)
_NEUTRAL: Mapping[str, object] = {
    "frequency_penalty": 0,
    "presence_penalty": 0,
    "repetition_penalty": 1,
    "no_repeat_ngram_size": 0,
    "echo": False,
    "logit_bias": {},
}


def _is_set(body: Mapping[str, Any], name: str) -> bool:
    value = body.get(name)
    return value is not None and value != _NEUTRAL.get(name, None)


def _has_media(body: Mapping[str, Any]) -> bool:
    messages = body.get("messages") or (body.get("input") if isinstance(body.get("input"), list) else None) or []
    for message in messages:
        content = message.get("content") if isinstance(message, dict) else None
        if isinstance(content, list):
            for part in content:
                if isinstance(part, dict) and part.get("type") not in ("text", "input_text", "output_text"):
                    return True
    return False


def _is_harmony(body: Mapping[str, Any]) -> bool:
    # Harmony (gpt-oss) prompts are rebuilt from token values on the decode side.
    kwargs = body.get("chat_template_kwargs")
    return isinstance(kwargs, dict) and kwargs.get("format") == "harmony"


def metadata_only_decision(
    body: Mapping[str, Any], prompt_len: int | None, gen: GenEngineFacts
) -> FallbackReason | None:
    """``None`` admits metadata-only; otherwise the reason to relay real tokens instead."""
    if prompt_len is None:
        return FallbackReason.NO_PROMPT_LEN
    if _has_media(body):
        return FallbackReason.MULTIMODAL
    if _is_harmony(body):
        return FallbackReason.HARMONY
    if gen.prompt_tokens_in_handoff:
        # GEN reads the real prompt from the KV hand-off: value readers and block reuse see real tokens.
        return None
    for reason, name in _VALUE_READERS:
        if _is_set(body, name):
            return reason
    if gen.kv_block_reuse:
        return FallbackReason.KV_BLOCK_REUSE
    return None

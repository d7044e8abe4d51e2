"""The metadata-only guardrail: may GEN decode on a length-only placeholder instead of the real prompt?

One pure function over typed facts (``metadata_only_decision``). The GEN worker runs it on its validated request;
the orchestrator runs it per GEN worker on the few fields it reads from a client body (``read_body``,
``decide_for_reading``), so both sides judge the same values. See docs/metadata-only.md."""

from __future__ import annotations

import enum
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from frontend.sampling import InvalidSamplingValue, SamplingParams


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


@dataclass(frozen=True, slots=True)
class PromptFacts:
    """What the guardrail needs to know of the prompt besides its length."""

    multimodal: bool = False  # images or audio: rebuilt from token values on the decode side
    harmony: bool = False  # gpt-oss's harmony format: likewise


def metadata_only_decision(
    sampling: SamplingParams, prompt: PromptFacts, prompt_len: int | None, gen: GenEngineFacts
) -> FallbackReason | None:
    """``None`` admits metadata-only; otherwise the reason to relay real tokens instead."""
    if prompt_len is None:
        return FallbackReason.NO_PROMPT_LEN
    if prompt.multimodal:
        return FallbackReason.MULTIMODAL
    if prompt.harmony:
        return FallbackReason.HARMONY
    if gen.prompt_tokens_in_handoff:
        # GEN reads the real prompt from the KV hand-off: value readers and block reuse see real tokens.
        return None
    readers = sampling.reads_prompt_token_values
    if readers:
        return FallbackReason(readers[0])
    if gen.kv_block_reuse:
        return FallbackReason.KV_BLOCK_REUSE
    return None


@dataclass(frozen=True, slots=True)
class BodyReading:
    """What the guardrail reads of a raw client body: read once per request, judged once per GEN worker."""

    sampling: SamplingParams | None  # None when a value could not be read: see ``unreadable``
    prompt: PromptFacts
    unreadable: FallbackReason | None = None


def read_body(body: Mapping[str, Any]) -> BodyReading:
    """A value of the wrong type or out of range cannot be judged; relaying real tokens is always safe, so the
    reading falls back under that field's name (CTX refuses such a body anyway)."""
    try:
        sampling = sampling_from_body(body)
    except InvalidSamplingValue as exc:
        return BodyReading(None, PromptFacts(), FallbackReason(exc.field))
    return BodyReading(sampling, prompt_facts_of_body(body))


def decide_for_reading(reading: BodyReading, prompt_len: int | None, gen: GenEngineFacts) -> FallbackReason | None:
    """The orchestrator's entry: the guardrail over what ``read_body`` read of a client body."""
    if reading.sampling is None:
        return reading.unreadable
    return metadata_only_decision(reading.sampling, reading.prompt, prompt_len, gen)


_DEFAULT_SAMPLING = SamplingParams()

# The body fields the guardrail judges, each with the type it must have and its neutral value.
_FLOAT_FIELDS = ("frequency_penalty", "presence_penalty", "repetition_penalty")
_INT_FIELDS = ("no_repeat_ngram_size",)


def sampling_from_body(body: Mapping[str, Any]) -> SamplingParams:
    """The value-reading sampling fields of a raw JSON body, as ``SamplingParams`` (the others keep defaults).

    Strict about types where pydantic would coerce ("0.5", true): anything not plainly a number or a bool is
    reported as unreadable rather than guessed at. Raises ``InvalidSamplingValue`` naming the field.
    """
    fields: dict[str, Any] = {}
    for name in _FLOAT_FIELDS:
        value = body.get(name)
        if value is not None:
            fields[name] = float(_number(name, value))
    for name in _INT_FIELDS:
        value = body.get(name)
        if value is not None:
            fields[name] = _integer(name, value)
    echo = body.get("echo")
    if echo is not None:
        if not isinstance(echo, bool):
            raise InvalidSamplingValue("echo", "echo must be a boolean")
        fields["echo"] = echo
    prompt_logprobs = body.get("prompt_logprobs")
    if prompt_logprobs is not None:
        fields["prompt_logprobs"] = _integer("prompt_logprobs", prompt_logprobs)
    bias = body.get("logit_bias")
    if bias is not None:
        fields["logit_bias"] = _logit_bias(bias)
    # Most bodies set none of these: the one default instance (frozen) spares a validated construction per request.
    return SamplingParams(**fields) if fields else _DEFAULT_SAMPLING


def _number(name: str, value: Any) -> int | float:
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise InvalidSamplingValue(name, f"{name} must be a number")
    return value


def _integer(name: str, value: Any) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        raise InvalidSamplingValue(name, f"{name} must be an integer")
    return value


def _logit_bias(bias: Any) -> tuple[tuple[int, float], ...]:
    if not isinstance(bias, dict):
        raise InvalidSamplingValue("logit_bias", "logit_bias must be an object")
    pairs = []
    for key, value in bias.items():
        if not isinstance(key, str) or not key.isdigit():
            raise InvalidSamplingValue("logit_bias", "logit_bias keys must be token ids")
        pairs.append((int(key), float(_number("logit_bias", value))))
    return tuple(sorted(pairs))


def prompt_facts_of_body(body: Mapping[str, Any]) -> PromptFacts:
    """Reads only the messages' content-part types and the chat-template kwargs, never the text."""
    return PromptFacts(multimodal=_has_media(body), harmony=is_harmony(body.get("chat_template_kwargs")))


def _has_media(body: Mapping[str, Any]) -> bool:
    messages = body.get("messages") or (body.get("input") if isinstance(body.get("input"), list) else None) or []
    for message in messages:
        content = message.get("content") if isinstance(message, dict) else None
        if isinstance(content, list):
            for part in content:
                if isinstance(part, dict) and part.get("type") not in ("text", "input_text", "output_text"):
                    return True
    return False


def is_harmony(chat_template_kwargs: object) -> bool:
    """Harmony (gpt-oss) prompts are rebuilt from token values on the decode side."""
    return isinstance(chat_template_kwargs, dict) and chat_template_kwargs.get("format") == "harmony"

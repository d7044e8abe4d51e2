"""SamplingParams: a request's sampling fields, parsed and validated once, as one immutable value.

The wire models say what a client may send; this is what the rest of the system reads: the worker, the engine core
(``to_wire`` / ``from_wire``, driven by the dataclass fields) and the metadata-only guardrail."""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from frontend.errors import InvalidRequestError
from frontend.openai_models import SEED_MAX, SEED_MIN, ChatCompletionRequest, CompletionRequest, GenerationWireRequest


class InvalidSamplingValue(ValueError):
    """A sampling value outside what any engine accepts; ``field`` names it."""

    def __init__(self, field: str, message: str) -> None:
        super().__init__(message)
        self.field = field


@dataclass(frozen=True, slots=True)
class SamplingParams:
    # None: as many as the context allows. The worker resolves it against the engine's context before the
    # engine sees the request (GenerationRequest refuses an unresolved one).
    max_tokens: int | None = None
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0  # 0: off
    seed: int | None = None  # None: the engine draws a random one; any 64-bit signed integer otherwise
    stop: tuple[str, ...] = ()
    frequency_penalty: float = 0.0
    presence_penalty: float = 0.0
    repetition_penalty: float = 1.0
    # Recognised so the guardrail can judge it; no engine implements it, so the worker refuses a non-zero value
    # (``UNSUPPORTED_PARAMETERS``) and only the orchestrator's reading of a raw body ever sets it.
    no_repeat_ngram_size: int = 0
    echo: bool = False
    # Logprobs of the prompt's tokens (vLLM's extension); also asked for when echo meets logprobs.
    prompt_logprobs: int | None = None
    logit_bias: tuple[tuple[int, float], ...] = ()
    logprobs: int | None = None  # None: none; 0: the chosen token only; k: plus the top k alternatives
    ignore_eos: bool = False
    # Structured output: the output must be JSON valid against this schema (compact JSON text, the engine's cache
    # key; ``frontend.structured_output``). It reads only output tokens, never prompt token values.
    json_schema: str | None = None
    # Or an llguidance grammar in its Lark syntax (``tool_choice: "auto"``'s text or well-formed calls,
    # ``frontend.tool_parsers``); never both. It too reads only output tokens.
    grammar: str | None = None
    # Sequences sampled from one prompt: it is prefilled once and its KV forked (sequence i seeds with seed + i).
    n: int = 1

    def __post_init__(self) -> None:
        _require(self.seed is None or SEED_MIN <= self.seed <= SEED_MAX, "seed",
                 "seed must be a 64-bit signed integer")
        _require(self.max_tokens is None or self.max_tokens >= 1, "max_tokens", "max_tokens must be >= 1")
        _require(self.temperature >= 0.0, "temperature", "temperature must be >= 0")
        _require(0.0 < self.top_p <= 1.0, "top_p", "top_p must be in (0, 1]")
        _require(self.top_k >= 0, "top_k", "top_k must be >= 0")
        _require(self.repetition_penalty > 0.0, "repetition_penalty", "repetition_penalty must be > 0")
        _require(self.no_repeat_ngram_size >= 0, "no_repeat_ngram_size", "no_repeat_ngram_size must be >= 0")
        _require(self.logprobs is None or self.logprobs >= 0, "logprobs", "logprobs must be >= 0")
        _require(self.prompt_logprobs is None or self.prompt_logprobs >= 0, "prompt_logprobs",
                 "prompt_logprobs must be >= 0")
        _require(self.n >= 1, "n", "n must be >= 1")

    @property
    def reads_prompt_token_values(self) -> tuple[str, ...]:
        """The features that read prompt token *values* (not just the prompt length), by field name, in the
        order the guardrail reports them."""
        reasons = []
        if self.frequency_penalty:
            reasons.append("frequency_penalty")
        if self.presence_penalty:
            reasons.append("presence_penalty")
        if self.repetition_penalty != 1.0:
            reasons.append("repetition_penalty")
        if self.no_repeat_ngram_size:
            reasons.append("no_repeat_ngram_size")
        if self.echo:
            reasons.append("echo")
        if self.prompt_logprobs is not None:
            reasons.append("prompt_logprobs")
        if self.logit_bias:
            reasons.append("logit_bias")
        return tuple(reasons)

    def to_wire(self) -> dict[str, Any]:
        """JSON-ready fields for the engine-core IPC (tuples become lists)."""
        return {field.name: getattr(self, field.name) for field in dataclasses.fields(self)}

    @classmethod
    def from_wire(cls, data: Mapping[str, Any]) -> SamplingParams:
        """The inverse of ``to_wire``. An unknown field is a TypeError: both ends run the same code."""
        return cls(**{name: _as_tuples(value) for name, value in data.items()})


def _require(condition: bool, field: str, message: str) -> None:
    if not condition:
        raise InvalidSamplingValue(field, message)


def _as_tuples(value: Any) -> Any:
    # JSON has no tuples: the sequence fields (stop, logit_bias and its pairs) come back as lists.
    return tuple(_as_tuples(item) for item in value) if isinstance(value, list) else value


def sampling_from_request(wire: GenerationWireRequest, vocab_size: int) -> SamplingParams:
    """Parse a validated wire request's sampling fields; ``max_tokens`` is what the client asked for (or None)."""
    logprobs: int | None
    echo = False
    if isinstance(wire, ChatCompletionRequest):
        if wire.top_logprobs and not wire.logprobs:
            raise InvalidRequestError("top_logprobs requires logprobs=true", param="top_logprobs")
        logprobs = (wire.top_logprobs or 0) if wire.logprobs else None
    elif isinstance(wire, CompletionRequest):
        logprobs, echo = wire.logprobs, bool(wire.echo)
    else:
        logprobs = None
    prompt_logprobs: int | None = getattr(wire, "prompt_logprobs", None)
    if echo and logprobs is not None:
        # The echoed prompt's tokens carry logprobs too: the engine scores them during prefill.
        prompt_logprobs = max(prompt_logprobs or 0, logprobs)
    try:
        return _sampling(wire, vocab_size, logprobs, echo, prompt_logprobs)
    except InvalidSamplingValue as exc:
        raise InvalidRequestError(str(exc), param=exc.field) from exc


def _sampling(
    wire: GenerationWireRequest, vocab_size: int, logprobs: int | None, echo: bool, prompt_logprobs: int | None
) -> SamplingParams:
    return SamplingParams(
        max_tokens=wire.requested_max_tokens,
        temperature=1.0 if wire.temperature is None else wire.temperature,
        top_p=1.0 if wire.top_p is None else wire.top_p,
        top_k=wire.top_k or 0,
        seed=wire.seed,
        stop=(wire.stop,) if isinstance(wire.stop, str) else tuple(wire.stop or ()),
        frequency_penalty=wire.frequency_penalty or 0.0,
        presence_penalty=wire.presence_penalty or 0.0,
        repetition_penalty=1.0 if wire.repetition_penalty is None else wire.repetition_penalty,
        echo=echo,
        prompt_logprobs=prompt_logprobs,
        logit_bias=_logit_bias(wire.logit_bias, vocab_size),
        logprobs=logprobs,
        ignore_eos=bool(wire.ignore_eos),
        n=wire.n or 1,
    )


def _logit_bias(bias: dict[str, float] | None, vocab_size: int) -> tuple[tuple[int, float], ...]:
    if not bias:
        return ()
    pairs = []
    for key, value in bias.items():
        if not key.isdigit() or int(key) >= vocab_size:
            raise InvalidRequestError(
                f"logit_bias key {key!r} is not a token id in [0, {vocab_size})", param="logit_bias"
            )
        pairs.append((int(key), float(value)))
    return tuple(sorted(pairs))

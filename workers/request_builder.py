"""Parse, don't validate: a wire request becomes the ``GenerationRequest`` the engine accepts.

The prompt comes from exactly one source, checked in this order:
  1. ``prompt_token_ids_b64`` -> the array path (zero-copy int32 view, validated with array operations);
  2. ``prompt_token_ids`` (or a completions prompt given as ids) -> the list path;
  3. a generation_only request with only ``prompt_len`` -> metadata-only, behind the guardrail;
  4. text (messages / prompt / input) -> tokenized here, off the event loop when long.
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass
from typing import Any

import pybase64

from frontend.errors import ContextLengthError, HandoffError, InvalidRequestError, UnsupportedParameterError
from frontend.guardrail import GenEngineFacts, metadata_only_decision
from frontend.openai_models import (
    ChatCompletionRequest,
    CompletionRequest,
    DisaggregatedParams,
    GenerationWireRequest,
    ResponsesRequest,
)
from frontend.openai_output import Endpoint
from frontend.token_codec import TokenArray, decode_prompt_tokens, token_array_from_list
from workers.engines.base import EngineInfo, Tokenizer, TokenLogprob
from workers.generation_request import Handoff, Phase, PromptPath, placeholder_prompt
from workers.sampling_params import SamplingParams

# Tokenizing a few KB on the loop is cheaper than a thread hop; past this, the loop must stay free.
_TOKENIZE_IN_THREAD_CHARS = 16_384


@dataclass(frozen=True, slots=True)
class PreparedPrompt:
    tokens: TokenArray
    path: PromptPath
    token_list: list[int] | None = None  # the list path keeps the client's list


def sampling_params_from(wire: GenerationWireRequest, prompt_len: int, info: EngineInfo) -> SamplingParams:
    remaining = info.max_context - prompt_len
    requested = wire.requested_max_tokens
    if requested is not None and requested > remaining:
        raise ContextLengthError(
            f"max_tokens={requested} plus the {prompt_len}-token prompt exceeds the model's context of "
            f"{info.max_context}",
            param=_max_tokens_field(wire),
        )
    if remaining < 1:
        raise ContextLengthError(
            f"the {prompt_len}-token prompt leaves no room to generate in a context of {info.max_context}",
            param=_prompt_field(wire),
        )
    logprobs: int | None
    echo = False
    if isinstance(wire, ChatCompletionRequest):
        logprobs = (wire.top_logprobs or 0) if wire.logprobs else None
        if wire.top_logprobs and not wire.logprobs:
            raise InvalidRequestError("top_logprobs requires logprobs=true", param="top_logprobs")
    elif isinstance(wire, CompletionRequest):
        logprobs, echo = wire.logprobs, wire.echo
    else:
        logprobs = None
    if logprobs is not None and not info.supports_logprobs:
        raise UnsupportedParameterError(f"the {info.engine} engine does not return logprobs", param="logprobs")
    stop = (wire.stop,) if isinstance(wire.stop, str) else tuple(wire.stop or ())
    return SamplingParams(
        max_tokens=requested if requested is not None else remaining,
        temperature=1.0 if wire.temperature is None else wire.temperature,
        top_p=1.0 if wire.top_p is None else wire.top_p,
        top_k=wire.top_k or 0,
        seed=wire.seed,
        stop=stop,
        frequency_penalty=wire.frequency_penalty or 0.0,
        presence_penalty=wire.presence_penalty or 0.0,
        repetition_penalty=1.0 if wire.repetition_penalty is None else wire.repetition_penalty,
        logit_bias=_logit_bias(wire.logit_bias, info.vocab_size),
        logprobs=logprobs,
        prompt_logprobs=getattr(wire, "prompt_logprobs", None),
        echo=echo,
        ignore_eos=wire.ignore_eos,
    )


def _max_tokens_field(wire: GenerationWireRequest) -> str:
    if isinstance(wire, ResponsesRequest):
        return "max_output_tokens"
    if isinstance(wire, ChatCompletionRequest) and wire.max_completion_tokens is not None:
        return "max_completion_tokens"
    return "max_tokens"


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


async def prepare_prompt(
    wire: GenerationWireRequest, body: dict[str, Any], info: EngineInfo, tokenizer: Tokenizer
) -> PreparedPrompt:
    disagg = wire.disaggregated_params
    expected_len = disagg.prompt_len if disagg is not None and disagg.request_type == "generation_only" else None
    limit = info.max_context
    if wire.prompt_token_ids_b64 is not None:
        tokens = decode_prompt_tokens(
            wire.prompt_token_ids_b64, vocab_size=info.vocab_size, max_tokens=limit, expected_len=expected_len
        )
        return PreparedPrompt(tokens, PromptPath.ARRAY)
    token_list = _explicit_token_list(wire)
    if token_list is not None:
        field = "prompt" if isinstance(wire, CompletionRequest) else "prompt_token_ids"
        tokens = token_array_from_list(
            token_list, vocab_size=info.vocab_size, max_tokens=limit, expected_len=expected_len, field=field
        )
        return PreparedPrompt(tokens, PromptPath.LIST, token_list)
    if expected_len is not None:
        return _metadata_only_prompt(body, expected_len, info)
    text = _prompt_text(wire, tokenizer)
    if len(text) > _TOKENIZE_IN_THREAD_CHARS:
        tokens = await asyncio.to_thread(tokenizer.encode, text)
    else:
        tokens = tokenizer.encode(text)
    if tokens.size == 0:
        raise InvalidRequestError("the prompt is empty", param="prompt")
    if tokens.size > limit:
        raise ContextLengthError(
            f"the prompt has {tokens.size} tokens, more than the model's context of {limit}",
            param=_prompt_field(wire),
        )
    return PreparedPrompt(tokens, PromptPath.TEXT)


def _prompt_field(wire: GenerationWireRequest) -> str:
    if isinstance(wire, ChatCompletionRequest):
        return "messages"
    return "input" if isinstance(wire, ResponsesRequest) else "prompt"


def _metadata_only_prompt(body: dict[str, Any], prompt_len: int, info: EngineInfo) -> PreparedPrompt:
    # The GEN side of the guardrail: judge what was actually received, with this engine's own facts.
    facts = GenEngineFacts(info.kv_block_reuse, info.prompt_tokens_in_handoff)
    reason = metadata_only_decision(body, prompt_len, facts)
    if reason is not None:
        raise InvalidRequestError(
            f"metadata-only request refused: '{reason.value}' needs the real prompt tokens, and this worker's "
            "hand-off does not carry them; send prompt_token_ids_b64",
            param=reason.value,
            code="metadata_only_refused",
        )
    if prompt_len > info.max_context:
        raise ContextLengthError(
            f"prompt_len {prompt_len} exceeds the model's context of {info.max_context}", param="prompt_len"
        )
    return PreparedPrompt(placeholder_prompt(prompt_len), PromptPath.METADATA_ONLY)


def _explicit_token_list(wire: GenerationWireRequest) -> list[int] | None:
    if wire.prompt_token_ids is not None:
        return wire.prompt_token_ids
    if isinstance(wire, CompletionRequest) and isinstance(wire.prompt, list) and wire.prompt:
        first = wire.prompt[0]
        if isinstance(first, int):
            return wire.prompt  # type: ignore[return-value]
        if isinstance(first, list):
            return first
    return None


def _prompt_text(wire: GenerationWireRequest, tokenizer: Tokenizer) -> str:
    if isinstance(wire, CompletionRequest):
        prompt = wire.prompt
        if prompt is None:
            raise InvalidRequestError("'prompt' is required: no prompt text or tokens were sent", param="prompt")
        if isinstance(prompt, list):
            return str(prompt[0]) if prompt else ""
        return prompt
    if isinstance(wire, ChatCompletionRequest):
        field, messages = "messages", wire.messages or []
    else:
        field, messages = "input", wire.chat_messages()
    if not messages:
        raise InvalidRequestError(f"'{field}' is required: no prompt text or tokens were sent", param=field)
    if any(m.has_media for m in messages):
        raise UnsupportedParameterError("this model accepts text only (no images or audio)", param=field)
    try:
        return tokenizer.render_chat([{"role": _template_role(m.role), "content": m.text()} for m in messages])
    except ValueError as exc:  # the model's chat template refused these messages
        raise InvalidRequestError(f"the chat template cannot render these messages: {exc}", param=field) from exc


def _template_role(role: str) -> str:
    return "system" if role == "developer" else role


def handoff_from(disagg: DisaggregatedParams | None, vocab_size: int) -> Handoff | None:
    if disagg is None or disagg.request_type != "generation_only":
        return None
    if not disagg.first_gen_tokens:
        raise HandoffError("a generation_only request needs disaggregated_params.first_gen_tokens",
                           param="disaggregated_params.first_gen_tokens")
    if any(not 0 <= t < vocab_size for t in disagg.first_gen_tokens):
        raise HandoffError(f"first_gen_tokens must be token ids in [0, {vocab_size})",
                           param="disaggregated_params.first_gen_tokens")
    if disagg.encoded_opaque_state is None:
        raise HandoffError("a generation_only request needs disaggregated_params.encoded_opaque_state",
                           param="disaggregated_params.encoded_opaque_state")
    try:
        state = pybase64.b64decode(disagg.encoded_opaque_state, validate=True)
    except ValueError as exc:
        raise HandoffError("encoded_opaque_state is not valid base64",
                           param="disaggregated_params.encoded_opaque_state") from exc
    ctx_id = None if disagg.ctx_request_id is None else str(disagg.ctx_request_id)
    logprobs = tuple(
        TokenLogprob(lp.token_id, lp.logprob, tuple(lp.top)) for lp in disagg.first_gen_logprobs or ()
    )
    return Handoff(tuple(disagg.first_gen_tokens), state, ctx_id, logprobs)


def phase_of(disagg: DisaggregatedParams | None) -> Phase:
    if disagg is None:
        return Phase.AGGREGATED
    return Phase.CONTEXT_ONLY if disagg.request_type == "context_only" else Phase.GENERATION_ONLY


def endpoint_of(wire: GenerationWireRequest) -> Endpoint:
    if isinstance(wire, ChatCompletionRequest):
        return "chat"
    if isinstance(wire, CompletionRequest):
        return "completions"
    return "responses"

"""Parse, don't validate: a wire request becomes the ``GenerationRequest`` the engine accepts.

The sampling fields are parsed once into ``SamplingParams`` (``sampling_params_from``), which the GEN side of the
metadata-only guardrail reads; the output budget is fixed once the prompt's length is known
(``resolve_max_tokens``).

The prompt comes from exactly one source, checked in this order:
  1. ``prompt_token_ids_b64`` -> the array path (zero-copy int32 view, validated with array operations);
  2. ``prompt_token_ids`` (or a completions prompt given as ids) -> the list path;
  3. a generation_only request with only ``prompt_len`` -> metadata-only, behind the guardrail;
  4. text (messages / prompt / input) -> tokenized here, off the event loop when long.
"""

from __future__ import annotations

import asyncio
import dataclasses
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import orjson
import pybase64

from frontend.chat_messages import ChatMessage, FunctionCall
from frontend.disaggregated_params import DisaggregatedParams, FirstTokenLogprob
from frontend.errors import ContextLengthError, HandoffError, InvalidRequestError, UnsupportedParameterError
from frontend.guardrail import GenEngineFacts, PromptFacts, is_harmony, metadata_only_decision
from frontend.openai_models import ChatCompletionRequest, CompletionRequest, GenerationWireRequest, ResponsesRequest
from frontend.openai_output import Endpoint
from frontend.sampling import SamplingParams, sampling_from_request
from frontend.structured_output import OutputConstraint, tools_in_prompt
from frontend.token_codec import TokenArray, decode_prompt_tokens, token_array_from_list
from frontend.tool_calls import ToolCalling, with_tools_prompt
from frontend.tool_parsers import FORMATS, ToolCallFormat, forced
from frontend.tool_parsers.base import HistoryCalls
from workers.engines.base import EncodesIncrementally, Tokenizer
from workers.engines.outputs import EngineInfo, TokenLogprob
from workers.engines.request import Handoff, Phase, PromptPath, SequenceStart, placeholder_prompt
from workers.trtllm.answers import first_gen_logprobs_from

# Tokenizing a few KB on the loop is cheaper than a thread hop; past this, the loop must stay free.
_TOKENIZE_IN_THREAD_CHARS = 16_384


@dataclass(frozen=True, slots=True)
class PreparedPrompt:
    tokens: TokenArray
    path: PromptPath
    token_list: list[int] | None = None  # the list path keeps the client's list


def sampling_params_from(
    wire: GenerationWireRequest, info: EngineInfo, constraint: OutputConstraint | None = None
) -> SamplingParams:
    """The request's sampling, parsed once; ``max_tokens`` stays as asked until ``resolve_max_tokens``."""
    sampling = sampling_from_request(wire, info.vocab_size)
    if sampling.logprobs is not None and not info.supports_logprobs:
        raise UnsupportedParameterError(f"the {info.engine} engine does not return logprobs", param="logprobs")
    if constraint is not None:
        if not info.supports_structured_output:
            raise UnsupportedParameterError(
                f"the {info.engine} engine does not support structured output ('{constraint.param}')",
                param=constraint.param)
        sampling = dataclasses.replace(sampling, json_schema=constraint.json_schema)
    if sampling.n > 1 and not info.supports_n:
        raise UnsupportedParameterError(f"the {info.engine} engine samples one sequence per request: only n=1",
                                        param="n")
    return sampling


def resolve_max_tokens(
    wire: GenerationWireRequest, sampling: SamplingParams, prompt_len: int, info: EngineInfo
) -> SamplingParams:
    """Fix the output budget against the prompt and the engine's context (all of what is left, if not asked)."""
    remaining = info.max_context - prompt_len
    requested = sampling.max_tokens
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
    return sampling if requested is not None else dataclasses.replace(sampling, max_tokens=remaining)


def _max_tokens_field(wire: GenerationWireRequest) -> str:
    if isinstance(wire, ResponsesRequest):
        return "max_output_tokens"
    if isinstance(wire, ChatCompletionRequest) and wire.max_completion_tokens is not None:
        return "max_completion_tokens"
    return "max_tokens"


async def prepare_prompt(
    wire: GenerationWireRequest, sampling: SamplingParams, info: EngineInfo, tokenizer: Tokenizer,
    tool_calling: ToolCalling | None = None, tool_format: ToolCallFormat | None = None,
) -> PreparedPrompt:
    """``tool_calling``: how the answer is read for calls, which says how the prompt asks for one; ``tool_format``:
    the model's tool-call format, in which the history's earlier calls are written (Hermes' where None)."""
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
        return _metadata_only_prompt(wire, sampling, expected_len, info)
    text = _prompt_text(wire, tokenizer, tool_calling.instructions if tool_calling else forced.INSTRUCTIONS,
                        (tool_format or FORMATS["hermes"]).calls_text)
    # A follow-up turn encodes only what it adds (the rest is cached): a thread hop would cost it more than that.
    new = tokenizer.new_chars(text) if isinstance(tokenizer, EncodesIncrementally) else len(text)
    if new > _TOKENIZE_IN_THREAD_CHARS:
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


def _metadata_only_prompt(
    wire: GenerationWireRequest, sampling: SamplingParams, prompt_len: int, info: EngineInfo
) -> PreparedPrompt:
    # The GEN side of the guardrail: judge what was actually received, with this engine's own facts.
    facts = GenEngineFacts(info.kv_block_reuse, info.prompt_tokens_in_handoff)
    reason = metadata_only_decision(sampling, prompt_facts_of(wire), prompt_len, facts)
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


def prompt_facts_of(wire: GenerationWireRequest) -> PromptFacts:
    """What the guardrail needs to know of a validated request's prompt (content-part types only)."""
    if isinstance(wire, ChatCompletionRequest):
        multimodal = any(m.has_media for m in wire.messages or ())
        return PromptFacts(multimodal=multimodal, harmony=is_harmony(wire.chat_template_kwargs))
    if isinstance(wire, ResponsesRequest) and isinstance(wire.input, list):
        return PromptFacts(multimodal=any(m.has_media for m in wire.chat_messages()))
    return PromptFacts()


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


def _prompt_text(wire: GenerationWireRequest, tokenizer: Tokenizer, tool_instructions: str,
                 calls_text: Callable[[HistoryCalls], str]) -> str:
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
        turns = [template_message(m, calls_text) for m in messages]
        return tokenizer.render_chat(with_tools_prompt(turns, tools_in_prompt(wire), tool_instructions))
    except ValueError as exc:  # the model's chat template refused these messages
        raise InvalidRequestError(f"the chat template cannot render these messages: {exc}", param=field) from exc


def template_message(message: ChatMessage,
                     calls_text: Callable[[HistoryCalls], str] = FORMATS["hermes"].calls_text) -> dict[str, str]:
    """One message as the chat template reads it: role, content, and ``name`` / ``tool_call_id`` when given.

    Templates differ in how (and whether) they show tool calls; SmolLM2's shows none, so an assistant's calls are
    written into its content in the model's tool-call format (``calls_text``; Hermes' by default:
    ``<tool_call>{"name", "arguments"}</tool_call>``), as it is asked to write them, and a tool's answer keeps the
    ``tool`` role. The deprecated ``function`` role is a tool answer.
    """
    role = _TEMPLATE_ROLES.get(message.role, message.role)
    text = message.text()
    if message.tool_calls or message.function_call is not None:
        parts = [text] if text else []
        parts.append(calls_text([(call.name, _arguments(call)) for call in message.calls()]))
        text = "\n".join(parts)
    rendered = {"role": role, "content": text}
    if message.name is not None:
        rendered["name"] = message.name
    if message.tool_call_id is not None:
        rendered["tool_call_id"] = message.tool_call_id
    return rendered


_TEMPLATE_ROLES = {"developer": "system", "function": "tool"}


def _arguments(call: FunctionCall) -> Any:
    try:
        return orjson.loads(call.arguments)
    except orjson.JSONDecodeError:
        return call.arguments  # kept as the model wrote it


def handoff_from(disagg: DisaggregatedParams | None, vocab_size: int, n: int = 1) -> Handoff | None:
    """The hand-off a generation_only request continues from (None for any other request). A request that CTX's
    first tokens finished (``finished_at_context``) has none and is not asked here."""
    if disagg is None or disagg.request_type != "generation_only":
        return None
    if not disagg.first_gen_tokens:
        raise HandoffError("a generation_only request needs disaggregated_params.first_gen_tokens",
                           param="disaggregated_params.first_gen_tokens")
    more = disagg.more_sequences or []
    if len(more) != n - 1:
        raise HandoffError(f"the request asks for n={n} but the hand-off starts {len(more) + 1} sequence(s)",
                           param="disaggregated_params.more_sequences")
    for field, tokens in [("first_gen_tokens", disagg.first_gen_tokens),
                          *((f"more_sequences.{i}.first_gen_tokens", s.first_gen_tokens) for i, s in enumerate(more))]:
        if any(not 0 <= t < vocab_size for t in tokens):
            raise HandoffError(f"{field} must be token ids in [0, {vocab_size})",
                               param=f"disaggregated_params.{field}")
    if disagg.encoded_opaque_state is None:
        raise HandoffError("a generation_only request needs disaggregated_params.encoded_opaque_state",
                           param="disaggregated_params.encoded_opaque_state")
    try:
        state = pybase64.b64decode(disagg.encoded_opaque_state, validate=True)
    except ValueError as exc:
        raise HandoffError("encoded_opaque_state is not valid base64",
                           param="disaggregated_params.encoded_opaque_state") from exc
    ctx_id = None if disagg.ctx_request_id is None else str(disagg.ctx_request_id)
    starts = tuple(SequenceStart(tuple(s.first_gen_tokens), _token_logprobs(s.first_gen_logprobs)) for s in more)
    logprobs = _token_logprobs(disagg.first_gen_logprobs) if disagg.first_gen_logprobs is not None \
        else first_gen_logprobs_from(disagg.first_gen_log_probs)  # TensorRT-LLM's field, from its orchestrator
    steps = tuple(disagg.first_gen_steps or ())
    if steps and sum(steps) != len(disagg.first_gen_tokens):
        raise HandoffError("first_gen_steps must add up to the number of first_gen_tokens",
                           param="disaggregated_params.first_gen_steps")
    return Handoff(tuple(disagg.first_gen_tokens), state, ctx_id, logprobs, starts, disagg.cached_tokens or 0, steps)


def _token_logprobs(wire: list[FirstTokenLogprob] | None) -> tuple[TokenLogprob, ...]:
    return tuple(TokenLogprob(lp.token_id, lp.logprob, tuple(lp.top)) for lp in wire or ())


def phase_of(disagg: DisaggregatedParams | None) -> Phase:
    if disagg is None or disagg.request_type == "context_and_generation":
        return Phase.AGGREGATED
    return Phase.CONTEXT_ONLY if disagg.request_type == "context_only" else Phase.GENERATION_ONLY


def endpoint_of(wire: GenerationWireRequest) -> Endpoint:
    if isinstance(wire, ChatCompletionRequest):
        return "chat"
    if isinstance(wire, CompletionRequest):
        return "completions"
    return "responses"

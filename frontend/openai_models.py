"""OpenAI request wire models (chat, completions, responses) plus the disaggregation extensions.

Pydantic lives only here, at the wire. Unknown fields are refused (``extra="forbid"``) so that a misspelt or
unsupported parameter is a clear 400 instead of being silently ignored; parameters that OpenAI defines but this
server does not implement are listed in ``frontend.openai_parameters``: a null or otherwise neutral value of one is
accepted and dropped, any other is refused with a message that says so.

Chat messages take every field the official SDK can put in one (``model_dump()`` of a reply included): an
assistant's ``tool_calls`` and ``function_call`` and a tool message's ``tool_call_id`` are rendered into the chat
template; ``refusal``, ``annotations`` and ``reasoning_content`` are read as history and ``audio`` must be null.
"""

from __future__ import annotations

from typing import Annotated, Any, ClassVar, Literal

from pydantic import BaseModel, ConfigDict, Field, StrictBool, StrictInt, model_validator

from frontend.errors import InvalidRequestError, UnsupportedParameterError
from frontend.openai_parameters import (
    UNSUPPORTED_PARAMETERS,
    WireEndpoint,
    drop_neutral_parameters,
    refuse_unsupported,
)
from frontend.responses_items import ResponsesInput, chat_turns
from frontend.trtllm_identity import validate_identity_fields
from frontend.trtllm_lifecycle import TransceiverLifecycleAdvertisement

__all__ = ["UNSUPPORTED_PARAMETERS", "refuse_unsupported_parameters"]

# A 64-bit signed integer, as OpenAI and vLLM take it.
SEED_MIN, SEED_MAX = -(2**63), 2**63 - 1
MAX_N = 128  # OpenAI's own limit on n


class WireModel(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


# context_and_generation is TensorRT-LLM's name for an ordinary aggregated request.
RequestType = Literal["context_only", "generation_only", "context_and_generation"]


class FirstTokenLogprob(WireModel):
    """The logprob of a token CTX chose, so GEN can report it (an extension beside ``first_gen_tokens``)."""

    token_id: StrictInt
    logprob: float
    top: list[tuple[StrictInt, float]] = []


class MoreSequenceStart(WireModel):
    """The first token(s) CTX chose for one more sequence of an n > 1 request (``first_gen_tokens`` is sequence
    0's): an extension, absent when n is 1."""

    first_gen_tokens: Annotated[list[StrictInt], Field(min_length=1)]
    first_gen_logprobs: list[FirstTokenLogprob] | None = None


class DisaggregatedParams(WireModel):
    """The hand-off fields between the orchestrator, CTX and GEN: every field of TensorRT-LLM's
    ``DisaggregatedParams`` (docs/interop.md), plus this project's own (``first_gen_logprobs``, ``prompt_len``,
    ``more_sequences``, ``cached_tokens``), which a disagg-serve orchestrator announces with ``native_extensions``
    (a CTX answers with them only then, and echoes the flag to GEN)."""

    request_type: RequestType
    disagg_request_id: int | None = None
    ctx_request_id: str | int | None = None
    first_gen_tokens: list[StrictInt] | None = None
    first_gen_logprobs: list[FirstTokenLogprob] | None = None
    encoded_opaque_state: str | None = None
    prompt_len: Annotated[int, Field(ge=1)] | None = None
    return_prompt_token_ids_b64: bool = False
    more_sequences: list[MoreSequenceStart] | None = None  # sequences 1..n-1, by index
    cached_tokens: Annotated[int, Field(ge=0)] | None = None  # prompt tokens CTX reused from its KV blocks
    native_extensions: bool = False
    # TensorRT-LLM's fields that mean nothing to this engine are accepted and left unread: draft tokens are a
    # speculative hint, the rank / endpoint / usage / thinking fields describe TensorRT-LLM's own engines.
    first_gen_log_probs: list[Any] | None = None  # written and read as [[token_id, logprob, [[id, logprob]..]]..]
    first_gen_logits: list[Any] | None = None
    draft_tokens: list[StrictInt] | None = None
    ctx_dp_rank: int | None = None
    ctx_info_endpoint: str | list[str] | None = None
    schedule_style: int | None = None
    conversation_id: str | None = None
    ctx_usage: dict[str, Any] | None = None
    resolved_thinking: bool | None = None
    # TensorRT-LLM's lifecycle protocol v1 (frontend/trtllm_lifecycle.py): the attempt identity, the admitted GEN
    # endpoint, CTX's control endpoint and advertisement. Checked as TensorRT-LLM checks them; what a worker makes
    # of them depends on its protocol version (workers/lifecycle.py).
    logical_request_id: StrictInt | None = None
    prefill_artifact_id: str | None = None
    artifact_version: StrictInt | None = None
    handoff_attempt_uuid: str | None = None
    consumer_grant_id: str | None = None
    transfer_session_id: str | None = None
    generation_endpoint_name: str | None = None
    generation_endpoint_rank: StrictInt | None = None
    generation_endpoint_incarnation: str | None = None
    context_control_endpoint: str | None = None
    context_transceiver_lifecycle: TransceiverLifecycleAdvertisement | None = None

    @model_validator(mode="after")
    def _lifecycle_identity(self) -> DisaggregatedParams:
        if self.schedule_style not in (None, 0, 1):
            raise UnsupportedParameterError("schedule_style is 0 (context first) or 1 (generation first)",
                                            param="disaggregated_params.schedule_style")
        validate_identity_fields(self.__dict__)
        return self


class ConversationParams(WireModel):
    """TensorRT-LLM's ``conversation_params``: the conversation a request belongs to (routing affinity only; a
    worker reads nothing else from it)."""

    conversation_id: Annotated[str, Field(min_length=1)]

    @model_validator(mode="before")
    @classmethod
    def _stripped(cls, value: Any) -> Any:
        if isinstance(value, dict):
            cid = value.get("conversation_id")
            if cid is None or (isinstance(cid, str) and not cid.strip()):
                raise ValueError("conversation_id must be non-empty")
            if isinstance(cid, str):
                value = {**value, "conversation_id": cid.strip()}
        return value


class TextContentPart(WireModel):
    type: Literal["text", "input_text", "output_text"]
    text: str


class ImageContentPart(WireModel):
    type: Literal["image_url", "input_image"]
    image_url: Any = None


class AudioContentPart(WireModel):
    type: Literal["input_audio"]
    input_audio: Any = None


class FileContentPart(WireModel):
    type: Literal["file"]
    file: Any = None


class RefusalContentPart(WireModel):
    """An assistant turn's refusal, as the SDK writes it back into the history."""

    type: Literal["refusal"]
    refusal: str


ContentPart = Annotated[
    TextContentPart | ImageContentPart | AudioContentPart | FileContentPart | RefusalContentPart,
    Field(discriminator="type"),
]
_TEXT_PARTS = (TextContentPart, RefusalContentPart)


class FunctionCall(WireModel):
    name: str
    arguments: str


class ToolCall(WireModel):
    id: str | None = None
    type: Literal["function"] = "function"
    function: FunctionCall


class ChatMessage(WireModel):
    role: Literal["system", "developer", "user", "assistant", "tool", "function"]
    content: str | list[ContentPart] | None = None
    name: str | None = None
    # Assistant history, as ``reply.choices[0].message.model_dump()`` gives it back.
    refusal: str | None = None
    tool_calls: list[ToolCall] | None = None
    function_call: FunctionCall | None = None
    audio: dict[str, Any] | None = None  # a reference to generated audio: only null can be honoured
    annotations: list[Any] | None = None  # citations of the answer: output only, nothing to render
    reasoning_content: str | None = None  # vLLM's reasoning field: earlier reasoning is not fed back
    reasoning: str | None = None
    # A tool's answer.
    tool_call_id: str | None = None

    @property
    def has_media(self) -> bool:
        return isinstance(self.content, list) and any(not isinstance(p, _TEXT_PARTS) for p in self.content)

    def text(self) -> str:
        if self.content is None:
            return self.refusal or ""
        if isinstance(self.content, str):
            return self.content
        return "".join(p.text if isinstance(p, TextContentPart) else p.refusal
                       for p in self.content if isinstance(p, _TEXT_PARTS))

    def calls(self) -> list[FunctionCall]:
        """The function calls this (assistant) message made, the deprecated ``function_call`` included."""
        calls = [call.function for call in self.tool_calls or ()]
        return [*calls, self.function_call] if self.function_call is not None else calls


class JsonSchemaFormat(WireModel):
    """``response_format.json_schema``: the schema the answer must satisfy (always enforced, strict or not)."""

    # ``schema`` would shadow a BaseModel attribute; the wire name stays ``schema``.
    model_config = ConfigDict(extra="forbid", frozen=True, populate_by_name=True)

    name: str
    description: str | None = None
    json_schema: dict[str, Any] | None = Field(default=None, alias="schema")
    strict: bool | None = None


class ResponseFormat(WireModel):
    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaFormat | None = None


class FunctionDefinition(WireModel):
    name: str
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None


class ChatTool(WireModel):
    type: Literal["function"]
    function: FunctionDefinition


class ToolChoiceFunction(WireModel):
    name: str


class NamedToolChoice(WireModel):
    type: Literal["function"]
    function: ToolChoiceFunction


ToolChoice = Literal["none", "auto", "required"] | NamedToolChoice


class StreamOptions(WireModel):
    include_usage: bool | None = False
    include_obfuscation: bool | None = None  # OpenAI's padding against length side channels: nothing to pad here


Stop = str | list[str] | None


class SamplingFields(WireModel):
    """Fields every generation endpoint shares; extensions match vLLM / TensorRT-LLM names."""

    wire_endpoint: ClassVar[WireEndpoint | None] = None

    model: str
    stream: StrictBool | None = False  # an explicit null is the default: no stream
    stream_options: StreamOptions | None = None
    temperature: Annotated[float, Field(ge=0.0, le=2.0)] | None = None
    top_p: Annotated[float, Field(gt=0.0, le=1.0)] | None = None
    top_k: Annotated[int, Field(ge=0)] | None = None
    seed: Annotated[StrictInt, Field(ge=SEED_MIN, le=SEED_MAX)] | None = None
    stop: Stop = None
    frequency_penalty: Annotated[float, Field(ge=-2.0, le=2.0)] | None = None
    presence_penalty: Annotated[float, Field(ge=-2.0, le=2.0)] | None = None
    repetition_penalty: Annotated[float, Field(gt=0.0)] | None = None
    logit_bias: dict[str, Annotated[float, Field(ge=-100.0, le=100.0)]] | None = None
    ignore_eos: bool = False
    user: str | None = None
    # Sequences per request (OpenAI's limit). The Responses API has no n: only 1 there.
    n: Annotated[int, Field(ge=1, le=MAX_N)] | None = None
    # Disaggregation extensions (TensorRT-LLM field names).
    disaggregated_params: DisaggregatedParams | None = None
    conversation_params: ConversationParams | None = None  # TensorRT-LLM's field: accepted, used for nothing here
    prompt_token_ids: list[StrictInt] | None = None
    prompt_token_ids_b64: str | None = None

    @model_validator(mode="before")
    @classmethod
    def _drop_neutral_parameters(cls, data: Any) -> Any:
        if isinstance(data, dict) and cls.wire_endpoint is not None:
            return drop_neutral_parameters(cls.wire_endpoint, data)
        return data

    @model_validator(mode="after")
    def _refuse_unsupported(self) -> SamplingFields:
        if self.n not in (None, 1) and self.wire_endpoint == "responses":
            raise UnsupportedParameterError("the Responses API has no 'n': only n=1", param="n")
        if self.stream_options is not None and not self.stream:
            raise InvalidRequestError("'stream_options' is only allowed when 'stream' is true", param="stream_options")
        return self

    @property
    def include_usage(self) -> bool:
        return bool(self.stream_options and self.stream_options.include_usage)

    @property
    def is_generation_only(self) -> bool:
        return self.disaggregated_params is not None and self.disaggregated_params.request_type == "generation_only"

    def _require_prompt(self, field: str, value: object) -> None:
        # GEN may get no prompt text at all: the orchestrator drops it when the KV hand-off carries the tokens.
        if value is None and not self.is_generation_only:
            # Not a ValueError: pydantic would report it at the model level, with no field for 'param'.
            raise InvalidRequestError(f"'{field}' is required", param=field)


class ChatCompletionRequest(SamplingFields):
    wire_endpoint = "chat"

    messages: Annotated[list[ChatMessage], Field(min_length=1)] | None = None
    max_tokens: Annotated[int, Field(ge=1)] | None = None
    max_completion_tokens: Annotated[int, Field(ge=1)] | None = None
    logprobs: bool | None = False
    top_logprobs: Annotated[int, Field(ge=0, le=20)] | None = None
    prompt_logprobs: Annotated[int, Field(ge=0, le=20)] | None = None
    chat_template_kwargs: dict[str, Any] | None = None
    # Structured output (``frontend.structured_output`` reads them; engines without it refuse them).
    response_format: ResponseFormat | None = None
    tools: list[ChatTool] | None = None
    tool_choice: ToolChoice | None = None

    @model_validator(mode="after")
    def _has_messages(self) -> ChatCompletionRequest:
        self._require_prompt("messages", self.messages)
        for index, message in enumerate(self.messages or ()):
            if message.audio is not None:
                raise UnsupportedParameterError("a message's 'audio' must be null: this server makes no audio",
                                                param=f"messages.{index}.audio")
        return self

    @property
    def requested_max_tokens(self) -> int | None:
        return self.max_completion_tokens if self.max_completion_tokens is not None else self.max_tokens


class CompletionRequest(SamplingFields):
    wire_endpoint = "completions"

    prompt: str | list[StrictInt] | list[str] | list[list[StrictInt]] | None = None
    max_tokens: Annotated[int, Field(ge=1)] | None = 16
    logprobs: Annotated[int, Field(ge=0, le=20)] | None = None
    echo: bool | None = False
    suffix: str | None = None
    best_of: int | None = None
    prompt_logprobs: Annotated[int, Field(ge=0, le=20)] | None = None

    @model_validator(mode="after")
    def _single_prompt(self) -> CompletionRequest:
        self._require_prompt("prompt", self.prompt)
        prompt = self.prompt
        if isinstance(prompt, list) and len(prompt) > 1 and isinstance(prompt[0], str | list):
            raise UnsupportedParameterError("only one prompt per request is supported", param="prompt")
        if self.suffix:
            raise UnsupportedParameterError("'suffix' is not supported", param="suffix")
        if self.best_of not in (None, 1):
            # Like vLLM V1: best_of ranks candidates by cumulative logprob, which no client we know relies on.
            raise UnsupportedParameterError("only best_of=1 is supported; use n to get several choices",
                                            param="best_of")
        return self

    @property
    def requested_max_tokens(self) -> int | None:
        return self.max_tokens


class ResponsesTextFormat(WireModel):
    """``text.format`` of the Responses API: ``response_format`` with the json_schema fields flattened."""

    model_config = ConfigDict(extra="forbid", frozen=True, populate_by_name=True)

    type: Literal["text", "json_object", "json_schema"]
    name: str | None = None
    description: str | None = None
    json_schema: dict[str, Any] | None = Field(default=None, alias="schema")
    strict: bool | None = None

    def as_response_format(self) -> ResponseFormat:
        if self.type != "json_schema":
            return ResponseFormat(type=self.type)
        return ResponseFormat(type="json_schema", json_schema=JsonSchemaFormat.model_validate(
            {"name": self.name or "response", "description": self.description, "schema": self.json_schema,
             "strict": self.strict}))


class ResponsesText(WireModel):
    format: ResponsesTextFormat | None = None
    verbosity: None = None


class ResponsesRequest(SamplingFields):
    wire_endpoint = "responses"

    input: ResponsesInput | None = None
    instructions: str | None = None
    max_output_tokens: Annotated[int, Field(ge=1)] | None = None
    store: bool | None = None
    metadata: dict[str, str] | None = None
    previous_response_id: str | None = None
    text: ResponsesText | None = None

    @model_validator(mode="after")
    def _stateless(self) -> ResponsesRequest:
        self._require_prompt("input", self.input)
        if self.previous_response_id is not None:
            # The orchestrator keeps stored responses and sends workers the whole conversation instead.
            raise UnsupportedParameterError(
                "'previous_response_id' is not supported by a worker: the orchestrator stores responses and "
                "continues conversations", param="previous_response_id"
            )
        return self

    def chat_messages(self) -> list[ChatMessage]:
        messages = [ChatMessage(role="system", content=self.instructions)] if self.instructions else []
        if isinstance(self.input, str):
            messages.append(ChatMessage(role="user", content=self.input))
        elif self.input is not None:
            messages.extend(ChatMessage.model_validate(turn) for turn in chat_turns(self.input))
        return messages

    @property
    def requested_max_tokens(self) -> int | None:
        return self.max_output_tokens


GenerationWireRequest = ChatCompletionRequest | CompletionRequest | ResponsesRequest


def refuse_unsupported_parameters(body: dict[str, Any]) -> None:
    """A non-neutral value of a parameter no endpoint implements is a 400 naming it (``frontend.openai_parameters``);
    the wire models drop the neutral ones, endpoint by endpoint."""
    refuse_unsupported(body)

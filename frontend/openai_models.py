"""OpenAI request wire models (chat, completions, responses) plus the disaggregation extensions.

Pydantic lives only here, at the wire. Unknown fields are refused (``extra="forbid"``) so that a misspelt or
unsupported parameter is a clear 400 instead of being silently ignored; parameters that OpenAI defines but this
server does not implement are listed in ``UNSUPPORTED_PARAMETERS`` and refused with a message that says so.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, StrictBool, StrictInt, model_validator

from frontend.errors import InvalidRequestError, UnsupportedParameterError


class WireModel(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


RequestType = Literal["context_only", "generation_only"]


class FirstTokenLogprob(WireModel):
    """The logprob of a token CTX chose, so GEN can report it (an extension beside ``first_gen_tokens``)."""

    token_id: StrictInt
    logprob: float
    top: list[tuple[StrictInt, float]] = []


class DisaggregatedParams(WireModel):
    """TensorRT-LLM-compatible hand-off fields between the orchestrator, CTX and GEN."""

    request_type: RequestType
    disagg_request_id: int | None = None
    ctx_request_id: str | int | None = None
    first_gen_tokens: list[StrictInt] | None = None
    first_gen_logprobs: list[FirstTokenLogprob] | None = None
    encoded_opaque_state: str | None = None
    prompt_len: Annotated[int, Field(ge=1)] | None = None
    return_prompt_token_ids_b64: bool = False


class TextContentPart(WireModel):
    type: Literal["text", "input_text", "output_text"]
    text: str


class ImageContentPart(WireModel):
    type: Literal["image_url", "input_image"]
    image_url: Any = None


class AudioContentPart(WireModel):
    type: Literal["input_audio"]
    input_audio: Any = None


ContentPart = Annotated[TextContentPart | ImageContentPart | AudioContentPart, Field(discriminator="type")]


class ChatMessage(WireModel):
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[ContentPart] | None = None
    name: str | None = None

    @property
    def has_media(self) -> bool:
        return isinstance(self.content, list) and any(not isinstance(p, TextContentPart) for p in self.content)

    def text(self) -> str:
        if self.content is None:
            return ""
        if isinstance(self.content, str):
            return self.content
        return "".join(p.text for p in self.content if isinstance(p, TextContentPart))


class StreamOptions(WireModel):
    include_usage: bool = False


Stop = str | list[str] | None


class SamplingFields(WireModel):
    """Fields every generation endpoint shares; extensions match vLLM / TensorRT-LLM names."""

    model: str
    stream: StrictBool = False
    stream_options: StreamOptions | None = None
    temperature: Annotated[float, Field(ge=0.0, le=2.0)] | None = None
    top_p: Annotated[float, Field(gt=0.0, le=1.0)] | None = None
    top_k: Annotated[int, Field(ge=0)] | None = None
    seed: int | None = None
    stop: Stop = None
    frequency_penalty: Annotated[float, Field(ge=-2.0, le=2.0)] | None = None
    presence_penalty: Annotated[float, Field(ge=-2.0, le=2.0)] | None = None
    repetition_penalty: Annotated[float, Field(gt=0.0)] | None = None
    logit_bias: dict[str, Annotated[float, Field(ge=-100.0, le=100.0)]] | None = None
    ignore_eos: bool = False
    user: str | None = None
    n: Annotated[int, Field(ge=1)] | None = None
    # Disaggregation extensions (TensorRT-LLM field names).
    disaggregated_params: DisaggregatedParams | None = None
    prompt_token_ids: list[StrictInt] | None = None
    prompt_token_ids_b64: str | None = None

    @model_validator(mode="after")
    def _refuse_unsupported(self) -> SamplingFields:
        if self.n is not None and self.n != 1:
            raise UnsupportedParameterError("only n=1 is supported", param="n")
        return self

    @property
    def is_generation_only(self) -> bool:
        return self.disaggregated_params is not None and self.disaggregated_params.request_type == "generation_only"

    def _require_prompt(self, field: str, value: object) -> None:
        # GEN may get no prompt text at all: the orchestrator drops it when the KV hand-off carries the tokens.
        if value is None and not self.is_generation_only:
            # Not a ValueError: pydantic would report it at the model level, with no field for 'param'.
            raise InvalidRequestError(f"'{field}' is required", param=field)


class ChatCompletionRequest(SamplingFields):
    messages: Annotated[list[ChatMessage], Field(min_length=1)] | None = None
    max_tokens: Annotated[int, Field(ge=1)] | None = None
    max_completion_tokens: Annotated[int, Field(ge=1)] | None = None
    logprobs: bool = False
    top_logprobs: Annotated[int, Field(ge=0, le=20)] | None = None
    prompt_logprobs: Annotated[int, Field(ge=0, le=20)] | None = None
    chat_template_kwargs: dict[str, Any] | None = None

    @model_validator(mode="after")
    def _has_messages(self) -> ChatCompletionRequest:
        self._require_prompt("messages", self.messages)
        return self

    @property
    def requested_max_tokens(self) -> int | None:
        return self.max_completion_tokens if self.max_completion_tokens is not None else self.max_tokens


class CompletionRequest(SamplingFields):
    prompt: str | list[StrictInt] | list[str] | list[list[StrictInt]] | None = None
    max_tokens: Annotated[int, Field(ge=1)] | None = 16
    logprobs: Annotated[int, Field(ge=0, le=20)] | None = None
    echo: bool = False
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
            raise UnsupportedParameterError("only best_of=1 is supported", param="best_of")
        return self

    @property
    def requested_max_tokens(self) -> int | None:
        return self.max_tokens


class ResponsesInputMessage(WireModel):
    type: Literal["message"] | None = None
    role: Literal["system", "developer", "user", "assistant"]
    content: str | list[ContentPart]
    id: str | None = None
    status: str | None = None

    def as_chat_message(self) -> ChatMessage:
        return ChatMessage(role=self.role, content=self.content)


class ResponsesRequest(SamplingFields):
    input: str | Annotated[list[ResponsesInputMessage], Field(min_length=1)] | None = None
    instructions: str | None = None
    max_output_tokens: Annotated[int, Field(ge=1)] | None = None
    store: bool | None = None
    metadata: dict[str, str] | None = None
    previous_response_id: str | None = None

    @model_validator(mode="after")
    def _stateless(self) -> ResponsesRequest:
        self._require_prompt("input", self.input)
        if self.previous_response_id is not None:
            raise UnsupportedParameterError(
                "'previous_response_id' is not supported: this server stores no responses", param="previous_response_id"
            )
        return self

    def chat_messages(self) -> list[ChatMessage]:
        messages = [ChatMessage(role="system", content=self.instructions)] if self.instructions else []
        if isinstance(self.input, str):
            messages.append(ChatMessage(role="user", content=self.input))
        elif self.input is not None:
            messages.extend(m.as_chat_message() for m in self.input)
        return messages

    @property
    def requested_max_tokens(self) -> int | None:
        return self.max_output_tokens


GenerationWireRequest = ChatCompletionRequest | CompletionRequest | ResponsesRequest

# OpenAI parameters that are recognised but not implemented: refused by name, never ignored.
UNSUPPORTED_PARAMETERS: frozenset[str] = frozenset(
    {
        "tools",
        "tool_choice",
        "functions",
        "function_call",
        "parallel_tool_calls",
        "response_format",
        "audio",
        "modalities",
        "prediction",
        "reasoning_effort",
        "reasoning",
        "web_search_options",
        "text",
        "include",
        "truncation",
        "background",
        "service_tier",
        "no_repeat_ngram_size",
    }
)


def refuse_unsupported_parameters(body: dict[str, Any]) -> None:
    for name in UNSUPPORTED_PARAMETERS.intersection(body):
        if body[name] is not None:
            raise UnsupportedParameterError(f"parameter '{name}' is not supported by this server", param=name)

"""OpenAI request wire models (chat, completions, responses), with the disaggregation extensions they take.

Pydantic lives only here, at the wire. Unknown fields are refused (``frontend.wire_model``), and the parameters
OpenAI defines that this server does not implement are judged in ``frontend.openai_parameters``: nothing a client
sends is silently ignored."""

from __future__ import annotations

from typing import Annotated, Any, ClassVar, Literal

from pydantic import ConfigDict, Field, StrictBool, StrictInt, model_validator

from frontend.chat_messages import ChatMessage
from frontend.disaggregated_params import ConversationParams, DisaggregatedParams
from frontend.errors import InvalidRequestError, UnsupportedParameterError
from frontend.openai_parameters import (
    UNSUPPORTED_PARAMETERS,
    WireEndpoint,
    drop_neutral_parameters,
    refuse_unsupported,
)
from frontend.responses_items import ResponsesInput, chat_turns
from frontend.responses_tools import ResponsesNamedToolChoice, ResponsesToolChoice, ResponsesTools
from frontend.wire_model import WireModel

__all__ = ["UNSUPPORTED_PARAMETERS", "refuse_unsupported_parameters"]

# A 64-bit signed integer, as OpenAI and vLLM take it.
SEED_MIN, SEED_MAX = -(2**63), 2**63 - 1
MAX_N = 128  # OpenAI's own limit on n


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
    # vLLM's and TensorRT-LLM's: with include_usage, every chunk carries the usage so far (the first: the prompt's)
    continuous_usage_stats: bool | None = False
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
    parallel_tool_calls: StrictBool | None = None  # several calls in one answer (``frontend.tool_calls``)

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
    # Function tools, read as chat's (``chat_tools``) by ``frontend.structured_output``.
    tools: ResponsesTools | None = None
    tool_choice: ResponsesToolChoice | None = None
    parallel_tool_calls: StrictBool | None = None  # several calls in one answer (``frontend.tool_calls``)

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

    def chat_tools(self) -> list[ChatTool]:
        """The function tools as chat's ``tools``."""
        return [ChatTool(type="function", function=FunctionDefinition(
            name=tool.name, description=tool.description, parameters=tool.parameters, strict=tool.strict))
            for tool in self.tools or ()]

    def chat_tool_choice(self) -> ToolChoice | None:
        """``tool_choice`` as chat's: a named function moves under ``function``."""
        choice = self.tool_choice
        if isinstance(choice, ResponsesNamedToolChoice):
            return NamedToolChoice(type="function", function=ToolChoiceFunction(name=choice.name))
        return choice


GenerationWireRequest = ChatCompletionRequest | CompletionRequest | ResponsesRequest


def refuse_unsupported_parameters(body: dict[str, Any]) -> None:
    """A non-neutral value of a parameter no endpoint implements is a 400 naming it (``frontend.openai_parameters``);
    the wire models drop the neutral ones, endpoint by endpoint."""
    refuse_unsupported(body)

"""Strict models of TensorRT-LLM's disaggregated wire, written here from its published field names and types.

TensorRT-LLM's OpenAI models refuse unknown fields (``extra="forbid"``); so do these, so a body or an answer that
TensorRT-LLM would refuse fails here too. The request models list the client fields our tests send, not every one
TensorRT-LLM takes: an extra field of ours is then caught rather than waved through. ``ctx_request_id`` and the
other ints are strict: TensorRT-LLM needs an int where this project used to send a uuid string.

Also here: what TensorRT-LLM's v0 context-first orchestrator sends on each leg (``trtllm_context_body``,
``trtllm_generation_body``, ``needs_generation``), so a test can play that orchestrator against our workers.
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, StrictBool, StrictInt, StrictStr, field_validator, model_validator

from frontend.trtllm.identity import validate_identity_fields
from frontend.trtllm.lifecycle import TransceiverLifecycleAdvertisement

GEN_PENDING_FINISH_REASONS = ("length", "not_finished")


class Strict(BaseModel):
    model_config = ConfigDict(extra="forbid")


class PromptTokensDetails(Strict):
    cached_tokens: StrictInt = 0


class UsageInfo(Strict):
    prompt_tokens: StrictInt = 0
    total_tokens: StrictInt = 0
    completion_tokens: StrictInt | None = 0
    prompt_tokens_details: PromptTokensDetails | None = None


class DisaggregatedParams(Strict):
    """Every field of the lifecycle-v1 snapshot (91c7f67) and of main (``resolved_thinking``): the union, since a
    body of either must validate here; the lifecycle identities are checked as TensorRT-LLM checks them."""

    request_type: StrictStr
    first_gen_tokens: list[StrictInt] | None = None
    first_gen_log_probs: list[Any] | None = None
    first_gen_logits: list[Any] | None = None
    ctx_request_id: StrictInt | None = None
    encoded_opaque_state: StrictStr | None = None
    draft_tokens: list[StrictInt] | None = None
    disagg_request_id: StrictInt | None = None
    # lifecycle v1: the attempt identity, the admitted GEN endpoint, the CTX's control endpoint and advertisement
    logical_request_id: StrictInt | None = None
    prefill_artifact_id: StrictStr | None = None
    artifact_version: StrictInt | None = None
    handoff_attempt_uuid: StrictStr | None = None
    consumer_grant_id: StrictStr | None = None
    transfer_session_id: StrictStr | None = None
    generation_endpoint_name: StrictStr | None = None
    generation_endpoint_rank: StrictInt | None = None
    generation_endpoint_incarnation: StrictStr | None = None
    context_control_endpoint: StrictStr | None = None
    context_transceiver_lifecycle: TransceiverLifecycleAdvertisement | None = None
    ctx_dp_rank: StrictInt | None = None
    ctx_info_endpoint: StrictStr | None = None
    schedule_style: Literal[0, 1] | None = None
    conversation_id: StrictStr | None = None
    ctx_usage: UsageInfo | None = None
    return_prompt_token_ids_b64: StrictBool = False
    resolved_thinking: StrictBool | None = None

    @model_validator(mode="after")
    def _lifecycle_identity(self) -> DisaggregatedParams:
        validate_identity_fields(self.__dict__)
        return self


class StreamOptions(Strict):
    include_usage: bool | None = True
    continuous_usage_stats: bool | None = False


class ConversationParams(Strict):
    """``conversation_params`` of a client body; ``subagent_affinity_id`` is server-private (never serialised: it
    travels as the ``x-trtllm-subagent-affinity-id`` header)."""

    conversation_id: StrictStr
    subagent_affinity_id: StrictStr | None = Field(default=None, exclude=True)

    @field_validator("conversation_id", mode="before")
    @classmethod
    def _non_empty(cls, value: Any) -> Any:
        if value is None or (isinstance(value, str) and not value.strip()):
            raise ValueError("conversation_id must be non-empty")
        return value.strip() if isinstance(value, str) else value


class _Sampling(Strict):
    model: StrictStr
    max_tokens: StrictInt | None = None
    temperature: float | None = None
    top_p: float | None = None
    seed: StrictInt | None = None
    stop: str | list[str] | None = None
    stream: bool | None = False
    stream_options: StreamOptions | None = None
    ignore_eos: bool = False
    disaggregated_params: DisaggregatedParams | None = None


class ChatCompletionRequest(_Sampling):
    messages: list[dict[str, Any]]  # required: TensorRT-LLM refuses a chat body without it
    prompt_token_ids: list[StrictInt] | None = None
    prompt_token_ids_b64: StrictStr | None = None
    max_completion_tokens: StrictInt | None = None
    logprobs: bool | None = False
    top_logprobs: StrictInt | None = 0
    conversation_params: ConversationParams | None = None


class CompletionRequest(_Sampling):
    prompt: list[StrictInt] | list[list[StrictInt]] | str | list[str]  # required, as TensorRT-LLM has it
    logprobs: StrictInt | None = None
    echo: bool | None = False
    conversation_params: ConversationParams | None = None


class ChatMessage(Strict):
    role: StrictStr
    content: StrictStr | None = None
    reasoning_content: StrictStr | None = None
    reasoning: StrictStr | None = None
    tool_calls: list[dict[str, Any]] = []


class ChatCompletionResponseChoice(Strict):
    index: StrictInt
    message: ChatMessage
    logprobs: dict[str, Any] | None = None
    finish_reason: StrictStr | None = None
    stop_reason: StrictInt | StrictStr | None = None
    mm_embedding_handle: dict[str, Any] | None = None
    disaggregated_params: DisaggregatedParams | None = None
    avg_decoded_tokens_per_iter: float | None = None


class ChatCompletionResponse(Strict):
    id: StrictStr
    object: Literal["chat.completion"] = "chat.completion"
    created: StrictInt
    model: StrictStr
    choices: list[ChatCompletionResponseChoice]
    usage: UsageInfo
    prompt_token_ids: list[StrictInt] | None = None
    prompt_token_ids_b64: StrictStr | None = None


class CompletionResponseChoice(Strict):
    index: StrictInt
    text: StrictStr
    token_ids: list[StrictInt] | None = None
    logprobs: dict[str, Any] | None = None
    context_logits: list[Any] | None = None
    finish_reason: StrictStr | None = None
    stop_reason: StrictInt | StrictStr | None = None
    disaggregated_params: DisaggregatedParams | None = None
    avg_decoded_tokens_per_iter: float | None = None


class CompletionResponse(Strict):
    id: StrictStr
    object: StrictStr = "text_completion"
    created: StrictInt
    model: StrictStr
    choices: list[CompletionResponseChoice]
    usage: UsageInfo
    prompt_token_ids: list[StrictInt] | list[list[StrictInt]] | None = None  # no b64 form for completions


Request = ChatCompletionRequest | CompletionRequest
Response = ChatCompletionResponse | CompletionResponse


def request_model(path: str) -> type[Request]:
    return ChatCompletionRequest if path.endswith("/chat/completions") else CompletionRequest


def response_model(path: str) -> type[Response]:
    return ChatCompletionResponse if path.endswith("/chat/completions") else CompletionResponse


# -- what TensorRT-LLM's orchestrator sends (v0, context first) -------------------------------------------
def dump(model: BaseModel) -> dict[str, Any]:
    """A body as TensorRT-LLM's client writes it: only the fields that were set."""
    dumped: dict[str, Any] = model.model_dump(mode="json", exclude_unset=True)
    return dumped


def trtllm_context_body(path: str, client_body: dict[str, Any], disagg_request_id: int,
                        tokids_ctxbytes: bool) -> dict[str, Any]:
    request = request_model(path).model_validate(client_body)
    conversation = getattr(request, "conversation_params", None)
    ctx = request.model_copy(update={
        "disaggregated_params": DisaggregatedParams(
            request_type="context_only", disagg_request_id=disagg_request_id, schedule_style=0,
            conversation_id=conversation.conversation_id if conversation is not None else None,
            return_prompt_token_ids_b64=tokids_ctxbytes),
        "stream": False,
        "stream_options": None,
    })
    return dump(ctx)


def needs_generation(answer: Response) -> bool:
    return answer.choices[0].finish_reason in GEN_PENDING_FINISH_REASONS


def trtllm_generation_body(path: str, client_body: dict[str, Any], answer: Response, disagg_request_id: int,
                           strip_message_history: bool = False) -> dict[str, Any]:
    request = request_model(path).model_validate(client_body)
    params = answer.choices[0].disaggregated_params
    assert params is not None
    params.request_type = "generation_only"
    params.schedule_style = 0
    params.conversation_id = None
    params.ctx_usage = answer.usage
    params.disagg_request_id = disagg_request_id
    request.disaggregated_params = params
    if isinstance(request, CompletionRequest):
        assert answer.prompt_token_ids is not None
        request.prompt = answer.prompt_token_ids
    else:
        assert isinstance(answer, ChatCompletionResponse)
        if answer.prompt_token_ids_b64 is not None:
            request.prompt_token_ids_b64 = answer.prompt_token_ids_b64
        else:
            request.prompt_token_ids = answer.prompt_token_ids
        if strip_message_history and len(request.messages) > 1:
            request.messages = request.messages[-1:]
    return dump(request)

"""The disaggregation extensions of the OpenAI request wire: ``disaggregated_params``, the hand-off between the
orchestrator, CTX and GEN (TensorRT-LLM's field set plus this project's own), and TensorRT-LLM's
``conversation_params``. Every generation endpoint's request takes both (``frontend.openai_models``).
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import Field, StrictInt, model_validator

from frontend.errors import UnsupportedParameterError
from frontend.trtllm.identity import validate_identity_fields
from frontend.trtllm.lifecycle import TransceiverLifecycleAdvertisement
from frontend.wire_model import WireModel

# context_and_generation is TensorRT-LLM's name for an ordinary aggregated request.
RequestType = Literal["context_only", "generation_only", "context_and_generation"]


class FirstTokenLogprob(WireModel):
    """The logprob of a token CTX chose, so GEN can report it (an extension beside ``first_gen_tokens``)."""

    token_id: StrictInt
    logprob: float
    top: list[tuple[StrictInt, float]] = []  # noqa: RUF012 (a pydantic field: each model gets its own copy)


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
    # A stream continued on another GEN (orchestrator/flow/migration.py): ``first_gen_tokens`` are the tokens the
    # client has, and these the sizes of the steps the broken stream wrote them in (its text depends on them).
    first_gen_steps: list[Annotated[StrictInt, Field(ge=1)]] | None = None
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
    # TensorRT-LLM's lifecycle protocol v1 (frontend/trtllm/lifecycle.py): the attempt identity, the admitted GEN
    # endpoint, CTX's control endpoint and advertisement. Checked as TensorRT-LLM checks them; what a worker makes
    # of them depends on its protocol version (workers/trtllm/lifecycle.py).
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

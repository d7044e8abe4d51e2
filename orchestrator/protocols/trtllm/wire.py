"""TensorRT-LLM's context-first disaggregated wire (lifecycle protocol v0), as ``trtllm-serve`` workers expect it.

What TensorRT-LLM's own orchestrator sends and reads, field for field (the table in docs/interop.md): CTX gets
the client's body, whole, marked ``context_only``; GEN is called only when CTX's ``finish_reason`` is ``"length"``
or ``"not_finished"``, and gets CTX's ``disaggregated_params`` marked ``generation_only`` with CTX's prompt tokens.
TensorRT-LLM's models forbid unknown fields, so nothing of this project's own (``prompt_len``, release calls) is
sent; its workers have no early hand-off release and no "hand-off lost" answer.
"""

from __future__ import annotations

import secrets
from collections.abc import Mapping
from typing import Any

import orjson

from frontend.errors import UnsupportedParameterError, UpstreamError
from frontend.trtllm.auth import TRTLLM_AUTH_HEADER, needs_request_signature, request_signature
from frontend.trtllm.identity import LIFECYCLE_FIELDS
from orchestrator.b64_splice import encode_with_b64, parse_with_b64_span
from orchestrator.client_body import encode
from orchestrator.conversation import body_conversation_id
from orchestrator.protocols.base import ContextAnswer, PromptCarriage, without_handoff_fields
from orchestrator.upstream.base import Body, Reply

CONTEXT_FIRST = 0  # TensorRT-LLM's DisaggScheduleStyle.CONTEXT_FIRST, an int on the wire
GENERATION_FIRST = 1
GEN_PENDING_FINISH_REASONS = ("length", "not_finished")

# TensorRT-LLM's DisaggregatedParams fields: all a GEN may get, whoever's CTX wrote the hand-off.
DISAGGREGATED_PARAMS_FIELDS = frozenset({
    "request_type", "first_gen_tokens", "first_gen_log_probs", "first_gen_logits", "ctx_request_id",
    "encoded_opaque_state", "draft_tokens", "disagg_request_id", "ctx_dp_rank", "ctx_info_endpoint",
    "schedule_style", "conversation_id", "ctx_usage", "return_prompt_token_ids_b64", "resolved_thinking",
    *LIFECYCLE_FIELDS,  # lifecycle v1: CTX's echo of the attempt, relayed to GEN as TensorRT-LLM does
})


def uncarried(endpoint: str, body: Mapping[str, Any]) -> tuple[str, str] | None:
    """(what, its parameter) of a request this wire cannot carry through CTX, None for any other: its bodies have no
    field for the Responses API's input, n > 1 sequences, or the prompt's logprobs (CTX answers from its first token
    without them: asked for alone, or echoed where CTX answers alone)."""
    if endpoint == "responses":
        return "/v1/responses", "input"
    n = body.get("n")
    if isinstance(n, int) and n > 1:
        return "n > 1", "n"
    if body.get("prompt_logprobs") is not None:
        return "prompt_logprobs", "prompt_logprobs"
    if echoes_logprobs(endpoint, body) and body.get("max_tokens") == 1:  # answered by CTX alone, from its first token
        return "echo with logprobs and max_tokens 1 (the prompt's logprobs)", "echo"
    return None


def echoes_logprobs(endpoint: str, body: Mapping[str, Any]) -> bool:
    """A completion that echoes its prompt with logprobs: this wire carries them only where GEN answers, so one that
    CTX ends at its first token (a stop, EOS) would lose them; where our wire is spoken too, it goes over ours."""
    return endpoint == "completions" and body.get("echo") is True and body.get("logprobs") not in (None, False)


def new_request_id() -> int:
    return secrets.randbits(63)  # names a hand-off on a CTX board: not guessable (workers/trtllm/generation_first.py)


class TrtllmProtocol:
    def __init__(self, *, strip_message_history: bool = False, auth_key: str | None = None) -> None:
        """``auth_key``: TensorRT-LLM's ``internal_request_auth_key``, when trtllm-serve workers require its
        signatures (frontend/trtllm/auth.py)."""
        self.strip_message_history = strip_message_history
        self.auth_key = auth_key

    def sign(self, headers: dict[str, str], params: Mapping[str, Any] | None) -> None:
        """Add TensorRT-LLM's ``x-trtllm-disagg-auth`` to ``headers`` (a request's, for its GEN call) where the
        GEN request's ``disaggregated_params`` carry what a trtllm-serve worker with a key refuses unsigned: the
        KV's opaque state or the CTX endpoint (both are what GEN gets of ``params``, unchanged)."""
        if self.auth_key is not None and needs_request_signature(params):
            assert params is not None
            headers[TRTLLM_AUTH_HEADER] = request_signature(self.auth_key, params)

    def context_request(self, body: dict[str, Any], *, return_prompt_tokens: bool,
                        conversation_id: str | None = None, disagg_request_id: int | None = None,
                        lifecycle: Mapping[str, Any] | None = None) -> Body:
        """``lifecycle``: lifecycle v1's fields of this attempt (``lifecycle.Attempt.ctx_params``), sent under
        ``disagg_request_id`` (its ``logical_request_id``); v0 without."""
        if "messages" not in body and "prompt" not in body:
            raise UnsupportedParameterError("TensorRT-LLM workers serve only chat and completions "
                                            "disaggregated, not /v1/responses", param="input")
        ctx_body = dict(body)  # shallow: the prompt itself is not copied
        ctx_body["disaggregated_params"] = {
            "request_type": "context_only",
            "disagg_request_id": disagg_request_id if disagg_request_id is not None else new_request_id(),
            "schedule_style": CONTEXT_FIRST,
            "conversation_id": conversation_id if conversation_id is not None else body_conversation_id(body),
            "return_prompt_token_ids_b64": return_prompt_tokens,
            **(lifecycle or {}),
        }
        ctx_body["stream"] = False
        ctx_body["stream_options"] = None
        return encode(ctx_body)

    def read_context_answer(self, content: bytes) -> ContextAnswer:
        try:
            response, span = parse_with_b64_span(content)  # a ctxbytes b64 prompt is cut out unparsed
            choice = response["choices"][0]
            params = choice["disaggregated_params"]
        except (orjson.JSONDecodeError, KeyError, IndexError, TypeError) as exc:
            raise UpstreamError("the CTX step failed: its answer has no choices[0].disaggregated_params") from exc
        if not isinstance(params, dict):
            raise UpstreamError("the CTX step failed: its disaggregated_params is not an object")
        encoded = span or response.get("prompt_token_ids_b64")
        return ContextAnswer(
            response=response,
            handoff=params,
            finished=choice.get("finish_reason") not in GEN_PENDING_FINISH_REASONS,
            # TensorRT-LLM reports no prompt_len, and without it the guardrail never takes metadata-only: right,
            # since a trtllm-serve GEN cannot continue from a length alone.
            prompt_len=None,
            prompt_b64=encoded if isinstance(encoded, str | memoryview) else None,
        )

    def finished_response(self, ctx: ContextAnswer) -> dict[str, Any]:
        return without_handoff_fields(ctx.response)

    def generation_request(self, body: dict[str, Any], ctx: ContextAnswer, carriage: PromptCarriage, *,
                           conversation_id: str | None = None,
                           generation_endpoint: Mapping[str, Any] | None = None) -> Body:
        """``generation_endpoint``: lifecycle v1's ``generation_endpoint_*`` of the grant GEN accepted."""
        gen_body = dict(body)  # shallow: the prompt itself is not copied
        params = {k: v for k, v in ctx.handoff.items() if k in DISAGGREGATED_PARAMS_FIELDS}
        params["request_type"] = "generation_only"
        params["schedule_style"] = CONTEXT_FIRST
        params["conversation_id"] = conversation_id if conversation_id is not None else body_conversation_id(body)
        params["ctx_usage"] = ctx.response.get("usage")
        if generation_endpoint:
            params.update(generation_endpoint)
        ctx_id = params.get("ctx_request_id")
        if isinstance(ctx_id, str) and ctx_id.isdigit():  # a disagg-serve CTX in a mixed fleet: ids are decimal
            params["ctx_request_id"] = int(ctx_id)
        gen_body["disaggregated_params"] = params
        # A trtllm-serve CTX always sends its token list; a disagg-serve CTX in a mixed fleet sends one only when
        # asked (else GEN tokenizes the client's prompt, which then stays).
        tokens = ctx.response.get("prompt_token_ids")
        if "messages" in body:
            messages = body["messages"]
            if self.strip_message_history and isinstance(messages, list) and len(messages) > 1:
                gen_body["messages"] = messages[-1:]
            if carriage is PromptCarriage.CTX_TOKENS and ctx.prompt_b64 is not None:
                return encode_with_b64(gen_body, ctx.prompt_b64)  # CTX's very bytes (or str), never decoded
            if tokens is not None:
                gen_body["prompt_token_ids"] = tokens
        elif tokens is not None:
            gen_body["prompt"] = tokens
        return encode(gen_body)

    def generation_first_requests(self, body: dict[str, Any], *, disagg_request_id: int,
                                  conversation_id: str | None, ctx_info: Mapping[str, Any] | None,
                                  lifecycle: Mapping[str, Any] | None = None) -> tuple[Body, Body]:
        """(CTX's body, GEN's body) of a generation-first request, as TensorRT-LLM writes them: GEN gets the
        client's prompt and waits on ``disagg_request_id`` at the CTX that ``ctx_info`` (that CTX's
        ``/server_info`` ``disaggregated_params``) names, since no CTX answer exists yet when it is sent;
        ``lifecycle``: v1's identity, control endpoint, advertisement and admitted GEN endpoint, on both legs."""
        if "messages" not in body and "prompt" not in body:
            raise UnsupportedParameterError("TensorRT-LLM workers serve only chat and completions "
                                            "disaggregated, not /v1/responses", param="input")
        conversation = conversation_id if conversation_id is not None else body_conversation_id(body)
        common = {"disagg_request_id": disagg_request_id, "schedule_style": GENERATION_FIRST,
                  "conversation_id": conversation, **(lifecycle or {})}
        ctx_body = dict(body)  # shallow: the prompt itself is not copied
        ctx_body["disaggregated_params"] = {"request_type": "context_only", **common}
        ctx_body["stream"] = False
        ctx_body["stream_options"] = None
        gen_params: dict[str, Any] = {"request_type": "generation_only", "ctx_request_id": disagg_request_id,
                                      **common}
        info = ctx_info or {}
        endpoint = info.get("ctx_info_endpoint")
        if isinstance(endpoint, list):  # a list in /server_info, one string in the request
            endpoint = endpoint[0] if endpoint else None
        if isinstance(endpoint, str):
            gen_params["ctx_info_endpoint"] = endpoint
        if isinstance(info.get("ctx_dp_rank"), int):
            gen_params["ctx_dp_rank"] = info["ctx_dp_rank"]
        gen_body = dict(body)
        gen_body["disaggregated_params"] = gen_params
        return encode(ctx_body), encode(gen_body)

    def handoff_lost(self, reply: Reply) -> bool:
        return False  # a trtllm-serve GEN has no answer that says so: its failure is an ordinary error

    def release_request(self, ctx: ContextAnswer) -> tuple[str, bytes] | None:
        return None  # no early release in protocol v0: the CTX worker frees the KV on its own timeout


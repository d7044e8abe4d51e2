"""This project's own CTX/GEN wire: TensorRT-LLM's field names, ``disaggregated_params`` as the hand-off.

CTX gets the client's body with ``stream: false`` and ``disaggregated_params: {request_type: context_only, ...}``;
it answers with the first token, ``disaggregated_params`` (in ``choices[0]``, or at the top level for
``/v1/responses``) and, when asked, ``prompt_token_ids_b64``. GEN gets the client's body, the hand-off marked
``generation_only``, and the prompt as the flow chose to carry it. A CTX answer without
``encoded_opaque_state`` is one CTX finished by itself.
"""

from __future__ import annotations

import secrets
from typing import Any

import orjson

from frontend.errors import UpstreamError
from orchestrator.b64_splice import FIELD as B64_FIELD
from orchestrator.b64_splice import encode_with_b64, parse_with_b64_span
from orchestrator.client_body import encode
from orchestrator.protocols.base import ContextAnswer, PromptCarriage, without_handoff_fields
from orchestrator.upstream.base import Body, Reply

# Metadata-only GEN bodies carry no token ids; and no prompt text when GEN reads the prompt from the hand-off.
TOKEN_FIELDS = ("prompt_token_ids", "prompt_token_ids_b64")
PROMPT_TEXT_FIELDS = ("messages", "prompt", "input", "instructions")
PROMPT_FIELDS = (*TOKEN_FIELDS, *PROMPT_TEXT_FIELDS)

RELEASE_PATH = "/v1/disagg/release"


class NativeProtocol:
    def context_request(self, body: dict[str, Any], *, return_prompt_tokens: bool,
                        conversation_id: str | None = None) -> Body:
        ctx_body = dict(body)  # shallow: the prompt itself is not copied
        if body.get("stream") is True:
            # CTX answers whole whatever the client asked; stream_options belong to the client's stream. A
            # non-streaming client's stream_options are left for CTX to refuse.
            ctx_body.pop("stream_options", None)
        ctx_body["stream"] = False
        ctx_body["disaggregated_params"] = {
            "request_type": "context_only",
            "disagg_request_id": secrets.randbits(63),  # not guessable, as in protocols/trtllm.py
            "return_prompt_token_ids_b64": return_prompt_tokens,
            "native_extensions": True,  # our workers then answer with our own fields (prompt_len, ...)
        }
        return encode(ctx_body)

    def read_context_answer(self, content: bytes) -> ContextAnswer:
        try:
            response, span = parse_with_b64_span(content)  # the b64 prompt, if any, is cut out unparsed
            params = response["choices"][0]["disaggregated_params"] if "choices" in response \
                else response["disaggregated_params"]
        except (orjson.JSONDecodeError, KeyError, IndexError, TypeError) as exc:
            raise UpstreamError("the CTX step failed: its answer has no disaggregated_params") from exc
        if not isinstance(params, dict):
            raise UpstreamError("the CTX step failed: its disaggregated_params is not an object")
        prompt_len, encoded = params.get("prompt_len"), span or response.get(B64_FIELD)
        return ContextAnswer(
            response=response,
            handoff=params,
            finished=params.get("encoded_opaque_state") is None,
            prompt_len=prompt_len if isinstance(prompt_len, int) else None,
            prompt_b64=encoded if isinstance(encoded, str | memoryview) else None,
        )

    def finished_response(self, ctx: ContextAnswer) -> dict[str, Any]:
        return without_handoff_fields(ctx.response)

    def generation_request(self, body: dict[str, Any], ctx: ContextAnswer, carriage: PromptCarriage, *,
                           conversation_id: str | None = None) -> Body:
        gen_body = dict(body)  # shallow: the prompt itself is not copied
        params = dict(ctx.handoff)
        params["request_type"] = "generation_only"
        gen_body["disaggregated_params"] = params
        if carriage is PromptCarriage.CTX_TOKENS:
            for name in PROMPT_TEXT_FIELDS:  # GEN takes the array path and never reads the text
                gen_body.pop(name, None)
            _repeat_instructions(body, gen_body)
            if ctx.prompt_b64 is not None:
                return encode_with_b64(gen_body, ctx.prompt_b64)  # CTX's very bytes (or str), never decoded
        elif carriage is PromptCarriage.LENGTH_ONLY or carriage is PromptCarriage.NOTHING:
            # Only prompt_len travels. If GEN's hand-off carries the real tokens, the prompt text need not travel
            # either: the body stops growing with the prompt.
            for name in TOKEN_FIELDS if carriage is PromptCarriage.LENGTH_ONLY else PROMPT_FIELDS:
                gen_body.pop(name, None)
            _repeat_instructions(body, gen_body)
        elif "prompt_token_ids" not in body:
            params.pop("prompt_len", None)  # no tokens travel: GEN tokenizes the text itself (the baseline)
        return encode(gen_body)

    def handoff_lost(self, reply: Reply) -> bool:
        if reply.status_code != 400:
            return False
        try:
            return bool(orjson.loads(reply.content)["error"]["code"] == "invalid_handoff")
        except (orjson.JSONDecodeError, KeyError, TypeError):
            return False

    def release_request(self, ctx: ContextAnswer) -> tuple[str, bytes] | None:
        state, ctx_id = ctx.handoff.get("encoded_opaque_state"), ctx.handoff.get("ctx_request_id")
        if not isinstance(state, str) or ctx_id is None:
            return None
        return RELEASE_PATH, orjson.dumps({"ctx_request_id": str(ctx_id), "encoded_opaque_state": state})


def _repeat_instructions(body: dict[str, Any], gen_body: dict[str, Any]) -> None:
    """A Response object repeats the request's instructions, and GEN writes it: it gets them to repeat, never to
    read as prompt (the prompt travels as tokens or as its length)."""
    if "instructions" in body:
        gen_body["instructions"] = body["instructions"]

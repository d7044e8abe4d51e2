"""vLLM's P/D wire: the orchestrator in front of plain vLLM OpenAI servers started with ``--kv-transfer-config``.

The prefill (P) server gets the client's body as a whole request with ``max_tokens`` 1 and ``kv_transfer_params``
asking it to keep the KV for a remote decode (NixlConnector's field names; other connectors ignore them). P
answers an ordinary completion plus ``kv_transfer_params`` (for Nixl: where the blocks are); the decode (D)
server gets the client's body again with exactly those ``kv_transfer_params``, loads the KV through its connector
and answers the client's whole output, first token included (it recomputes the first token from the loaded KV,
as vLLM's own proxy has it do). The prompt travels as the client sent it: vLLM servers take no b64 token ids.

This is a ``WorkerProtocol`` on its own: a worker whose ``/v1/models`` card says ``owned_by: vllm`` is detected as
speaking it (``orchestrator.protocols.registry``), or the config names it for both groups (``protocol: vllm``).
"""

from __future__ import annotations

from typing import Any

import orjson

from frontend.errors import UpstreamError
from orchestrator.client_body import encode
from orchestrator.protocols.base import ContextAnswer, PromptCarriage
from orchestrator.upstream.base import Body, Reply

# What P is asked for: keep the prompt's KV for a decode elsewhere. NixlConnector reads every one of these names;
# ExampleConnector saves the KV to its shared folder whatever they say.
PREFILL_KV_TRANSFER_PARAMS: dict[str, Any] = {
    "do_remote_decode": True,
    "do_remote_prefill": False,
    "remote_engine_id": None,
    "remote_block_ids": None,
    "remote_host": None,
    "remote_port": None,
}
# P finishing on "length" means only that it hit our one-token cap: D continues. Any other reason (EOS, a stop
# string) finished the request at P.
_CONTINUE_REASONS = ("length",)


class VllmProtocol:
    def context_request(self, body: dict[str, Any], *, return_prompt_tokens: bool,
                        conversation_id: str | None = None) -> Body:
        # return_prompt_tokens is not asked of P: a vLLM server has no b64 token ids to give.
        p_body = dict(body)  # shallow: the prompt itself is not copied
        p_body.pop("stream_options", None)
        p_body["stream"] = False
        p_body["max_tokens"] = 1
        if "max_completion_tokens" in p_body:
            p_body["max_completion_tokens"] = 1
        p_body["kv_transfer_params"] = dict(PREFILL_KV_TRANSFER_PARAMS)
        return encode(p_body)

    def read_context_answer(self, content: bytes) -> ContextAnswer:
        try:
            response = orjson.loads(content)
            finish = response["choices"][0]["finish_reason"]
        except (orjson.JSONDecodeError, KeyError, IndexError, TypeError) as exc:
            raise UpstreamError("the prefill step failed: its answer is not a completion") from exc
        params = response.get("kv_transfer_params")
        if params is not None and not isinstance(params, dict):
            raise UpstreamError("the prefill step failed: its kv_transfer_params is not an object")
        usage = response.get("usage")
        prompt_len = usage.get("prompt_tokens") if isinstance(usage, dict) else None
        return ContextAnswer(
            response=response,
            handoff=params or {},
            finished=finish not in _CONTINUE_REASONS,
            prompt_len=prompt_len if isinstance(prompt_len, int) else None,
            prompt_b64=None,
        )

    def finished_response(self, ctx: ContextAnswer) -> dict[str, Any]:
        response = ctx.response
        response.pop("kv_transfer_params", None)
        return response

    def generation_request(self, body: dict[str, Any], ctx: ContextAnswer, carriage: PromptCarriage, *,
                           conversation_id: str | None = None) -> Body:
        if carriage is not PromptCarriage.CLIENT_PROMPT:
            # P gave no token ids (prompt_b64 is None), so the flow only asks for these in metadata-only mode,
            # which the config refuses for vLLM groups; fail loudly rather than send D a body without a prompt.
            raise UpstreamError(f"the vLLM protocol cannot carry the prompt as {carriage.value}")
        d_body = dict(body)
        # D fetches what P answered; without an answer (a connector that returns none) it is still told that the
        # prefill happened elsewhere.
        d_body["kv_transfer_params"] = ctx.handoff or {**PREFILL_KV_TRANSFER_PARAMS, "do_remote_decode": False,
                                                       "do_remote_prefill": True}
        return encode(d_body)

    def handoff_lost(self, reply: Reply) -> bool:
        return False  # a D that cannot load the KV recomputes it (or fails the request): P is never asked again

    def release_request(self, ctx: ContextAnswer) -> tuple[str, bytes] | None:
        return None  # vLLM frees P's KV itself when its connector's time-out passes

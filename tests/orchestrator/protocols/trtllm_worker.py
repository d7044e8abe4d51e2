"""A strict stand-in for a ``trtllm-serve`` CTX or GEN worker (a TensorRT-LLM worker cannot run here).

It checks every body against TensorRT-LLM's strict request models (``tests.trtllm_wire``) and answers 400 in
TensorRT-LLM's error shape where TensorRT-LLM would refuse, and it answers only through TensorRT-LLM's strict
response models, so it fails where the real worker would. Its model card is what an unmodified ``trtllm-serve``
answers (``owned_by: tensorrt_llm``, no ``engine_info``), so our orchestrator must detect the protocol itself.

Deterministic: the "tokens" of a prompt are its UTF-8 bytes; CTX's first token is ``FIRST``; GEN appends ``REST``.
CTX finishes the request by itself (``finish_reason: "stop"``) when the client asked for one token.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import orjson
import pybase64
from pydantic import ValidationError
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.routing import Route

from tests.trtllm_wire import DisaggregatedParams, request_model, response_model

MODEL = "trtllm-model"
FIRST, REST = "Hello", " from TensorRT-LLM"


@dataclass
class TrtllmWorker:
    role: str  # "ctx" or "gen"
    bodies: list[bytes] = field(default_factory=list)  # every generation body, as received
    refused: list[str] = field(default_factory=list)  # why each refused body would fail at TensorRT-LLM
    fail_next: int = 0  # answer this many generation requests 503, as a worker that lost its engine for a moment
    _ids: itertools.count[int] = field(default_factory=lambda: itertools.count(1000))

    def app(self) -> Starlette:
        return Starlette(routes=[
            Route("/health", lambda _: Response(status_code=200)),
            Route("/v1/models", lambda _: JSONResponse({"object": "list", "data": [
                {"id": MODEL, "object": "model", "created": 0, "owned_by": "tensorrt_llm"}]})),
            Route("/v1/chat/completions", self._generate, methods=["POST"]),
            Route("/v1/completions", self._generate, methods=["POST"]),
        ])

    async def _generate(self, request: Request) -> Response:
        raw = await request.body()
        self.bodies.append(raw)
        if self.fail_next > 0:
            self.fail_next -= 1
            return JSONResponse({"object": "error", "message": "engine unavailable", "type": "ServiceUnavailable",
                                 "param": None, "code": 503}, status_code=503)
        path = request.url.path
        try:
            body = request_model(path).model_validate_json(raw)
        except ValidationError as exc:
            return self._refuse(str(exc))
        params = body.disaggregated_params
        expected = "context_only" if self.role == "ctx" else "generation_only"
        if params is None or params.request_type != expected:
            return self._refuse(f"a {self.role} worker got {params}")
        if self.role == "ctx":
            if body.stream:
                return self._refuse("a context_only request must not stream")
            return JSONResponse(self._context_answer(path, body.model_dump(exclude_unset=True), params))
        if not isinstance(params.ctx_request_id, int) or params.encoded_opaque_state is None:
            return self._refuse(f"generation_only without a hand-off: {params}")
        text = FIRST + REST
        if body.stream:
            return StreamingResponse(_stream(path, text), media_type="text/event-stream")
        return JSONResponse(_answer(path, text, "length", 2, {}))

    def _context_answer(self, path: str, body: dict[str, Any], params: DisaggregatedParams) -> dict[str, Any]:
        prompt = _prompt_text(body)
        tokens = list(prompt.encode())
        finished = body.get("max_tokens") == 1
        handoff = {"request_type": "context_only", "first_gen_tokens": [72], "ctx_request_id": next(self._ids),
                   "encoded_opaque_state": None if finished else pybase64.b64encode(b"kv-handle").decode(),
                   "disagg_request_id": params.disagg_request_id}
        extra: dict[str, Any] = {}
        if not finished:
            if params.return_prompt_token_ids_b64 and path.endswith("/chat/completions"):
                extra["prompt_token_ids_b64"] = pybase64.b64encode(np.asarray(tokens, "<i4").tobytes()).decode()
            else:
                extra["prompt_token_ids"] = tokens
        answer = _answer(path, FIRST, "stop" if finished else "length", len(tokens), extra)
        answer["choices"][0]["disaggregated_params"] = handoff
        return response_model(path).model_validate(answer).model_dump(exclude_unset=True)

    def _refuse(self, why: str) -> Response:
        self.refused.append(why)
        return JSONResponse({"object": "error", "message": why, "type": "BadRequestError", "param": None,
                             "code": 400}, status_code=400)


def _prompt_text(body: dict[str, Any]) -> str:
    if "messages" in body:
        return "".join(str(m.get("content")) for m in body["messages"])
    return str(body["prompt"])


def _answer(path: str, text: str, finish: str, prompt_tokens: int, extra: dict[str, Any]) -> dict[str, Any]:
    chat = path.endswith("/chat/completions")
    choice: dict[str, Any] = {"index": 0, "finish_reason": finish}
    choice.update({"message": {"role": "assistant", "content": text}} if chat else {"text": text})
    completion_tokens = 1 if text == FIRST else 2
    answer = {"id": "chatcmpl-1" if chat else "cmpl-1", "object": "chat.completion" if chat else "text_completion",
              "created": 0, "model": MODEL, "choices": [choice],
              "usage": {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
                        "total_tokens": prompt_tokens + completion_tokens}, **extra}
    response_model(path).model_validate(answer)  # only what TensorRT-LLM's models allow
    return answer


async def _stream(path: str, text: str) -> Any:
    chat = path.endswith("/chat/completions")
    for piece, finish in ((FIRST, None), (REST, "length")):
        choice: dict[str, Any] = {"index": 0, "finish_reason": finish}
        choice.update({"delta": {"content": piece}} if chat else {"text": piece})
        chunk = {"id": "c", "object": "chat.completion.chunk" if chat else "text_completion", "created": 0,
                 "model": MODEL, "choices": [choice]}
        yield b"data: " + orjson.dumps(chunk) + b"\n\n"
    yield b"data: [DONE]\n\n"

"""A strict stand-in for a ``trtllm-serve`` CTX or GEN worker (a TensorRT-LLM worker cannot run here).

It checks every body against TensorRT-LLM's strict request models (``tests.trtllm_wire``) and answers 400 in
TensorRT-LLM's error shape where TensorRT-LLM would refuse, and it answers only through TensorRT-LLM's strict
response models, so it fails where the real worker would. Its model card is what an unmodified ``trtllm-serve``
answers (``owned_by: tensorrt_llm``, no ``engine_info``), so our orchestrator must detect the protocol itself.

Deterministic: the "tokens" of a prompt are its UTF-8 bytes; CTX's first token is ``FIRST``; GEN appends ``REST``.
CTX finishes the request by itself (``finish_reason: "stop"``) when the client asked for one token.

With ``lifecycle_v1`` it is a lifecycle-v1 worker (``TRTLLM_DISAGG_LIFECYCLE_PROTOCOL_VERSION=1``): it advertises
its ``context_transceiver_lifecycle`` in ``GET /server_info``, serves its role's control routes with bodies checked
by the shared strict models (``frontend.trtllm.lifecycle``; 400 ``{"error": ...}`` for a bad body, 409 for a
conflict, 404 with v1 off, as trtllm-serve answers), refuses a cross-side request without an identity (and a v0
worker one with), grants by ``consumer_grant_id`` (a replay returns the same grant), and records every control
call in ``calls``. Scripted faults: refused grants, a grant whose answer is lost (made, then 503) or held, refused
renewals, a CTX answer held, a GEN stream held after its first piece, a CTX echo that changes a field.
"""

from __future__ import annotations

import asyncio
import itertools
import uuid
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

from frontend.trtllm.identity import IDENTITY_FIELDS, LIFECYCLE_FIELDS, has_identity
from frontend.trtllm.lifecycle import (
    CONTEXT_ARTIFACT_ABORT_PATH,
    CONTROL_UNAVAILABLE,
    GENERATION_GRANT_ABORT_PATH,
    GENERATION_GRANT_PATH,
    GENERATION_GRANT_RENEW_PATH,
    PROTOCOL_V1_REQUIRED_CAPABILITIES,
    ContextArtifactAbortRequest,
    GenerationGrantAbortRequest,
    GenerationGrantDecisionResponse,
    GenerationGrantRenewRequest,
    GenerationGrantRequest,
    LifecycleNegotiationError,
    ObligationResponse,
    make_advertisement,
    negotiate,
)
from tests.trtllm_wire import DisaggregatedParams, request_model, response_model

MODEL = "trtllm-model"
FIRST, REST = "Hello", " from TensorRT-LLM"


@dataclass
class TrtllmWorker:
    role: str  # "ctx" or "gen"
    bodies: list[bytes] = field(default_factory=list)  # every generation body, as received
    refused: list[str] = field(default_factory=list)  # why each refused body would fail at TensorRT-LLM
    fail_next: int = 0  # answer this many generation requests 503, as a worker that lost its engine for a moment
    lifecycle_v1: bool = False
    generation_first: bool = True  # with v1: advertise GENERATION_FIRST
    grant_ttl_s: float = 600.0  # the worker's own TTL: what a grant and a renewal answer
    refuse_grants: int = 0  # answer this many grant requests accepted: false
    lose_grant_answers: int = 0  # make this many grants, then answer 503 (the answer lost: the admission ambiguous)
    hold_grant_answers: int = 0  # make this many grants, then hold each answer until ``release_streams``
    refuse_renewals: bool = False  # answer renewals accepted: false, REVOKED
    corrupt_echo: bool = False  # CTX echoes a different prefill_artifact_id
    fail_server_info: int = 0  # answer this many GET /server_info 503 (a worker still starting, say)
    hold_context: bool = False  # CTX holds its answer until ``release_streams``
    hold_streams: bool = False  # GEN's stream stops after its first piece until ``release`` is set
    hold_end: bool = False  # GEN's stream stays open after ``[DONE]`` (its body not ended) until ``release`` is set
    release_early_s: float = 0.0  # GEN finishes (releases its grant) this long before its answer's rest arrives
    calls: list[tuple[str, dict[str, Any]]] = field(default_factory=list)  # every control call: (path, body)
    order: list[str] = field(default_factory=list)  # "<role> <path>" of each call; one list may serve a fleet
    grants: dict[str, str] = field(default_factory=dict)  # consumer_grant_id -> ACTIVE / REVOKED / RELEASED
    instance_id: str = field(default_factory=lambda: str(uuid.uuid4()))
    _release: asyncio.Event | None = None  # set by the test (from its thread, through ``release_streams``)
    _released: bool = False
    _loop: asyncio.AbstractEventLoop | None = None
    _ids: itertools.count[int] = field(default_factory=lambda: itertools.count(1000))

    @property
    def advertisement(self) -> dict[str, Any] | None:
        if not self.lifecycle_v1:
            return None
        capabilities = set(PROTOCOL_V1_REQUIRED_CAPABILITIES) | {"DIRECT_TRANSFER"}
        if self.generation_first:
            capabilities.add("GENERATION_FIRST")
        return make_advertisement(protocol_version=1, capabilities=capabilities,
                                  instance_id=self.instance_id).to_dict()

    def app(self) -> Starlette:
        routes = [
            Route("/health", lambda _: Response(status_code=200)),
            Route("/v1/models", lambda _: JSONResponse({"object": "list", "data": [
                {"id": MODEL, "object": "model", "created": 0, "owned_by": "tensorrt_llm"}]})),
            Route("/server_info", self._server_info),
            Route("/v1/chat/completions", self._generate, methods=["POST"]),
            Route("/v1/completions", self._generate, methods=["POST"]),
        ]
        # Registered by role whether or not v1 is on, as trtllm-serve does (404 without the control).
        if self.role == "gen":
            routes += [Route(GENERATION_GRANT_PATH, self._grant, methods=["POST"]),
                       Route(GENERATION_GRANT_RENEW_PATH, self._renew, methods=["POST"]),
                       Route(GENERATION_GRANT_ABORT_PATH, self._abort_grant, methods=["POST"])]
        else:
            routes.append(Route(CONTEXT_ARTIFACT_ABORT_PATH, self._abort_artifact, methods=["POST"]))
        return Starlette(routes=routes)

    def release_streams(self) -> None:
        """Let held streams go on (from the test's thread)."""
        self._released = True
        if self._loop is not None and self._release is not None:
            self._loop.call_soon_threadsafe(self._release.set)

    async def _held(self) -> None:
        if self._release is None:
            self._release = asyncio.Event()
            self._loop = asyncio.get_running_loop()
        if self._released:
            self._release.set()
        await self._release.wait()

    def control_paths(self) -> list[str]:
        return [path for path, _ in self.calls]

    async def _server_info(self, _: Request) -> Response:
        if self.fail_server_info > 0:
            self.fail_server_info -= 1
            return JSONResponse({"detail": "not ready"}, status_code=503)
        params: dict[str, Any] = {"ctx_dp_rank": 0, "ctx_info_endpoint": ["tcp://context:9000"]}
        if self.advertisement is not None:
            params["context_transceiver_lifecycle"] = self.advertisement
        return JSONResponse({"disaggregated_params": params, "max_batch_size": 8})

    # -- the control routes ---------------------------------------------------------------------------------
    async def _control(self, request: Request, model: type[Any]) -> Any:
        if not self.lifecycle_v1:
            return JSONResponse({"detail": CONTROL_UNAVAILABLE}, status_code=404)
        raw = await request.body()
        try:
            body = model.model_validate_json(raw)
        except ValidationError as exc:
            self.refused.append(str(exc))
            return JSONResponse({"error": str(exc)}, status_code=400)
        self.calls.append((request.url.path, orjson.loads(raw)))
        self.order.append(f"{self.role} {request.url.path}")
        return body

    def _endpoint(self) -> dict[str, Any]:
        return {"generation_endpoint_name": "gen-mock", "generation_endpoint_rank": 0,
                "generation_endpoint_incarnation": self.instance_id}

    async def _grant(self, request: Request) -> Response:
        body = await self._control(request, GenerationGrantRequest)
        if isinstance(body, Response):
            return body
        grant = str(body.consumer_grant_id)
        if self.refuse_grants > 0 and grant not in self.grants:
            self.refuse_grants -= 1
            return _decision(accepted=False, reason="generation admission credit is exhausted")
        try:
            assert self.advertisement is not None
            negotiate(body.context_transceiver_lifecycle, self.advertisement, schedule_style=body.schedule_style)
        except LifecycleNegotiationError as exc:
            return _decision(accepted=False, reason=str(exc))
        if self.grants.get(grant, "ACTIVE") != "ACTIVE":
            return _decision(accepted=False, reason="generation grant is already terminal")
        self.grants[grant] = "ACTIVE"  # a replay of one consumer_grant_id is the same grant
        if self.hold_grant_answers > 0:
            self.hold_grant_answers -= 1
            await self._held()
        if self.lose_grant_answers > 0:
            self.lose_grant_answers -= 1
            return Response(status_code=503)
        return _decision(accepted=True, **self._endpoint(), generation_transceiver_lifecycle=self.advertisement,
                         ttl_s=self.grant_ttl_s)

    def _known(self, body: Any) -> Response | None:
        grant = str(body.consumer_grant_id)
        if grant not in self.grants:
            return JSONResponse({"detail": f"generation grant {grant} has no admitted transfer session"},
                                status_code=409)
        if {k: str(v) if k.endswith("incarnation") else v for k, v in body.model_dump(
                include=set(self._endpoint())).items()} != self._endpoint():
            return JSONResponse({"detail": "generation endpoint identity mismatch"}, status_code=409)
        return None

    async def _renew(self, request: Request) -> Response:
        body = await self._control(request, GenerationGrantRenewRequest)
        if isinstance(body, Response):
            return body
        if (conflict := self._known(body)) is not None:
            return conflict
        state = self.grants[str(body.consumer_grant_id)]
        if state == "RELEASED":  # GEN finished the request: nothing left to renew
            return _obligation(accepted=False, state="RELEASED", reason="generation grant was already released")
        if self.refuse_renewals or state != "ACTIVE":
            self.grants[str(body.consumer_grant_id)] = "REVOKED"
            return _obligation(accepted=False, state="REVOKED", reason="generation intent grant expired")
        return _obligation(accepted=True, state="ACTIVE", ttl_s=self.grant_ttl_s)

    async def _abort_grant(self, request: Request) -> Response:
        body = await self._control(request, GenerationGrantAbortRequest)
        if isinstance(body, Response):
            return body
        if (conflict := self._known(body)) is not None:
            return conflict
        if self.grants[str(body.consumer_grant_id)] == "RELEASED":
            return JSONResponse({"detail": "cannot revoke a grant that was already released"}, status_code=409)
        self.grants[str(body.consumer_grant_id)] = "REVOKED"
        return _obligation(accepted=True, state="REVOKED")

    async def _abort_artifact(self, request: Request) -> Response:
        body = await self._control(request, ContextArtifactAbortRequest)
        if isinstance(body, Response):
            return body
        if str(body.context_endpoint_incarnation) != self.instance_id:
            return JSONResponse({"detail": "context artifact abort targets a stale endpoint incarnation"},
                                status_code=409)
        return _obligation(accepted=True, state="ABANDONED", reason=body.reason,
                           context_endpoint_incarnation=self.instance_id)

    def _lifecycle_refusal(self, params: DisaggregatedParams) -> str | None:
        """TensorRT-LLM's ``_validate_disagg_before_submit`` for this worker's mode."""
        fields = params.model_dump()
        if not self.lifecycle_v1:
            return ("disaggregated endpoint does not advertise a transceiver lifecycle contract"
                    if has_identity(fields) else None)
        if not all(fields.get(name) is not None for name in IDENTITY_FIELDS):
            return "protocol-v1 cross-side request is missing its negotiated attempt identity"
        if params.context_control_endpoint is None:
            return "protocol-v1 cross-side request is missing the selected context lifecycle-control endpoint"
        advertised = params.context_transceiver_lifecycle
        if advertised is None:
            return "protocol-v1 cross-side request is missing the selected context transceiver lifecycle"
        if self.role == "ctx" and advertised.to_dict() != self.advertisement:
            return "selected context transceiver lifecycle does not match the current context endpoint incarnation"
        if self.role == "gen":
            grant = self.grants.get(str(params.consumer_grant_id))
            if grant != "ACTIVE":
                return f"generation grant {params.consumer_grant_id} is not active ({grant})"
            if params.generation_endpoint_incarnation != self.instance_id:
                return "generation endpoint identity does not match this endpoint"
        return None

    async def _generate(self, request: Request) -> Response:
        raw = await request.body()
        self.bodies.append(raw)
        self.order.append(f"{self.role} {request.url.path}")
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
        if (why := self._lifecycle_refusal(params)) is not None:
            return self._refuse(why)
        if self.role == "ctx":
            if body.stream:
                return self._refuse("a context_only request must not stream")
            if self.hold_context:
                await self._held()
            return JSONResponse(self._context_answer(path, body.model_dump(exclude_unset=True), params))
        if params.schedule_style == 1:
            # Generation first: no CTX answer exists yet; GEN finds its CTX by endpoint and request id.
            if params.ctx_info_endpoint is None or params.ctx_request_id != params.disagg_request_id:
                return self._refuse(f"generation-first generation_only without its CTX: {params}")
        elif not isinstance(params.ctx_request_id, int) or params.encoded_opaque_state is None:
            return self._refuse(f"generation_only without a hand-off: {params}")
        text = FIRST + REST
        grant = str(params.consumer_grant_id) if self.lifecycle_v1 else None
        if body.stream:
            return StreamingResponse(self._stream(path, grant), media_type="text/event-stream")
        self._finished(grant)
        await asyncio.sleep(self.release_early_s)
        return JSONResponse(_answer(path, text, "length", 2, {}))

    def _finished(self, grant: str | None) -> None:
        if grant is not None and self.grants.get(grant) == "ACTIVE":
            self.grants[grant] = "RELEASED"  # GEN releases its grant when the request finishes (handoff committed)

    async def _stream(self, path: str, grant: str | None) -> Any:
        chat = path.endswith("/chat/completions")
        for piece, finish in ((FIRST, None), (REST, "length")):
            choice: dict[str, Any] = {"index": 0, "finish_reason": finish}
            choice.update({"delta": {"content": piece}} if chat else {"text": piece})
            chunk = {"id": "c", "object": "chat.completion.chunk" if chat else "text_completion", "created": 0,
                     "model": MODEL, "choices": [choice]}
            yield b"data: " + orjson.dumps(chunk) + b"\n\n"
            if self.release_early_s and finish is None:
                self._finished(grant)  # done on GEN's side; what is left of its answer is still on the way
                await asyncio.sleep(self.release_early_s)
            if self.hold_streams and finish is None:
                await self._held()
                if grant is not None and self.grants.get(grant) != "ACTIVE":
                    return  # the grant was aborted or revoked: GEN aborts the request, the stream just ends
        self._finished(grant)
        yield b"data: [DONE]\n\n"
        if self.hold_end:
            await self._held()

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
        if self.lifecycle_v1:  # the echo: every lifecycle field as sent
            sent = params.model_dump(mode="json")
            handoff.update({name: sent[name] for name in LIFECYCLE_FIELDS if sent.get(name) is not None})
            handoff["schedule_style"] = params.schedule_style
            if self.corrupt_echo:
                handoff["prefill_artifact_id"] = str(uuid.uuid4())
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



def _decision(**fields: Any) -> Response:
    answer = GenerationGrantDecisionResponse.model_validate({"lifecycle_protocol_version": 1, **fields})
    return JSONResponse(answer.model_dump(mode="json"))


def _obligation(**fields: Any) -> Response:
    answer = ObligationResponse.model_validate({"lifecycle_protocol_version": 1, **fields})
    return JSONResponse(answer.model_dump(mode="json"))

"""The worker's routes for TensorRT-LLM's lifecycle protocol v1 (``workers.trtllm.lifecycle``): the server info its
router reads first, the control calls (grants on GEN, artifact aborts on CTX), and CTX's generation-first hand-off.

Every ``/_internal/*`` route here answers internal callers only (``workers.internal_callers``), checked before
anything else; ``/server_info`` stays open (TensorRT-LLM's router reads it), and names this worker by its advertised
address, never by the caller's ``Host`` header.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from typing import Any, TypeVar

from fastapi import FastAPI, Request
from pydantic import BaseModel, ValidationError
from starlette.responses import Response

from frontend.errors import InvalidRequestError
from frontend.http import cancel_on_disconnect, json_response, parse_json_object, read_body
from frontend.trtllm.lifecycle import (
    CONTEXT_ARTIFACT_ABORT_PATH,
    CONTROL_UNAVAILABLE,
    GENERATION_GRANT_ABORT_PATH,
    GENERATION_GRANT_PATH,
    GENERATION_GRANT_RENEW_PATH,
    SERVER_INFO_PATH,
    ContextArtifactAbortRequest,
    GenerationGrantAbortRequest,
    GenerationGrantRenewRequest,
    GenerationGrantRequest,
)
from workers.internal_callers import InternalCallers, refused
from workers.settings import WorkerSettings
from workers.trtllm.entries import LifecycleConflict
from workers.trtllm.generation_first import CLAIM_HEADER, HANDOFF_PATH, HandoffBoard
from workers.trtllm.lifecycle import LifecycleControl

Body = TypeVar("Body", bound=BaseModel)  # a lifecycle control call's body model


def install_lifecycle_routes(app: FastAPI, settings: WorkerSettings, control: LifecycleControl,
                             board: HandoffBoard) -> None:
    """The routes this worker's role answers (the control calls answer 404 while v1 is off)."""
    callers = InternalCallers(settings.internal_secret, settings.trtllm_auth_key)

    def own_url(request: Request) -> str:
        """This worker's address as its peers reach it: the advertised one, else the local address the connection
        came in on (the socket's, not the ``Host`` header a caller chose)."""
        if settings.advertise_url:
            return settings.advertise_url.rstrip("/")
        server = request.scope.get("server")
        if not server or server[1] is None:
            return str(request.base_url).rstrip("/")  # a transport without an address (in-process tests)
        host, port = server
        return f"http://[{host}]:{port}" if ":" in str(host) else f"http://{host}:{port}"

    @app.get(SERVER_INFO_PATH)
    async def server_info(request: Request) -> Response:
        """What TensorRT-LLM's router reads of a worker before sending it anything: where CTX's hand-offs are
        asked for (generation first) and, in v1 only, the lifecycle advertisement."""
        params: dict[str, Any] = {"ctx_dp_rank": 0, "ctx_info_endpoint": [own_url(request)]}
        if control.advertisement is not None:
            params["context_transceiver_lifecycle"] = control.advertisement.to_dict()
        return json_response({"disaggregated_params": params,
                              "max_batch_size": settings.lifecycle.max_live_grants})

    def control_route(path: str, model: type[Body], call: Callable[[Body, Request], Awaitable[Any]]) -> None:
        """A control call's route: its body read as ``model`` (TensorRT-LLM's 400 ``{"error": ...}`` for a bad
        one, its 404 with v1 off), ``call``'s answer as JSON, a ``LifecycleConflict`` its 409."""
        async def route(request: Request) -> Response:
            allowed = callers.control_allowed_before_body(request.headers)
            if allowed is False:
                raise refused("a lifecycle control call")
            if not control.enabled:
                return json_response({"detail": CONTROL_UNAVAILABLE}, status_code=404)
            try:
                body = model.model_validate(parse_json_object(await read_body(request, 64 * 1024)))
            except (ValidationError, InvalidRequestError) as error:
                if allowed is None:  # an unproven caller learns nothing about what it sent
                    raise refused("a lifecycle control call") from None
                return json_response({"error": str(error)}, status_code=400)
            if allowed is None and not callers.control_signed_body(request.headers, path,
                                                                  body.model_dump(mode="json")):
                raise refused("a lifecycle control call")
            try:
                answer = await call(body, request)
            except LifecycleConflict as error:
                return json_response({"detail": str(error)}, status_code=409)
            return json_response(answer.model_dump(mode="json") if isinstance(answer, BaseModel) else answer)

        app.post(path, name=path.removeprefix("/_internal/").replace("/", "_"))(route)

    async def issue(body: GenerationGrantRequest, request: Request) -> Any:
        # An open worker caps unbound grants per peer address; an authenticated caller is one of our orchestrators.
        caller = None if not callers.open else request.client.host if request.client is not None else ""
        return control.issue(body, own_url(request).split("://", 1)[1], caller)

    async def renew(body: GenerationGrantRenewRequest, _: Request) -> Any:
        return control.renew(body)

    async def abort(body: GenerationGrantAbortRequest, _: Request) -> Any:
        return control.abort(body)

    async def abort_artifact(body: ContextArtifactAbortRequest, _: Request) -> Any:
        return await control.artifacts.abort(body)

    if settings.role == "generation":
        control_route(GENERATION_GRANT_PATH, GenerationGrantRequest, issue)
        control_route(GENERATION_GRANT_RENEW_PATH, GenerationGrantRenewRequest, renew)
        control_route(GENERATION_GRANT_ABORT_PATH, GenerationGrantAbortRequest, abort)

    if settings.role == "context":
        control_route(CONTEXT_ARTIFACT_ABORT_PATH, ContextArtifactAbortRequest, abort_artifact)

        @app.get(HANDOFF_PATH)
        async def generation_first_handoff(request: Request) -> Response:
            """Generation first: a GEN that came first asks here for the hand-off of its request; answered as
            soon as this CTX has parked it (404 if that does not happen within ``wait_s``). A GEN that hangs up
            stops waiting here too: the hand-off is then left on the board for a GEN that asks again. The id and
            the wait are read after the caller is checked: an unproven caller learns nothing of what they take."""
            callers.require_token(request.headers, "the generation-first hand-off board")
            try:
                disagg_request_id = int(request.path_params["disagg_request_id"])
                wait_s = float(request.query_params.get("wait_s", "30"))
            except ValueError:
                raise InvalidRequestError("disagg_request_id must be an integer and wait_s a number") from None
            if wait_s != wait_s:  # NaN
                wait_s = 0.0
            claim = request.headers.get(CLAIM_HEADER)
            params = await cancel_on_disconnect(
                request, lambda: board.claim(disagg_request_id, min(max(wait_s, 0.0), 300.0), claim))
            if params is None:
                return json_response({"detail": "no hand-off for this request"}, status_code=404)
            return json_response(params)

"""Who may reach a worker's internal surface (workers/internal_callers.py), against real workers on loopback: with the
deployment secret set, every ``/_internal/*`` route answers its holders only (401 in OpenAI's shape otherwise), a
request whose ``disaggregated_params`` name where the worker goes next needs it too, and the worker's own calls to
its peers carry it; with TensorRT-LLM's key set, its ``x-trtllm-disagg-auth`` signatures are what let its
orchestrator in. Issue 44, items 2 and 3: on bb7e60b every one of these routes answered anyone."""

from __future__ import annotations

import contextlib
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import httpx
import pytest
from fastapi.routing import APIRoute

from frontend.internal_secret import INTERNAL_TOKEN_HEADER, InternalSecret
from frontend.trtllm.auth import TRTLLM_AUTH_HEADER, control_signature, request_signature
from frontend.trtllm.lifecycle import (
    CONTEXT_ARTIFACT_ABORT_PATH,
    GENERATION_GRANT_ABORT_PATH,
    GENERATION_GRANT_PATH,
    GenerationGrantDecisionResponse,
    GenerationGrantRequest,
)
from tests.servers import running
from tests.waiting import eventually
from workers.engines.synthetic import SyntheticEngine
from workers.server import create_worker_app
from workers.settings import Role, WorkerSettings
from workers.trtllm.generation_first import HandoffBoard
from workers.trtllm.settings import LifecycleSettings

SECRET = InternalSecret("deployment-secret-" + "s" * 24)
TRTLLM_KEY = "trtllm-internal-request-auth-key"
LIFECYCLE = LifecycleSettings(protocol_version=1)


@dataclass
class Worker:
    url: str
    app: Any

    @property
    def netloc(self) -> str:
        return self.url.removeprefix("http://")


@dataclass
class Fleet:
    ctx: Worker  # the deployment secret only
    gen: Worker  # the deployment secret only
    trtllm_gen: Worker  # TensorRT-LLM's key only: what its orchestrator in front proves itself with
    trtllm_ctx: Worker


def _start(stack: contextlib.ExitStack, role: Role, **settings: Any) -> Worker:
    app = create_worker_app(SyntheticEngine(), WorkerSettings(role=role, lifecycle=LIFECYCLE, **settings))
    return Worker(stack.enter_context(running(app)), app)


@pytest.fixture(scope="module")
def fleet() -> Iterator[Fleet]:
    with contextlib.ExitStack() as stack:
        yield Fleet(_start(stack, "context", internal_secret=SECRET),
                    _start(stack, "generation", internal_secret=SECRET),
                    _start(stack, "generation", trtllm_auth_key=TRTLLM_KEY),
                    _start(stack, "context", trtllm_auth_key=TRTLLM_KEY))


def internal_routes(worker: Worker) -> list[tuple[str, str]]:
    """Every ``/_internal/*`` route the worker mounts (method, a path to call it by)."""
    found = []
    for route in worker.app.routes:
        if isinstance(route, APIRoute) and route.path.startswith("/_internal/"):
            for method in route.methods:
                found.append((method, route.path.replace("{disagg_request_id}", "7")))
    return found


def refused(reply: httpx.Response) -> None:
    assert reply.status_code == 401, reply.text
    error = reply.json()["error"]
    assert set(error) == {"message", "type", "param", "code"}
    assert error["type"] == "authentication_error" and error["code"] == "invalid_internal_credentials"
    assert INTERNAL_TOKEN_HEADER in error["message"]


def _grant_body(ctx: Worker) -> dict[str, Any]:
    info = httpx.get(ctx.url + "/server_info").json()["disaggregated_params"]
    return {"lifecycle_protocol_version": 1, "logical_request_id": 7, "prefill_artifact_id": str(uuid.uuid4()),
            "artifact_version": 0, "handoff_attempt_uuid": str(uuid.uuid4()), "consumer_grant_id": str(uuid.uuid4()),
            "transfer_session_id": str(uuid.uuid4()), "ttl_s": 600.0, "context_control_endpoint": ctx.netloc,
            "context_transceiver_lifecycle": info["context_transceiver_lifecycle"], "schedule_style": 0,
            "ctx_dp_rank": None}


@pytest.mark.parametrize("who", ["ctx", "gen"])
@pytest.mark.parametrize("token", [None, "wrong-token-of-enough-length", SECRET.token[:-1] + "x"],
                         ids=["none", "wrong", "one-off"])
def test_every_internal_route_refuses_a_caller_without_the_secret(fleet: Fleet, who: str,
                                                                  token: str | None) -> None:
    worker: Worker = getattr(fleet, who)
    routes = internal_routes(worker)
    assert routes  # grants on GEN; the artifact abort and the hand-off board on CTX
    headers = {INTERNAL_TOKEN_HEADER: token} if token is not None else {}
    for method, path in routes:
        refused(httpx.request(method, worker.url + path, json={}, headers=headers, params={"wait_s": 0}))


def test_a_holder_of_the_secret_gets_the_routes_answers(fleet: Fleet) -> None:
    reply = httpx.post(fleet.gen.url + GENERATION_GRANT_PATH, json=_grant_body(fleet.ctx), headers=SECRET.headers())
    assert reply.status_code == 200, reply.text
    assert GenerationGrantDecisionResponse.model_validate(reply.json()).accepted
    # A bad body from a holder gets TensorRT-LLM's own 400, as before; from anyone else only the 401.
    assert httpx.post(fleet.gen.url + GENERATION_GRANT_PATH, json={}, headers=SECRET.headers()).status_code == 400
    board = fleet.ctx.url + "/_internal/disagg/generation_first/7"
    assert httpx.get(board, params={"wait_s": 0}, headers=SECRET.headers()).status_code == 404  # nothing parked
    odd = fleet.ctx.url + "/_internal/disagg/generation_first/not-a-number"
    refused(httpx.get(odd))  # checked before what the route takes is read
    bad = httpx.get(odd, headers=SECRET.headers())
    assert bad.status_code == 400 and bad.json()["error"]["type"] == "invalid_request_error", bad.text


def test_a_request_naming_where_the_worker_goes_next_needs_the_secret(fleet: Fleet) -> None:
    """A generation-first GEN asks ``ctx_info_endpoint`` for its hand-off, with the deployment secret in hand: a
    caller without it must not be able to send it there (nor name the KV's source in ``encoded_opaque_state``)."""
    body = {"model": "synthetic", "prompt": "x", "max_tokens": 2, "disaggregated_params": {
        "request_type": "generation_only", "ctx_request_id": 1, "disagg_request_id": 1, "schedule_style": 1,
        "ctx_info_endpoint": "http://attacker.example:80"}}
    refused(httpx.post(fleet.gen.url + "/v1/completions", json=body))
    plain = {"model": "synthetic", "prompt": "x", "max_tokens": 2}  # the OpenAI routes themselves stay open
    assert httpx.post(fleet.gen.url + "/v1/completions", json=plain).status_code != 401


def test_only_a_holder_of_the_secret_posts_on_the_generation_first_board(fleet: Fleet) -> None:
    """A generation-first context_only request posts its hand-off for a GEN to take: from a caller without the
    secret it could hand the real GEN the caller's own first tokens and KV, or crowd the real ones off the board."""
    body = {"model": "synthetic", "prompt": "the attacker's prompt", "max_tokens": 2, "disaggregated_params": {
        "request_type": "context_only", "disagg_request_id": 4242, "schedule_style": 1}}
    refused(httpx.post(fleet.ctx.url + "/v1/completions", json=body))


async def test_the_first_post_of_an_id_stands_on_the_board() -> None:
    """A second request with the same id (a mistake, or a caller that learned it) does not replace the first's
    hand-off: the GEN that was promised it gets the first."""
    board = HandoffBoard(ttl_s=60.0, clock=lambda: 0.0)
    assert board.post(7, {"first_gen_tokens": [1]}, claim="attempt")
    assert not board.post(7, {"first_gen_tokens": [666]}, claim="attempt")
    assert await board.claim(7, wait_s=0.0, presented="attempt") == {"first_gen_tokens": [1]}


def test_tensorrt_llms_signature_lets_its_orchestrator_in(fleet: Fleet) -> None:
    """A worker behind TensorRT-LLM's orchestrator, with its ``internal_request_auth_key``: control calls signed over
    route and body, requests over their protected fields; a tampered or unsigned one is refused."""
    body = GenerationGrantRequest.model_validate(_grant_body(fleet.trtllm_ctx)).model_dump(mode="json")
    url = fleet.trtllm_gen.url + GENERATION_GRANT_PATH
    signature = control_signature(TRTLLM_KEY, GENERATION_GRANT_PATH, body)
    refused(httpx.post(url, json=body))
    refused(httpx.post(url, json={**body, "logical_request_id": 8}, headers={TRTLLM_AUTH_HEADER: signature}))
    refused(httpx.post(url, json=body, headers={TRTLLM_AUTH_HEADER: control_signature(
        TRTLLM_KEY, GENERATION_GRANT_ABORT_PATH, body)}))  # signed for another route
    refused(httpx.post(fleet.trtllm_ctx.url + CONTEXT_ARTIFACT_ABORT_PATH, json={}))
    reply = httpx.post(url, json=body, headers={TRTLLM_AUTH_HEADER: signature})
    assert reply.status_code == 200 and reply.json()["accepted"], reply.text

    params = {"request_type": "generation_only", "ctx_request_id": 1, "disagg_request_id": 1, "schedule_style": 1,
              "ctx_info_endpoint": "http://attacker.example:80"}
    request = {"model": "synthetic", "prompt": "x", "max_tokens": 2, "disaggregated_params": params}
    refused(httpx.post(fleet.trtllm_gen.url + "/v1/completions", json=request))
    forged = {**params, "ctx_info_endpoint": "http://elsewhere.example:80"}
    refused(httpx.post(fleet.trtllm_gen.url + "/v1/completions", json=request,
                       headers={TRTLLM_AUTH_HEADER: request_signature(TRTLLM_KEY, forged)}))
    signed = httpx.post(fleet.trtllm_gen.url + "/v1/completions", json=request,
                        headers={TRTLLM_AUTH_HEADER: request_signature(TRTLLM_KEY, params)})
    assert signed.status_code != 401, signed.text  # let in (then refused for what it is: no v1 grant)


def test_the_workers_own_calls_to_a_peer_carry_the_secret(fleet: Fleet) -> None:
    """GEN aborting a grant tells CTX to free the attempt's artifact: that call must get through CTX's guard (a
    cancel before create leaves CTX a tombstone for the attempt)."""
    body = _grant_body(fleet.ctx)
    reply = httpx.post(fleet.gen.url + GENERATION_GRANT_PATH, json=body, headers=SECRET.headers())
    decision = GenerationGrantDecisionResponse.model_validate(reply.json())
    assert decision.accepted
    identity = {name: body[name] for name in ("logical_request_id", "prefill_artifact_id", "artifact_version",
                                              "handoff_attempt_uuid", "consumer_grant_id", "transfer_session_id")}
    abort = {"lifecycle_protocol_version": 1, **identity, "reason": "client went away",
             "generation_endpoint_name": decision.generation_endpoint_name, "generation_endpoint_rank": 0,
             "generation_endpoint_incarnation": str(decision.generation_endpoint_incarnation)}
    assert httpx.post(fleet.gen.url + GENERATION_GRANT_ABORT_PATH, json=abort, headers=SECRET.headers()).json()[
        "state"] == "REVOKED"
    artifacts = fleet.ctx.app.state.service.lifecycle.artifacts.entries
    assert eventually(lambda: body["prefill_artifact_id"] in artifacts)
    assert artifacts[body["prefill_artifact_id"]].reason == "client went away"

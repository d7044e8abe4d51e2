"""Direction B under lifecycle v1: TensorRT-LLM's v1 orchestrator in front of our real workers (reference engine).

The test plays TensorRT-LLM's orchestrator run with ``TRTLLM_DISAGG_LIFECYCLE_PROTOCOL_VERSION=1``: it reads CTX's
advertisement from ``/server_info``, mints the attempt identity, sends CTX, checks the echo, asks GEN for a grant,
sends GEN under it, renews and aborts, all over real HTTP, every answer read with strict models. Time on the
workers is a fake clock the test moves; what the sweeper does then is waited for by condition.
"""

from __future__ import annotations

import contextlib
import logging
import random
import socket
import threading
import tracemalloc
import uuid
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, replace
from typing import Any
from uuid import UUID

import httpx
import msgspec
import orjson
import pytest
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import Route

from frontend.disaggregated_params import DisaggregatedParams
from frontend.errors import InvalidRequestError, OverloadedError
from frontend.trtllm.lifecycle import (
    CONTEXT_ARTIFACT_ABORT_PATH,
    GENERATION_GRANT_ABORT_PATH,
    GENERATION_GRANT_PATH,
    GENERATION_GRANT_RENEW_PATH,
    ContextArtifactAbortRequest,
    GenerationGrantAbortRequest,
    GenerationGrantDecisionResponse,
    GenerationGrantRenewRequest,
    GenerationGrantRequest,
    ObligationResponse,
    make_advertisement,
    negotiate,
)
from tests.servers import open_post, running
from tests.trtllm_wire import (
    ChatCompletionResponse,
    needs_generation,
    response_model,
    trtllm_context_body,
    trtllm_generation_body,
)
from tests.waiting import eventually, eventually_async
from tests.workers.engines.reference.ledger import ADMIN_KEY
from tests.workers.engines.reference.tiny_model import write_tiny_model
from workers.engines.reference.engine import ReferenceEngine
from workers.engines.reference.options import ReferenceOptions
from workers.engines.synthetic import SyntheticEngine
from workers.server import create_worker_app
from workers.settings import Role, WorkerSettings
from workers.trtllm.artifacts import ARTIFACT_SATURATED
from workers.trtllm.entries import MAX_REASON
from workers.trtllm.generation_first import CLAIM_HEADER, HANDOFF_PATH, pull_handoff
from workers.trtllm.lifecycle import CAPABILITIES, GRANT_HOARDED, GRANT_SATURATED, LifecycleControl
from workers.trtllm.settings import LifecycleSettings

CHAT, COMPLETIONS = "/v1/chat/completions", "/v1/completions"
GRANT_TTL_S = 30.0
MESSAGES = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "What is the capital of France?"}]


class FakeClock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


@dataclass
class Node:
    url: str
    app: Any

    @property
    def netloc(self) -> str:
        return self.url.removeprefix("http://")

    def ledger(self) -> dict[str, Any]:
        reply = httpx.get(self.url + "/v1/disagg/handoffs", headers={"Authorization": f"Bearer {ADMIN_KEY}"})
        assert reply.status_code == 200, reply.text
        return dict(reply.json())


@dataclass
class V1Cluster:
    ctx: Node
    gen: Node
    aggregated: Node  # v0: the reference answer, and a worker that refuses v1 fields
    small_gen: Node  # v1, synthetic engine, room for one live grant
    v0_gen: Node  # v0, synthetic engine: its control routes answer 404
    clock: FakeClock
    model: str


def _worker(stack: contextlib.ExitStack, engine: Any, role: Role, lifecycle: LifecycleSettings) -> Node:
    app = create_worker_app(engine, WorkerSettings(role=role, admin_key=ADMIN_KEY, lifecycle=lifecycle))
    return Node(stack.enter_context(running(app)), app)


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[V1Cluster]:
    path = str(write_tiny_model(tmp_path_factory.mktemp("tiny") / "tiny.gguf", seed=0))
    options = ReferenceOptions(model_path=path, served_model_name="tiny", blas_threads=1)
    clock = FakeClock()
    v1 = LifecycleSettings(protocol_version=1, sweep_interval_s=0.01, clock=clock)
    # GEN's grants outlive nothing of CTX's: a grant's expiry alone (30 s) frees KV that CTX's own TTL (60 s) keeps.
    with contextlib.ExitStack() as stack:
        ctx = _worker(stack, ReferenceEngine(options), "context", v1)
        gen = _worker(stack, ReferenceEngine(options), "generation", replace(v1, grant_ttl_s=GRANT_TTL_S))
        aggregated = _worker(stack, ReferenceEngine(options), "both", LifecycleSettings())
        small = _worker(stack, SyntheticEngine(), "generation",
                        LifecycleSettings(protocol_version=1, max_live_grants=1, clock=clock))
        v0_gen = _worker(stack, SyntheticEngine(), "generation", LifecycleSettings())
        yield V1Cluster(ctx, gen, aggregated, small, v0_gen, clock, "tiny")


def client_body(path: str, model: str, **extra: Any) -> dict[str, Any]:
    prompt = {"messages": MESSAGES} if path == CHAT else {"prompt": "The capital of France is"}
    return {"model": model, **prompt, "max_tokens": 8, "temperature": 0, "ignore_eos": True, **extra}


def post(url: str, body: dict[str, Any], *, msgpack: bool = False,
         headers: dict[str, str] | None = None) -> httpx.Response:
    headers = headers or {}
    if msgpack:  # TensorRT-LLM's orchestrator since #16873: every completion leg
        return httpx.post(url, content=msgspec.msgpack.encode(body), timeout=60,
                          headers={"Content-Type": "application/json", "X-TRTLLM-Msgpack": "1", **headers})
    return httpx.post(url, json=body, timeout=60, headers=headers)


def answer_text(path: str, reply: httpx.Response) -> str:
    answer = response_model(path).model_validate(reply.json())
    choice = answer.choices[0]
    return str(choice.message.content if isinstance(answer, ChatCompletionResponse) else choice.text)  # type: ignore[union-attr]


def aggregated_text(cluster: V1Cluster, path: str, body: dict[str, Any]) -> str:
    reply = post(cluster.aggregated.url + path, body)
    assert reply.status_code == 200, reply.text
    choice = reply.json()["choices"][0]  # our own shape: no TensorRT-LLM orchestrator asked for this one
    return str(choice["message"]["content"] if path == CHAT else choice["text"])


def advertisement(node: Node) -> dict[str, Any]:
    info = httpx.get(node.url + "/server_info").json()
    return dict(info["disaggregated_params"]["context_transceiver_lifecycle"])


@dataclass
class Attempt:
    """One request as TensorRT-LLM's v1 orchestrator drives it."""

    cluster: V1Cluster
    path: str
    body: dict[str, Any]
    schedule_style: int = 0
    gen: Node | None = None

    def __post_init__(self) -> None:
        self.disagg_request_id = random.getrandbits(63)
        self.identity = {"logical_request_id": self.disagg_request_id, "prefill_artifact_id": str(uuid.uuid4()),
                         "artifact_version": 0, "handoff_attempt_uuid": str(uuid.uuid4()),
                         "consumer_grant_id": str(uuid.uuid4()), "transfer_session_id": str(uuid.uuid4())}
        self.ctx_lifecycle = advertisement(self.cluster.ctx)
        self.gen = self.gen or self.cluster.gen
        self.endpoint: dict[str, Any] = {}

    def ctx_body(self) -> dict[str, Any]:
        body = trtllm_context_body(self.path, self.body, self.disagg_request_id, True)
        body["disaggregated_params"].update(
            {**self.identity, "schedule_style": self.schedule_style, "context_control_endpoint":
             self.cluster.ctx.netloc, "context_transceiver_lifecycle": self.ctx_lifecycle, **self.endpoint})
        return body

    def send_ctx(self, **kw: Any) -> httpx.Response:
        reply = post(self.cluster.ctx.url + self.path, self.ctx_body(), **kw)
        assert reply.status_code == 200, reply.text
        self.ctx = response_model(self.path).model_validate(reply.json())
        params = self.ctx.choices[0].disaggregated_params
        assert params is not None
        sent = self.ctx_body()["disaggregated_params"]
        for name in (*self.identity, "context_control_endpoint", "schedule_style", "ctx_dp_rank",
                     "generation_endpoint_name", "generation_endpoint_rank", "generation_endpoint_incarnation"):
            assert getattr(params, name) == sent.get(name), name  # the echo TensorRT-LLM verifies
        assert params.context_transceiver_lifecycle is not None
        assert params.context_transceiver_lifecycle.to_dict() == self.ctx_lifecycle
        return reply

    def grant_body(self) -> dict[str, Any]:
        return {"lifecycle_protocol_version": 1, **self.identity, "ttl_s": 600.0,
                "context_control_endpoint": self.cluster.ctx.netloc,
                "context_transceiver_lifecycle": self.ctx_lifecycle, "schedule_style": self.schedule_style,
                "ctx_dp_rank": None}

    def admit(self) -> GenerationGrantDecisionResponse:
        assert self.gen is not None
        reply = httpx.post(self.gen.url + GENERATION_GRANT_PATH, json=self.grant_body())
        assert reply.status_code == 200, reply.text
        decision = GenerationGrantDecisionResponse.model_validate(reply.json())  # strict, as TensorRT-LLM reads it
        if decision.accepted:
            assert decision.generation_transceiver_lifecycle is not None and decision.ttl_s is not None
            negotiate(self.ctx_lifecycle, decision.generation_transceiver_lifecycle,
                      schedule_style=self.schedule_style)
            self.endpoint = {"generation_endpoint_name": decision.generation_endpoint_name,
                             "generation_endpoint_rank": decision.generation_endpoint_rank,
                             "generation_endpoint_incarnation": str(decision.generation_endpoint_incarnation)}
        return decision

    def grant_identity(self) -> dict[str, Any]:
        return {"lifecycle_protocol_version": 1, **self.identity, **self.endpoint}

    def renew(self, sequence: int) -> httpx.Response:
        assert self.gen is not None
        return httpx.post(self.gen.url + GENERATION_GRANT_RENEW_PATH,
                          json={**self.grant_identity(), "ttl_s": 600.0, "sequence": sequence})

    def abort(self) -> httpx.Response:
        assert self.gen is not None
        return httpx.post(self.gen.url + GENERATION_GRANT_ABORT_PATH,
                          json={**self.grant_identity(), "reason": "client went away"})

    def gen_body(self) -> dict[str, Any]:
        body = trtllm_generation_body(self.path, self.body, self.ctx, self.disagg_request_id)
        body["disaggregated_params"].update(self.endpoint)
        return body

    def abort_artifact(self, incarnation: str | None = None) -> httpx.Response:
        return httpx.post(self.cluster.ctx.url + CONTEXT_ARTIFACT_ABORT_PATH, json={
            "lifecycle_protocol_version": 1, **self.identity,
            "context_endpoint_incarnation": incarnation or self.ctx_lifecycle["instance_id"]})


def obligation(reply: httpx.Response) -> ObligationResponse:
    assert reply.status_code == 200, reply.text
    return ObligationResponse.model_validate(reply.json())


def parked(node: Node) -> set[str]:
    return {entry["ctx_request_id"] for entry in node.ledger()["parked_now"]}


def ctx_id(attempt: Attempt) -> str:
    params = attempt.ctx.choices[0].disaggregated_params
    assert params is not None
    return str(params.ctx_request_id)


# -- the advertisement ----------------------------------------------------------------------------------------------
def test_server_info_advertises_v1_only_where_it_is_on(cluster: V1Cluster) -> None:
    ctx, gen = advertisement(cluster.ctx), advertisement(cluster.gen)
    assert ctx["instance_id"] != gen["instance_id"]
    negotiate(ctx, gen, schedule_style=0)
    negotiate(ctx, gen, schedule_style=1)
    v0 = httpx.get(cluster.aggregated.url + "/server_info").json()["disaggregated_params"]
    assert "context_transceiver_lifecycle" not in v0 and v0["ctx_info_endpoint"] == [cluster.aggregated.url]


# -- context first, end to end ------------------------------------------------------------------------------------
@pytest.mark.parametrize(("path", "stream", "msgpack"), [(CHAT, False, False), (COMPLETIONS, True, False),
                                                        (CHAT, True, True)], ids=["chat", "completions-stream",
                                                                                  "chat-msgpack"])
def test_v1_context_first_end_to_end(cluster: V1Cluster, path: str, stream: bool, msgpack: bool) -> None:
    body = client_body(path, cluster.model, stream=stream)
    attempt = Attempt(cluster, path, body)
    attempt.send_ctx(msgpack=msgpack)
    assert needs_generation(attempt.ctx)
    assert attempt.admit().accepted
    assert obligation(attempt.renew(0)).accepted
    reply = post(cluster.gen.url + path, attempt.gen_body(), msgpack=msgpack)
    assert reply.status_code == 200, reply.text
    text = "".join(_stream_texts(reply, path)) if stream else answer_text(path, reply)
    assert text == aggregated_text(cluster, path, client_body(path, cluster.model))
    assert ctx_id(attempt) not in parked(cluster.ctx)  # taken by GEN
    # The grant was released by the finished request: renewing it is refused, aborting it a conflict.
    assert eventually(lambda: obligation(attempt.renew(1)).state == "RELEASED")
    assert attempt.abort().status_code == 409


def _stream_texts(reply: httpx.Response, path: str) -> Iterator[str]:
    for line in reply.text.splitlines():
        if line.startswith("data: ") and line != "data: [DONE]":
            for choice in orjson.loads(line[6:])["choices"]:
                yield (choice.get("delta") or {}).get("content") or "" if path == CHAT else choice["text"]


# -- grants ----------------------------------------------------------------------------------------------------
def test_renew_is_idempotent_by_sequence_and_issue_replays(cluster: V1Cluster) -> None:
    attempt = Attempt(cluster, CHAT, client_body(CHAT, cluster.model))
    first = attempt.admit()  # asked for 600 s: the worker grants its own TTL
    assert first.accepted and first.ttl_s == pytest.approx(GRANT_TTL_S)
    cluster.clock.now += 10
    replay = attempt.admit()  # the same body again: the same grant, its original expiry
    assert replay.accepted and replay.ttl_s == pytest.approx(GRANT_TTL_S - 10)
    renewed = obligation(attempt.renew(0))
    assert renewed.accepted and renewed.state == "ACTIVE" and renewed.ttl_s == pytest.approx(GRANT_TTL_S)
    cluster.clock.now += 5
    again = obligation(attempt.renew(0))  # an old sequence changes nothing
    assert again.ttl_s == pytest.approx(GRANT_TTL_S - 5)
    assert obligation(attempt.renew(1)).ttl_s == pytest.approx(GRANT_TTL_S)
    other_session = {**attempt.grant_body(), "transfer_session_id": str(uuid.uuid4())}
    conflict = httpx.post(cluster.gen.url + GENERATION_GRANT_PATH, json=other_session)
    assert conflict.status_code == 409
    assert conflict.json()["detail"] == "consumer_grant_id was replayed for a different transfer session"
    assert obligation(attempt.abort()).state == "REVOKED"


def test_aborting_a_grant_frees_the_kv_ctx_parked_for_it(cluster: V1Cluster) -> None:
    attempt = Attempt(cluster, CHAT, client_body(CHAT, cluster.model))
    before = cluster.ctx.ledger()["totals"].get("released", 0)
    attempt.send_ctx()
    assert ctx_id(attempt) in parked(cluster.ctx)
    assert attempt.admit().accepted
    aborted = obligation(attempt.abort())
    assert aborted.accepted and aborted.state == "REVOKED"
    assert eventually(lambda: ctx_id(attempt) not in parked(cluster.ctx))  # GEN told CTX to free it
    assert cluster.ctx.ledger()["totals"]["released"] == before + 1
    assert obligation(attempt.abort()).state == "REVOKED"  # idempotent
    refused = post(cluster.gen.url + CHAT, attempt.gen_body())
    assert refused.status_code == 400 and "generation grant is REVOKED" in refused.json()["error"]["message"]


def test_an_expired_grant_is_revoked_and_its_kv_freed(cluster: V1Cluster) -> None:
    attempt = Attempt(cluster, CHAT, client_body(CHAT, cluster.model))
    attempt.send_ctx()
    assert attempt.admit().accepted
    cluster.clock.now += GRANT_TTL_S + 1  # past GEN's TTL, not CTX's artifact TTL: only the grant can free it
    assert eventually(lambda: ctx_id(attempt) not in parked(cluster.ctx))
    renewed = obligation(attempt.renew(0))
    assert not renewed.accepted and renewed.state == "REVOKED" and renewed.reason == "generation intent grant expired"
    assert renewed.ttl_s is None


def test_a_grant_is_refused_past_the_limit_and_for_an_incompatible_ctx(cluster: V1Cluster) -> None:
    held = Attempt(cluster, CHAT, client_body(CHAT, cluster.model), gen=cluster.small_gen)
    assert held.admit().accepted
    second = Attempt(cluster, CHAT, client_body(CHAT, cluster.model), gen=cluster.small_gen)
    refused = second.admit()
    assert not refused.accepted and refused.reason == "generation admission credit is exhausted"
    assert obligation(held.abort()).state == "REVOKED"
    third = Attempt(cluster, CHAT, client_body(CHAT, cluster.model), gen=cluster.small_gen)
    third.ctx_lifecycle = {**third.ctx_lifecycle, "capabilities": ["ATTEMPT_IDENTITY"]}
    incompatible = third.admit()
    assert not incompatible.accepted and "context transceiver has an invalid lifecycle advertisement" in \
        incompatible.reason


@pytest.mark.parametrize(("route", "change", "status"), [
    (GENERATION_GRANT_PATH, {"lifecycle_protocol_version": 2}, 400),
    (GENERATION_GRANT_PATH, {"surprise": 1}, 400),
    (GENERATION_GRANT_PATH, {"consumer_grant_id": "not-a-uuid"}, 400),
    (GENERATION_GRANT_RENEW_PATH, {}, 409),  # a grant never issued
    (GENERATION_GRANT_ABORT_PATH, {}, 409),
], ids=["version-2", "unknown-field", "bad-uuid", "renew-unknown", "abort-unknown"])
def test_control_call_refusals(cluster: V1Cluster, route: str, change: dict[str, Any], status: int) -> None:
    attempt = Attempt(cluster, CHAT, client_body(CHAT, cluster.model))
    attempt.endpoint = {"generation_endpoint_name": "gen", "generation_endpoint_rank": 0,
                        "generation_endpoint_incarnation": advertisement(cluster.gen)["instance_id"]}
    body = attempt.grant_body() if route == GENERATION_GRANT_PATH else \
        {**attempt.grant_identity(), "ttl_s": 600.0, "sequence": 0} if route == GENERATION_GRANT_RENEW_PATH else \
        attempt.grant_identity()
    reply = httpx.post(cluster.gen.url + route, json={**body, **change})
    assert reply.status_code == status, reply.text
    if status == 400:
        assert "error" in reply.json()  # TensorRT-LLM's validation answer
    else:
        assert "has no admitted transfer session" in reply.json()["detail"]


def test_control_routes_are_404_with_v1_off(cluster: V1Cluster) -> None:
    attempt = Attempt(cluster, CHAT, client_body(CHAT, cluster.model))
    reply = httpx.post(cluster.v0_gen.url + GENERATION_GRANT_PATH, json=attempt.grant_body())
    assert reply.status_code == 404 and reply.json() == {"detail": "disaggregated lifecycle control is unavailable"}


# -- CTX artifacts --------------------------------------------------------------------------------------------------
def test_artifact_abort_frees_the_parked_kv(cluster: V1Cluster) -> None:
    attempt = Attempt(cluster, CHAT, client_body(CHAT, cluster.model))
    attempt.send_ctx()
    assert ctx_id(attempt) in parked(cluster.ctx)
    stale = attempt.abort_artifact(str(uuid.uuid4()))
    assert stale.status_code == 409
    assert stale.json()["detail"] == "context artifact abort targets a stale endpoint incarnation"
    aborted = obligation(attempt.abort_artifact())
    assert aborted.accepted and aborted.state == "ABANDONED"
    assert str(aborted.context_endpoint_incarnation) == attempt.ctx_lifecycle["instance_id"]
    assert ctx_id(attempt) not in parked(cluster.ctx)
    assert obligation(attempt.abort_artifact()).accepted  # replayed: the same answer


def test_an_artifact_aborted_before_its_request_refuses_it(cluster: V1Cluster) -> None:
    attempt = Attempt(cluster, CHAT, client_body(CHAT, cluster.model))
    assert obligation(attempt.abort_artifact()).state == "ABANDONED"  # cancel before create
    reply = post(cluster.ctx.url + CHAT, attempt.ctx_body())
    assert reply.status_code == 400 and "context artifact is ABANDONED" in reply.json()["error"]["message"]


def test_an_unclaimed_artifact_expires_after_the_artifact_ttl(cluster: V1Cluster) -> None:
    attempt = Attempt(cluster, CHAT, client_body(CHAT, cluster.model))
    attempt.send_ctx()
    assert ctx_id(attempt) in parked(cluster.ctx)
    cluster.clock.now += 61
    assert eventually(lambda: ctx_id(attempt) not in parked(cluster.ctx))


# -- request checks (TensorRT-LLM's _validate_disagg_before_submit) ------------------------------------------------
def _refused(reply: httpx.Response, message: str) -> None:
    assert reply.status_code == 400, reply.text
    assert message in reply.json()["error"]["message"]


def test_a_v1_worker_refuses_a_request_without_identity(cluster: V1Cluster) -> None:
    body = trtllm_context_body(CHAT, client_body(CHAT, cluster.model), 1, True)
    _refused(post(cluster.ctx.url + CHAT, body),
             "protocol-v1 cross-side request is missing its negotiated attempt identity")


def test_a_v0_worker_refuses_identity_fields(cluster: V1Cluster) -> None:
    attempt = Attempt(cluster, CHAT, client_body(CHAT, cluster.model))
    _refused(post(cluster.aggregated.url + CHAT, attempt.ctx_body()),
             "generation-safe request reached a qualified-legacy transceiver without protocol-v1 support")


@pytest.mark.parametrize(("change", "message"), [
    ({"transfer_session_id": None}, "must be provided together; missing: transfer_session_id"),
    ({"consumer_grant_id": "ABC"}, "consumer_grant_id must be a canonical non-nil UUID string"),
    ({"context_control_endpoint": None}, "missing the selected context lifecycle-control endpoint"),
    ({"context_transceiver_lifecycle": None}, "missing the selected context transceiver lifecycle"),
    ({"request_type": "generation_only"}, "role 'context'"),
], ids=["partial-identity", "bad-uuid", "no-control-endpoint", "no-lifecycle", "wrong-role"])
def test_ctx_request_refusals(cluster: V1Cluster, change: dict[str, Any], message: str) -> None:
    body = Attempt(cluster, CHAT, client_body(CHAT, cluster.model)).ctx_body()
    body["disaggregated_params"].update(change)
    _refused(post(cluster.ctx.url + CHAT, body), message)


def test_ctx_refuses_an_advertisement_of_another_incarnation(cluster: V1Cluster) -> None:
    attempt = Attempt(cluster, CHAT, client_body(CHAT, cluster.model))
    attempt.ctx_lifecycle = {**attempt.ctx_lifecycle, "instance_id": str(uuid.uuid4())}
    _refused(post(cluster.ctx.url + CHAT, attempt.ctx_body()),
             "selected context transceiver lifecycle does not match the current context endpoint incarnation")


def test_gen_refuses_a_request_without_a_grant(cluster: V1Cluster) -> None:
    attempt = Attempt(cluster, CHAT, client_body(CHAT, cluster.model))
    attempt.send_ctx()
    _refused(post(cluster.gen.url + CHAT, attempt.gen_body()), "has no admitted transfer session")
    assert obligation(attempt.abort_artifact()).accepted


def test_conversation_params_and_the_subagent_header_are_accepted(cluster: V1Cluster) -> None:
    body = client_body(CHAT, cluster.model, conversation_params={"conversation_id": " conv-1 "})
    attempt = Attempt(cluster, CHAT, body)
    attempt.send_ctx(headers={"x-trtllm-subagent-affinity-id": "parent-1"})
    assert attempt.admit().accepted
    gen_body = attempt.gen_body()
    gen_body["disaggregated_params"]["conversation_id"] = "conv-1"
    reply = post(cluster.gen.url + CHAT, gen_body, headers={"x-trtllm-subagent-affinity-id": "parent-1"})
    assert reply.status_code == 200, reply.text
    assert answer_text(CHAT, reply) == aggregated_text(cluster, CHAT, client_body(CHAT, cluster.model))


# -- generation first -----------------------------------------------------------------------------------------------
@pytest.mark.parametrize("path", [CHAT, COMPLETIONS], ids=["chat", "completions"])
def test_v1_generation_first_gen_sent_before_ctx(cluster: V1Cluster, path: str) -> None:
    """Grant first, then GEN's request (it waits for the hand-off), then CTX's, which carries GEN's identity."""
    body = client_body(path, cluster.model)
    attempt = Attempt(cluster, path, body, schedule_style=1)
    assert attempt.admit().accepted
    info = httpx.get(cluster.ctx.url + "/server_info").json()["disaggregated_params"]
    gen_body = {**body, "disaggregated_params": {
        "request_type": "generation_only", "ctx_request_id": attempt.disagg_request_id,
        "disagg_request_id": attempt.disagg_request_id, "schedule_style": 1,
        "ctx_info_endpoint": info["ctx_info_endpoint"][0], "ctx_dp_rank": info["ctx_dp_rank"],
        "context_control_endpoint": cluster.ctx.netloc, "context_transceiver_lifecycle": attempt.ctx_lifecycle,
        **attempt.identity, **attempt.endpoint}}
    board = cluster.ctx.app.state.service.board
    with ThreadPoolExecutor(1) as pool:
        gen_reply = pool.submit(post, cluster.gen.url + path, gen_body, msgpack=True)
        assert eventually(lambda: board.waiting(attempt.disagg_request_id) or gen_reply.done())
        assert not gen_reply.done(), gen_reply.result().text
        attempt.send_ctx(msgpack=True)
        reply = gen_reply.result()
    assert reply.status_code == 200, reply.text
    assert answer_text(path, reply) == aggregated_text(cluster, path, body)
    assert ctx_id(attempt) not in parked(cluster.ctx)
    assert eventually(lambda: obligation(attempt.renew(1)).state == "RELEASED")


def test_a_grant_aborted_while_gen_waits_ends_the_wait_and_refuses_ctx(cluster: V1Cluster) -> None:
    """Generation first, the client gone before CTX ran: the abort wakes the waiting GEN (400) and leaves CTX a
    tombstone, so the CTX request that comes later parks nothing."""
    body = client_body(CHAT, cluster.model)
    attempt = Attempt(cluster, CHAT, body, schedule_style=1)
    assert attempt.admit().accepted
    gen_body = {**body, "disaggregated_params": {
        "request_type": "generation_only", "ctx_request_id": attempt.disagg_request_id,
        "disagg_request_id": attempt.disagg_request_id, "schedule_style": 1, "ctx_info_endpoint": cluster.ctx.url,
        "context_control_endpoint": cluster.ctx.netloc, "context_transceiver_lifecycle": attempt.ctx_lifecycle,
        **attempt.identity, **attempt.endpoint}}
    board = cluster.ctx.app.state.service.board
    with ThreadPoolExecutor(1) as pool:
        gen_reply = pool.submit(post, cluster.gen.url + CHAT, gen_body)
        assert eventually(lambda: board.waiting(attempt.disagg_request_id) or gen_reply.done())
        assert obligation(attempt.abort()).state == "REVOKED"
        _refused(gen_reply.result(), "generation grant is no longer active: client went away")
    assert eventually(lambda: post(cluster.ctx.url + CHAT, attempt.ctx_body()).status_code == 400)
    _refused(post(cluster.ctx.url + CHAT, attempt.ctx_body()), "context artifact is ABANDONED: client went away")



def test_a_generation_first_gen_whose_client_hangs_up_while_waiting_revokes_its_grant(cluster: V1Cluster) -> None:
    """v1 generation first, the orchestrator gone while GEN waits for the hand-off: the wait ends at once, the
    grant is revoked (its slot free) and CTX is told, so the CTX request that comes later parks nothing."""
    body = client_body(CHAT, cluster.model)
    attempt = Attempt(cluster, CHAT, body, schedule_style=1)
    assert attempt.admit().accepted
    gen_body = {**body, "disaggregated_params": {
        "request_type": "generation_only", "ctx_request_id": attempt.disagg_request_id,
        "disagg_request_id": attempt.disagg_request_id, "schedule_style": 1, "ctx_info_endpoint": cluster.ctx.url,
        "context_control_endpoint": cluster.ctx.netloc, "context_transceiver_lifecycle": attempt.ctx_lifecycle,
        **attempt.identity, **attempt.endpoint}}
    board = cluster.ctx.app.state.service.board
    control = cluster.gen.app.state.service.lifecycle
    with open_post(cluster.gen.url, CHAT, orjson.dumps(gen_body)):
        assert eventually(lambda: board.waiting(attempt.disagg_request_id))
        assert control.live_grants >= 1
    assert eventually(lambda: not board.waiting(attempt.disagg_request_id))
    assert obligation(attempt.renew(1)).state == "REVOKED"
    assert eventually(lambda: post(cluster.ctx.url + CHAT, attempt.ctx_body()).status_code == 400)
    _refused(post(cluster.ctx.url + CHAT, attempt.ctx_body()), "context artifact is ABANDONED")

# -- the bookkeeping: live grants counted, tombstones in order of expiry and capped ------------------------------
def _identity() -> dict[str, Any]:
    return {"logical_request_id": random.getrandbits(63), "prefill_artifact_id": str(uuid.uuid4()),
            "artifact_version": 0, "handoff_attempt_uuid": str(uuid.uuid4()),
            "consumer_grant_id": str(uuid.uuid4()), "transfer_session_id": str(uuid.uuid4())}


class _Alone:
    """A LifecycleControl on its own, on a fake clock: no HTTP, no engine (a grant without a context control
    endpoint aborts nothing at CTX)."""

    def __init__(self, role: Role, **settings: Any) -> None:
        self.clock = FakeClock()
        self.aborted: list[str] = []
        self.released: list[str] = []

        async def abort_request(request_id: str) -> None:
            self.aborted.append(request_id)

        async def release_handoff(ctx_request_id: str, state: bytes) -> bool:
            self.released.append(ctx_request_id)
            return True

        self.control = LifecycleControl(role, LifecycleSettings(protocol_version=1, clock=self.clock, **settings),
                                        abort_request=abort_request, release_handoff=release_handoff)
        ctx = make_advertisement(protocol_version=1, capabilities=CAPABILITIES, instance_id=str(uuid.uuid4()))
        self.ctx_lifecycle = ctx.to_dict()

    def issue(self) -> tuple[dict[str, Any], GenerationGrantDecisionResponse]:
        identity = _identity()
        request = GenerationGrantRequest.model_validate({
            "lifecycle_protocol_version": 1, **identity, "ttl_s": 600.0,
            "context_transceiver_lifecycle": self.ctx_lifecycle, "schedule_style": 0, "ctx_dp_rank": None})
        return identity, self.control.issue(request, "gen:1")

    def grant_identity(self, identity: dict[str, Any]) -> dict[str, Any]:
        return {"lifecycle_protocol_version": 1, **identity, "generation_endpoint_name": "gen:1",
                "generation_endpoint_rank": 0, "generation_endpoint_incarnation": str(self.control.incarnation)}

    def abort(self, identity: dict[str, Any]) -> dict[str, Any]:
        return self.control.abort(GenerationGrantAbortRequest.model_validate(
            {**self.grant_identity(identity), "reason": "client went away"}))

    def renew(self, identity: dict[str, Any], sequence: int) -> dict[str, Any]:
        return self.control.renew(GenerationGrantRenewRequest.model_validate(
            {**self.grant_identity(identity), "ttl_s": 600.0, "sequence": sequence}))

    async def abort_artifact(self, identity: dict[str, Any]) -> dict[str, Any]:
        return await self.control.artifacts.abort(ContextArtifactAbortRequest.model_validate(
            {"lifecycle_protocol_version": 1, **identity,
             "context_endpoint_incarnation": str(self.control.incarnation), "reason": "client went away"}))

    def artifact_params(self, identity: dict[str, Any]) -> DisaggregatedParams:
        return DisaggregatedParams.model_validate({"request_type": "context_only", **identity})


async def test_the_live_grant_count_follows_issue_abort_expiry_and_release() -> None:
    alone = _Alone("generation", grant_ttl_s=30.0, max_live_grants=3)
    control, clock = alone.control, alone.clock
    try:
        first, decision = alone.issue()
        assert decision.accepted and control.live_grants == 1
        assert alone.issue()[1].accepted and control.live_grants == 2  # a second attempt
        assert control.issue(GenerationGrantRequest.model_validate({  # a replay of the first is no new grant
            "lifecycle_protocol_version": 1, **first, "ttl_s": 600.0,
            "context_transceiver_lifecycle": alone.ctx_lifecycle, "schedule_style": 0}), "gen:1").accepted
        assert control.live_grants == 2
        assert alone.abort(first)["state"] == "REVOKED" and control.live_grants == 1
        assert alone.abort(first)["state"] == "REVOKED" and control.live_grants == 1  # a replayed abort
        third, decision = alone.issue()
        fourth, decision4 = alone.issue()
        assert decision.accepted and decision4.accepted and control.live_grants == 3
        refused = alone.issue()[1]
        assert not refused.accepted and refused.reason == "generation admission credit is exhausted"
        clock.now += 20.0
        assert alone.renew(fourth, 1)["accepted"]  # renewed: it outlives the others
        grant_id = UUID(third["consumer_grant_id"])
        control.bind(DisaggregatedParams.model_validate({"request_type": "generation_only", **third}), "req-3")
        control.finish(grant_id, ok=True)
        assert control.live_grants == 2
        clock.now += 15.0  # past the second's TTL, not the renewed one's
        await control.sweep()
        assert control.live_grants == 1
        assert alone.renew(fourth, 2)["accepted"]
        clock.now += 31.0
        await control.sweep()
        assert control.live_grants == 0
        assert alone.renew(fourth, 3)["state"] == "REVOKED"
        assert alone.issue()[1].accepted and control.live_grants == 1
    finally:
        await control.aclose()


async def test_grant_tombstones_expire_in_order_after_the_replay_horizon() -> None:
    alone = _Alone("generation", grant_ttl_s=30.0, artifact_ttl_s=30.0)  # replay horizon 60 s
    control, clock = alone.control, alone.clock
    try:
        early, _ = alone.issue()
        alone.abort(early)
        clock.now += 40.0
        late, _ = alone.issue()
        alone.abort(late)
        assert len(control.grants) == 2
        clock.now += 30.0  # the first's horizon has passed, not the second's
        await control.sweep()
        assert UUID(early["consumer_grant_id"]) not in control.grants
        assert alone.abort(late)["state"] == "REVOKED"  # still remembered: a replay answers the same
        clock.now += 30.0
        await control.sweep()
        assert control.grants == {} and control.live_grants == 0
    finally:
        await control.aclose()


async def test_past_the_replay_filter_capacity_a_grant_is_refused_never_a_tombstone_forgotten() -> None:
    alone = _Alone("generation", grant_ttl_s=30.0, artifact_ttl_s=30.0, replay_filter_capacity=2)
    control, clock = alone.control, alone.clock
    try:
        first, _ = alone.issue()
        alone.abort(first)
        assert alone.issue()[1].accepted
        refused = alone.issue()[1]
        assert not refused.accepted and refused.reason == GRANT_SATURATED
        assert control.live_grants == 1
        assert alone.abort(first)["state"] == "REVOKED"  # the tombstone is still there
        clock.now += 60.0  # the first's tombstone is past its horizon (the second expired meanwhile: no sweep yet)
        assert alone.issue()[1].accepted and UUID(first["consumer_grant_id"]) not in control.grants
    finally:
        await control.aclose()


async def test_ctx_tombstones_are_capped_and_expire() -> None:
    alone = _Alone("context", artifact_ttl_s=30.0, grant_ttl_s=30.0, replay_filter_capacity=2)
    control, clock = alone.control, alone.clock
    try:
        before = [_identity(), _identity()]
        for identity in before:  # cancel before create: tombstones
            assert (await alone.abort_artifact(identity))["accepted"]
        third = _identity()
        answer = await alone.abort_artifact(third)
        assert not answer["accepted"] and answer["reason"] == ARTIFACT_SATURATED
        with pytest.raises(OverloadedError, match="replay protection is saturated"):
            control.artifacts.check(alone.artifact_params(third))
        with pytest.raises(InvalidRequestError, match="context artifact is ABANDONED"):
            control.artifacts.check(alone.artifact_params(before[0]))  # still refused: nothing was forgotten
        clock.now += 60.0
        await control.sweep()
        assert control.artifacts.entries == {}
        control.artifacts.check(alone.artifact_params(third))
        control.artifacts.park(alone.artifact_params(third), "ctx-3", b"state")
        assert control.artifacts.live == 1
        clock.now += 30.0
        await control.sweep()  # unclaimed past the artifact TTL: freed, a tombstone left
        assert control.artifacts.live == 0 and alone.released == ["ctx-3"]
        with pytest.raises(InvalidRequestError, match="context artifact expired"):
            control.artifacts.check(alone.artifact_params(third))
    finally:
        await control.aclose()


# -- hardening (issue 44, items 2, 3 and 6) ------------------------------------------------------------------------
def test_server_info_and_a_grant_name_the_worker_not_the_callers_host_header(cluster: V1Cluster) -> None:
    """A caller's ``Host`` is not where the worker is: /server_info's ctx_info_endpoint (where a GEN then pulls
    from, with the deployment secret) and a grant's generation_endpoint_name come from the worker's own address."""
    info = httpx.get(cluster.ctx.url + "/server_info", headers={"Host": "evil.example:1"}).json()
    assert info["disaggregated_params"]["ctx_info_endpoint"] == [cluster.ctx.url]
    attempt = Attempt(cluster, CHAT, client_body(CHAT, cluster.model))
    reply = httpx.post(cluster.gen.url + GENERATION_GRANT_PATH, json=attempt.grant_body(),
                       headers={"Host": "evil.example:1"})
    decision = GenerationGrantDecisionResponse.model_validate(reply.json())
    assert decision.accepted and decision.generation_endpoint_name == cluster.gen.netloc
    attempt.endpoint = {"generation_endpoint_name": cluster.gen.netloc, "generation_endpoint_rank": 0,
                        "generation_endpoint_incarnation": str(decision.generation_endpoint_incarnation)}
    assert obligation(attempt.abort()).state == "REVOKED"


@pytest.mark.parametrize("endpoint", ["{ctx}/steal?x=", "{ctx}/steal#", "user:pw@{ctx}", "file:///etc/passwd"])
def test_a_grant_whose_control_endpoint_could_aim_an_abort_elsewhere_is_refused(cluster: V1Cluster,
                                                                              endpoint: str) -> None:
    """On bb7e60b such a grant was accepted, and its abort POSTed to whatever host and path (the fixed suffix
    pushed into the query by a '?') the caller named: a server-side request forgery."""
    attempt = Attempt(cluster, CHAT, client_body(CHAT, cluster.model))
    body = {**attempt.grant_body(), "context_control_endpoint": endpoint.format(ctx=cluster.ctx.netloc)}
    reply = httpx.post(cluster.gen.url + GENERATION_GRANT_PATH, json=body)
    assert reply.status_code == 200, reply.text
    decision = GenerationGrantDecisionResponse.model_validate(reply.json())
    assert not decision.accepted and "context_control_endpoint" in decision.reason
    assert UUID(str(attempt.identity["consumer_grant_id"])) not in cluster.gen.app.state.service.lifecycle.grants


def test_a_generation_first_hand_off_goes_only_to_the_attempt_that_was_granted_it(cluster: V1Cluster) -> None:
    """Whoever asks CTX's board for a request's hand-off first got it on bb7e60b (and the real GEN a 404): now it
    is bound to the attempt's transfer_session_id, which only the GEN granted the attempt presents."""
    body = client_body(CHAT, cluster.model)
    attempt = Attempt(cluster, CHAT, body, schedule_style=1)
    assert attempt.admit().accepted
    board_url = cluster.ctx.url + HANDOFF_PATH.format(disagg_request_id=attempt.disagg_request_id)
    board = cluster.ctx.app.state.service.board
    with ThreadPoolExecutor(1) as pool:
        thief = pool.submit(httpx.get, board_url, params={"wait_s": 120}, timeout=150,
                            headers={CLAIM_HEADER: str(uuid.uuid4())})
        assert eventually(lambda: board.waiting(attempt.disagg_request_id) or thief.done())
        attempt.send_ctx()  # posts the hand-off: the thief wakes first, and is refused
        stolen = thief.result()
    assert stolen.status_code == 404, stolen.text
    assert httpx.get(board_url, params={"wait_s": 0}).status_code == 404  # no claim at all: refused too
    gen_body = {**body, "disaggregated_params": {
        "request_type": "generation_only", "ctx_request_id": attempt.disagg_request_id,
        "disagg_request_id": attempt.disagg_request_id, "schedule_style": 1, "ctx_info_endpoint": cluster.ctx.url,
        "context_control_endpoint": cluster.ctx.netloc, "context_transceiver_lifecycle": attempt.ctx_lifecycle,
        **attempt.identity, **attempt.endpoint}}
    reply = post(cluster.gen.url + CHAT, gen_body)  # the granted GEN still finds it on the board
    assert reply.status_code == 200, reply.text
    assert answer_text(CHAT, reply) == aggregated_text(cluster, CHAT, body)


async def test_a_tombstone_keeps_digests_not_the_request_that_made_it() -> None:
    """On bb7e60b each aborted grant kept its whole request and reason for the replay horizon (20 minutes), up to
    262,144 of them: ~32 GiB of 64 KiB bodies. Now a tombstone is a few hundred bytes, whatever was sent."""
    alone = _Alone("generation")
    control = alone.control
    # Only what is allocated with this test on the stack counts: the module's servers run in other threads of this
    # process meanwhile.
    mine = [tracemalloc.Filter(True, __file__, all_frames=True)]
    try:
        tracemalloc.start(32)
        before = tracemalloc.take_snapshot().filter_traces(mine)
        for i in range(100):
            identity, decision = alone.issue()
            assert decision.accepted
            body = orjson.dumps({**alone.grant_identity(identity), "reason": f"{i}" + "x" * 60_000})
            control.abort(GenerationGrantAbortRequest.model_validate_json(body))  # as a route reads it
        del body
        after = tracemalloc.take_snapshot().filter_traces(mine)
        tracemalloc.stop()
        held = sum(stat.size_diff for stat in after.compare_to(before, "filename"))
        assert held < 100 * 4096, held  # bb7e60b: over 100 x 60 KB
        for grant in control.grants.values():
            assert grant.request is None and len(grant.reason) <= MAX_REASON
        assert alone.abort(identity)["state"] == "REVOKED"  # a replay still answers the same
    finally:
        await control.aclose()


async def test_a_grant_not_bound_within_its_admission_lease_is_revoked_and_frees_its_credit() -> None:
    """bb7e60b: 512 grants issued and never used held all admission credit for the grant TTL (600 s)."""
    alone = _Alone("generation", grant_ttl_s=600.0, grant_bind_lease_s=30.0, max_live_grants=4,
                   max_unbound_grants_per_caller=4)
    control, clock = alone.control, alone.clock
    try:
        hoarded = [alone.issue()[0] for _ in range(3)]
        used, decision = alone.issue()
        assert decision.accepted and decision.ttl_s is not None and decision.ttl_s <= 30.0
        control.bind(DisaggregatedParams.model_validate({"request_type": "generation_only", **used}), "req-1")
        assert not alone.issue()[1].accepted  # all the credit is held
        clock.now += 20.0
        assert alone.renew(hoarded[0], 1)["accepted"]  # a renewal does not extend the lease
        clock.now += 11.0
        await control.sweep()
        assert control.live_grants == 1  # the bound one only
        assert alone.renew(hoarded[0], 2)["state"] == "REVOKED"
        assert alone.renew(used, 1)["accepted"]
        assert alone.issue()[1].accepted  # credit is back
    finally:
        await control.aclose()


async def test_one_caller_holds_only_so_many_unbound_grants() -> None:
    alone = _Alone("generation", max_live_grants=64, max_unbound_grants_per_caller=2)
    control = alone.control

    def issue(caller: str) -> GenerationGrantDecisionResponse:
        return control.issue(GenerationGrantRequest.model_validate({
            "lifecycle_protocol_version": 1, **_identity(), "ttl_s": 600.0,
            "context_transceiver_lifecycle": alone.ctx_lifecycle, "schedule_style": 0}), "gen:1", caller)

    try:
        assert issue("10.0.0.9").accepted and issue("10.0.0.9").accepted
        refused = issue("10.0.0.9")
        assert not refused.accepted and refused.reason == GRANT_HOARDED
        assert issue("10.0.0.1").accepted  # the orchestrator is not shut out by the hoarder
    finally:
        await control.aclose()


async def test_aborts_aimed_at_a_black_hole_never_delay_a_hand_off_pull(caplog: pytest.LogCaptureFixture) -> None:
    """bb7e60b: the abort POSTs shared one 100-connection client with the hand-off pulls, and 150 aborts aimed at a
    host that never answers delayed a real pull from 6 ms to 8.5 s (until they timed out). The aborts now have their
    own few connections: the pull is answered while every abort is still waiting on the black hole."""
    black_hole = socket.socket()
    black_hole.bind(("127.0.0.1", 0))
    black_hole.listen(1024)
    hole = f"127.0.0.1:{black_hole.getsockname()[1]}"
    held: list[socket.socket] = []  # connections taken and never read from nor answered

    def swallow() -> None:
        while True:
            try:
                held.append(black_hole.accept()[0])
            except OSError:
                return

    threading.Thread(target=swallow, daemon=True).start()

    async def handoff(request: Request) -> Response:
        return Response(b'{"ctx_request_id": "1"}', media_type="application/json")

    ctx_app = Starlette(routes=[Route(HANDOFF_PATH, handoff)])
    alone = _Alone("generation", max_live_grants=1024)
    control = alone.control
    try:
        with running(ctx_app) as ctx_url:
            for _ in range(150):
                request = GenerationGrantRequest.model_validate({
                    "lifecycle_protocol_version": 1, **(identity := _identity()), "ttl_s": 600.0,
                    "context_control_endpoint": hole, "context_transceiver_lifecycle": alone.ctx_lifecycle,
                    "schedule_style": 0})
                assert control.issue(request, "gen:1").accepted
                alone.abort(identity)  # spawns an abort POST to the black hole
            # The aborts are in flight (bb7e60b: 100 of them, every connection of the shared client; now 8).
            assert await eventually_async(lambda: len(held) >= 8)
            with caplog.at_level(logging.WARNING, logger="disagg_serve.worker.trtllm_lifecycle"):
                params = await pull_handoff(control.http(), ctx_url, 7, 5.0)
                assert params == {"ctx_request_id": "1"}
                # No abort had given up (timed out) when the pull was answered: it never waited behind them.
                assert not [r for r in caplog.records if "abort" in r.getMessage()]
            await control.aclose()  # with the aborts still stuck: they are cancelled, not waited out
            assert control._control_pending == 0
    finally:
        await control.aclose()
        black_hole.close()
        for connection in held:
            connection.close()

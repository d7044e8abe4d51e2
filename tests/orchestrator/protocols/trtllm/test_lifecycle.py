"""Direction A under TensorRT-LLM's lifecycle protocol v1: our orchestrator in front of strict v1 trtllm-serve
workers (``trtllm_worker`` with ``lifecycle_v1``), over real HTTP, the official client as the client.

Each path of ``orchestrator/protocols/trtllm/lifecycle.py``: negotiation from ``GET /server_info`` (v0 where a
worker advertises nothing), the identity on CTX and its echo, the grant before GEN's request, its renewal, and the
aborts of the grant and of CTX's artifact on every failure; then the control bodies we send, each checked to fail
TensorRT-LLM's models when a field is dropped or renamed.
"""

from __future__ import annotations

import asyncio
import contextlib
import socket
from collections.abc import AsyncIterator, Callable, Iterator
from typing import Any
from urllib.parse import urlsplit

import openai
import orjson
import pytest
from pydantic import BaseModel, ValidationError

from frontend.config import TrtllmConfig
from frontend.metrics import Metrics
from frontend.trtllm.identity import IDENTITY_FIELDS
from frontend.trtllm.lifecycle import (
    CONTEXT_ARTIFACT_ABORT_PATH,
    GENERATION_GRANT_ABORT_PATH,
    GENERATION_GRANT_PATH,
    GENERATION_GRANT_RENEW_PATH,
    ContextArtifactAbortRequest,
    GenerationGrantAbortRequest,
    GenerationGrantRenewRequest,
    GenerationGrantRequest,
)
from orchestrator.member import PoolMember
from orchestrator.protocols.trtllm.lifecycle import Attempt, LifecycleClient, SettledStream, read_server_info
from orchestrator.upstream.base import WorkerTimeouts
from orchestrator.upstream.choice import make_transport
from tests.cluster import Node, sample, start_orchestrator, total
from tests.orchestrator.protocols.trtllm.test_wire import MESSAGES
from tests.orchestrator.protocols.trtllm.trtllm_worker import FIRST, MODEL, REST, TrtllmWorker
from tests.orchestrator.upstream.scripted_transport import ScriptedStream
from tests.servers import running
from tests.waiting import eventually, eventually_async

EVENTS = "disagg_trtllm_lifecycle_events_total"
RENEWED_TTL_S = 3.0  # a grant's TTL where a test needs renewals: one every second (a third of it)


@contextlib.contextmanager
def fleet(ctxs: list[TrtllmWorker], gens: list[TrtllmWorker], **options: Any
          ) -> Iterator[tuple[openai.OpenAI, Node]]:
    with contextlib.ExitStack() as stack:
        ctx_urls = [stack.enter_context(running(w.app())) for w in ctxs]
        gen_urls = [stack.enter_context(running(w.app())) for w in gens]
        options.setdefault("context_servers", {"urls": ctx_urls, "router": {"type": "round_robin"}})
        options.setdefault("generation_servers", {"urls": gen_urls, "router": {"type": "round_robin"}})
        node = start_orchestrator(stack, ctx_urls, gen_urls, **options)
        client = stack.enter_context(openai.OpenAI(base_url=node.url + "/v1", api_key="x", max_retries=0,
                                                   timeout=30))
        yield client, node


def v1(role: str, **faults: Any) -> TrtllmWorker:
    return TrtllmWorker(role, lifecycle_v1=True, **faults)


def params(raw: bytes) -> dict[str, Any]:
    return dict(orjson.loads(raw)["disaggregated_params"])


def identity(fields: dict[str, Any]) -> dict[str, Any]:
    return {name: fields[name] for name in IDENTITY_FIELDS}


def events(node: Node, event: str) -> float:
    return sample(node.app.state.metrics, EVENTS, event=event)


def chat(client: openai.OpenAI, stream: bool) -> str:
    if stream:
        chunks = client.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=8, stream=True)
        return "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    return client.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=8).choices[0].message.content or ""


# -- the way it goes when nothing fails -----------------------------------------------------------------------
@pytest.mark.parametrize("stream", [False, True], ids=["whole", "stream"])
def test_a_v1_pair_gets_an_identity_a_grant_and_no_abort(stream: bool) -> None:
    ctx, gen = v1("ctx"), v1("gen")
    with fleet([ctx], [gen]) as (client, node):
        assert chat(client, stream) == FIRST + REST
        assert events(node, "grant_accepted") == 1 and events(node, "grant_aborted") == 0
    assert ctx.refused == [] and gen.refused == []
    sent, answered_to = params(ctx.bodies[0]), params(gen.bodies[0])
    assert sent["context_transceiver_lifecycle"] == ctx.advertisement
    assert sent["context_control_endpoint"] and "generation_endpoint_name" not in sent  # context first
    assert sent["logical_request_id"] == sent["disagg_request_id"]
    (grant_path, grant), = gen.calls  # the grant, and nothing else: GEN releases its own grant when it finishes
    assert grant_path == GENERATION_GRANT_PATH and identity(grant) == identity(sent)
    assert grant["ttl_s"] == 600 and grant["schedule_style"] == 0
    assert grant["context_transceiver_lifecycle"] == ctx.advertisement
    assert identity(answered_to) == identity(sent) and answered_to["generation_endpoint_incarnation"] == gen.instance_id
    assert gen.grants == {sent["consumer_grant_id"]: "RELEASED"} and ctx.calls == []


def test_workers_that_do_not_advertise_v1_are_spoken_to_in_v0() -> None:
    ctx, gen = TrtllmWorker("ctx"), TrtllmWorker("gen")
    with fleet([ctx], [gen]) as (client, node):
        assert chat(client, False) == FIRST + REST
        assert events(node, "grant_accepted") == 0
    assert "consumer_grant_id" not in params(ctx.bodies[0]) and "consumer_grant_id" not in params(gen.bodies[0])
    assert ctx.refused == [] and gen.refused == []


@pytest.mark.parametrize("role", ["ctx", "gen"])
def test_a_server_info_that_failed_is_read_again_not_taken_for_v0(role: str) -> None:
    """A failed ``GET /server_info`` leaves the worker undescribed (not healthy yet): the next health check reads it
    again, and the pair is spoken to in v1, never in v0 because of one failed read."""
    ctx, gen = v1("ctx", fail_server_info=int(role == "ctx")), v1("gen", fail_server_info=int(role == "gen"))
    with fleet([ctx], [gen], health_check_interval_s=0.1) as (client, node):
        flow = node.app.state.flow
        assert eventually(lambda: all(w.healthy and w.lifecycle is not None
                                      for pool in (flow.ctx_pool, flow.gen_pool) for w in pool.workers))
        assert chat(client, False) == FIRST + REST
        assert events(node, "grant_accepted") == 1
    assert ctx.refused == [] and gen.refused == []


def test_a_v1_ctx_without_a_v1_gen_fails_cleanly() -> None:
    """A v1 worker refuses a v0 request, and a v0 one refuses v1's fields (TensorRT-LLM has no per-request
    downgrade: a fleet is set up consistently): the request fails, and CTX's artifact is aborted."""
    ctx, gen = v1("ctx"), TrtllmWorker("gen")
    with fleet([ctx], [gen]) as (client, _), pytest.raises(openai.APIStatusError) as failed:
        chat(client, False)
    assert failed.value.status_code == 502 and "no GEN worker granted" in failed.value.message
    assert gen.bodies == [] and ctx.control_paths() == [CONTEXT_ARTIFACT_ABORT_PATH]


def test_v1_off_by_configuration_before_v1_workers_is_a_503_for_the_operator() -> None:
    """v0 is what a v1 worker refuses: a deployment mismatch, said to the operator as a 5xx naming both settings,
    never sent to the workers to come back as a 400 that blames the client."""
    ctx, gen = v1("ctx"), v1("gen")
    v0_only = {"lifecycle_protocol": "v0"}
    with fleet([ctx], [gen], trtllm=v0_only) as (client, _), pytest.raises(openai.InternalServerError) as refused:
        chat(client, False)
    assert refused.value.status_code == 503
    assert "--lifecycle-protocol-version" in refused.value.message
    assert "trtllm.lifecycle_protocol" in refused.value.message
    assert ctx.bodies == [] and gen.bodies == [] and gen.calls == []


# -- GEN refuses, or its answer is lost -------------------------------------------------------------------------
def test_a_refused_grant_moves_to_one_other_gen_then_fails_and_frees_ctx() -> None:
    ctx, gens = v1("ctx"), [v1("gen", refuse_grants=1), v1("gen", refuse_grants=1)]
    with fleet([ctx], gens) as (client, node):
        with pytest.raises(openai.APIStatusError) as refused:
            chat(client, False)
        assert refused.value.status_code == 502 and events(node, "grant_refused") == 2
        assert chat(client, False) == FIRST + REST  # both now have room
    # Each GEN refused the first request once; the second request was granted by the first GEN it asked.
    assert sorted(g.control_paths() for g in gens) == [[GENERATION_GRANT_PATH], [GENERATION_GRANT_PATH] * 2]
    aborted = [body for path, body in ctx.calls if path == CONTEXT_ARTIFACT_ABORT_PATH]
    assert len(aborted) == 1 and identity(aborted[0]) == identity(params(ctx.bodies[0]))
    assert aborted[0]["context_endpoint_incarnation"] == ctx.instance_id
    assert sum(len(g.bodies) for g in gens) == 1  # GEN's request went only where the grant was made


def test_a_gen_that_refuses_is_passed_over_for_one_that_grants() -> None:
    ctx, full, free = v1("ctx"), v1("gen", refuse_grants=99), v1("gen")
    with fleet([ctx], [full, free]) as (client, _):
        for _ in range(2):  # round robin: one of the two starts at the full GEN
            assert chat(client, False) == FIRST + REST
    assert full.bodies == [] and len(free.bodies) == 2 and full.control_paths()
    assert ctx.calls == []  # nothing failed: nothing aborted


def test_an_ambiguous_admission_is_replayed_by_consumer_grant_id_then_aborted() -> None:
    ctx, gen = v1("ctx"), v1("gen", lose_grant_answers=1)
    with fleet([ctx], [gen]) as (client, node):
        with pytest.raises(openai.APIStatusError):
            chat(client, False)
        assert events(node, "grant_ambiguous") == 1 and events(node, "grant_aborted") == 1
    (first, grant), (replay, again), (abort, aborted) = gen.calls
    assert (first, replay, abort) == (GENERATION_GRANT_PATH, GENERATION_GRANT_PATH, GENERATION_GRANT_ABORT_PATH)
    assert again == grant and identity(aborted) == identity(grant)  # the same body, the same grant
    assert gen.grants == {grant["consumer_grant_id"]: "REVOKED"} and gen.bodies == []
    assert [path for path, _ in ctx.calls] == [CONTEXT_ARTIFACT_ABORT_PATH]


def _leave_during(node: Node, body: dict[str, Any], waiting: Callable[[], bool]) -> None:
    """A client that sends ``body`` and leaves (closes its connection) once ``waiting`` holds."""
    address = urlsplit(node.url)
    raw = orjson.dumps(body)
    with socket.create_connection((address.hostname, address.port)) as sock:
        sock.sendall(b"POST /v1/chat/completions HTTP/1.1\r\nhost: x\r\ncontent-type: application/json\r\n"
                     b"content-length: %d\r\n\r\n%s" % (len(raw), raw))
        assert eventually(waiting)


def test_a_client_gone_while_the_grant_is_in_flight_replays_and_aborts_it() -> None:
    """Cancelled mid-admission, the grant may exist on GEN: the admission is ambiguous, replayed and aborted."""
    ctx, gen = v1("ctx"), v1("gen", hold_grant_answers=1)
    with fleet([ctx], [gen]) as (_, node):
        body = {"model": MODEL, "messages": MESSAGES, "max_tokens": 8}
        _leave_during(node, body, lambda: GENERATION_GRANT_PATH in gen.control_paths())
        assert eventually(lambda: GENERATION_GRANT_ABORT_PATH in gen.control_paths())
        assert eventually(lambda: events(node, "grant_aborted") == 1 and events(node, "grant_ambiguous") == 1)
        gen.release_streams()
    (first, grant), (replay, again), (abort, aborted) = gen.calls
    assert (first, replay, abort) == (GENERATION_GRANT_PATH, GENERATION_GRANT_PATH, GENERATION_GRANT_ABORT_PATH)
    assert again == grant and identity(aborted) == identity(grant)
    assert gen.grants == {grant["consumer_grant_id"]: "REVOKED"} and gen.bodies == []
    assert eventually(lambda: ctx.control_paths() == [CONTEXT_ARTIFACT_ABORT_PATH])


# -- the grant while the request lives ------------------------------------------------------------------------
def test_the_grant_is_renewed_while_the_stream_lives() -> None:
    # Renewed every second: a renewal must come back within the grant's 3 s, which a busy 2-core machine allows
    # (a late renewal rightly ends the request).
    ctx, gen = v1("ctx"), v1("gen", grant_ttl_s=RENEWED_TTL_S, hold_streams=True)
    with fleet([ctx], [gen]) as (client, node):
        chunks = iter(client.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=8, stream=True))
        first = next(chunks)
        assert eventually(lambda: gen.control_paths().count(GENERATION_GRANT_RENEW_PATH) >= 2)
        gen.release_streams()
        rest = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
        assert (first.choices[0].delta.content or "") + rest == FIRST + REST
        assert events(node, "grant_renew_failed") == 0 and events(node, "grant_aborted") == 0
        assert events(node, "artifact_aborted") == 0
    renewals = [body for path, body in gen.calls if path == GENERATION_GRANT_RENEW_PATH]
    assert [r["sequence"] for r in renewals] == list(range(len(renewals)))
    assert all(r["ttl_s"] == 600 and r["generation_endpoint_incarnation"] == gen.instance_id for r in renewals)
    assert ctx.calls == []


def test_a_client_that_hangs_up_at_done_aborts_nothing() -> None:
    """The openai SDK closes the connection as soon as it reads ``[DONE]``, often before the orchestrator has read
    the end of GEN's body. The answer was whole and GEN released its grant: neither it nor CTX's artifact is
    aborted (they were, when only the end of GEN's body counted as the stream's end)."""
    hang_up_at_done_and_find_nothing_aborted()


def hang_up_at_done_and_find_nothing_aborted(**options: Any) -> None:
    ctx, gen = v1("ctx"), v1("gen", hold_end=True)  # GEN's body stays open after [DONE] until released
    with fleet([ctx], [gen], **options) as (client, node):
        assert chat(client, stream=True) == FIRST + REST
        # The request is counted once its stream is closed and settled, aborts (if any) sent.
        assert eventually(lambda: total(node.app.state.metrics, "disagg_requests_total") == 1)
        gen.release_streams()
        assert events(node, "artifact_aborted") == events(node, "grant_aborted") == 0
        assert events(node, "artifact_aborted_failed") == events(node, "grant_aborted_failed") == 0
    assert ctx.calls == [] and GENERATION_GRANT_ABORT_PATH not in gen.control_paths()
    assert list(gen.grants.values()) == ["RELEASED"]


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "stream"])
def test_a_renewal_answered_released_stops_renewing_and_the_answer_arrives_whole(stream: bool) -> None:
    """GEN finished and released its grant while its answer is still on the way (a slow client, a paused relay):
    a renewal then answers accepted: false, RELEASED, which is no lost grant. Renewal stops; nothing is cut."""
    # The first renewal, a second after the grant, falls in the two seconds GEN holds its answer's rest.
    ctx, gen = v1("ctx"), v1("gen", grant_ttl_s=RENEWED_TTL_S, release_early_s=2.0)
    with fleet([ctx], [gen]) as (client, node):
        assert chat(client, stream) == FIRST + REST
        assert events(node, "grant_renew_failed") == 0 and events(node, "grant_aborted") == 0
    assert gen.control_paths().count(GENERATION_GRANT_RENEW_PATH) == 1  # the one answered RELEASED, then none
    assert GENERATION_GRANT_ABORT_PATH not in gen.control_paths() and ctx.calls == []
    assert list(gen.grants.values()) == ["RELEASED"]


def test_a_grant_that_cannot_be_renewed_ends_the_stream_and_frees_both() -> None:
    ctx, gen = v1("ctx"), v1("gen", grant_ttl_s=0.6, hold_streams=True, refuse_renewals=True)
    with fleet([ctx], [gen]) as (client, node):
        chunks = iter(client.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=8, stream=True))
        next(chunks)
        assert eventually(lambda: GENERATION_GRANT_ABORT_PATH in gen.control_paths())
        assert eventually(lambda: CONTEXT_ARTIFACT_ABORT_PATH in ctx.control_paths())
        assert events(node, "grant_renew_failed") == 1
        with contextlib.suppress(openai.APIError):  # cut short: an error event, or the end of a broken stream
            text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
            assert REST not in text
        gen.release_streams()


def test_a_client_gone_mid_stream_aborts_the_grant_and_the_artifact() -> None:
    ctx, gen = v1("ctx"), v1("gen", hold_streams=True)
    with fleet([ctx], [gen]) as (client, node):
        stream = client.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=8, stream=True)
        next(iter(stream))
        stream.close()  # the client leaves
        assert eventually(lambda: GENERATION_GRANT_ABORT_PATH in gen.control_paths())
        assert eventually(lambda: CONTEXT_ARTIFACT_ABORT_PATH in ctx.control_paths())
        assert eventually(lambda: events(node, "grant_aborted") == 1 and events(node, "artifact_aborted") == 1)
        gen.release_streams()
    (_, grant), (_, abort) = gen.calls
    assert identity(abort) == identity(grant) and gen.grants[grant["consumer_grant_id"]] == "REVOKED"


@contextlib.asynccontextmanager
async def _admitted(ctx: TrtllmWorker, gen: TrtllmWorker) -> AsyncIterator[tuple[LifecycleClient, Attempt]]:
    """A real grant on ``gen`` for an attempt whose CTX request was sent, both workers over HTTP."""
    with running(ctx.app()) as ctx_url, running(gen.app()) as gen_url:
        members = [PoolMember(make_transport(url, WorkerTimeouts())) for url in (ctx_url, gen_url)]
        try:
            for member in members:
                await read_server_info(member)
            client = LifecycleClient(TrtllmConfig(), Metrics())
            attempt = client.begin(members[0], 7)
            assert await client.admit(attempt, members[1])
            attempt.ctx_sent = True
            yield client, attempt
        finally:
            for member in members:
                await member.transport.aclose()


async def test_settle_aborts_both_even_when_the_renewal_died_of_an_unexpected_error() -> None:
    ctx, gen = v1("ctx"), v1("gen")
    async with _admitted(ctx, gen) as (client, attempt):
        async def broken() -> None:
            raise RuntimeError("a bug in the renewal")

        attempt.renewal = asyncio.get_running_loop().create_task(broken())
        await asyncio.sleep(0)
        await client.settle(attempt, ok=False, reason="test")
    assert gen.control_paths() == [GENERATION_GRANT_PATH, GENERATION_GRANT_ABORT_PATH]
    assert ctx.control_paths() == [CONTEXT_ARTIFACT_ABORT_PATH]


async def test_settle_aborts_both_and_keeps_the_callers_own_cancellation() -> None:
    ctx, gen = v1("ctx"), v1("gen")
    async with _admitted(ctx, gen) as (client, attempt):
        ending, end = asyncio.Event(), asyncio.Event()

        async def slow_to_stop() -> None:  # a renewal whose POST takes a while to give up
            try:
                await asyncio.sleep(60)
            except asyncio.CancelledError:
                ending.set()
                await end.wait()
                raise

        attempt.renewal = asyncio.get_running_loop().create_task(slow_to_stop())
        await asyncio.sleep(0)
        settling = asyncio.get_running_loop().create_task(client.settle(attempt, ok=False, reason="test"))
        await ending.wait()
        assert await eventually_async(lambda: CONTEXT_ARTIFACT_ABORT_PATH in ctx.control_paths())
        settling.cancel()  # the client leaves while settle waits on the renewal
        end.set()
        await asyncio.wait([settling])
        assert settling.cancelled()
    assert gen.control_paths() == [GENERATION_GRANT_PATH, GENERATION_GRANT_ABORT_PATH]


@pytest.mark.parametrize("answered", [False, True], ids=["unanswered", "answered"])
async def test_a_grant_lost_after_the_end_marker_leaves_the_stream_a_success(answered: bool) -> None:
    """``answered`` is final: a renewal that fails once GEN sent its end marker (GEN had released the grant) does
    not turn the request into a failure when the stream is then read to its end; before the marker, it does."""
    settled: list[bool] = []

    async def settle(ok: bool) -> None:
        settled.append(ok)

    lost: asyncio.Future[None] = asyncio.get_running_loop().create_future()
    gen = ScriptedStream(200, [b"data: [DONE]\n\n"])
    stream = SettledStream(gen, settle, lost)
    if answered:
        stream.answered()
    lost.set_result(None)
    assert [chunk async for chunk in stream.chunks()] == [b"data: [DONE]\n\n"]
    await stream.aclose()
    assert settled == [answered]


# -- CTX fails ----------------------------------------------------------------------------------------------------
def test_a_failed_ctx_attempt_is_aborted_and_the_retry_is_a_new_identity() -> None:
    flaky, good, gen = v1("ctx", fail_next=2), v1("ctx"), v1("gen")
    with fleet([flaky, good], [gen]) as (client, _):
        for _ in range(2):  # round robin: one request reaches the flaky CTX first and fails there
            assert chat(client, False) == FIRST + REST
    failed = [params(raw) for raw in flaky.bodies]
    aborted = [body for path, body in flaky.calls if path == CONTEXT_ARTIFACT_ABORT_PATH]
    assert failed and [identity(a) for a in aborted] == [identity(f) for f in failed]
    granted = {body["consumer_grant_id"] for _, body in gen.calls}
    assert granted == {params(raw)["consumer_grant_id"] for raw in good.bodies}
    assert not granted & {f["consumer_grant_id"] for f in failed}  # never the failed attempt's identity again


def test_a_ctx_that_echoes_another_contract_fails_the_request_and_is_aborted() -> None:
    ctx, gen = v1("ctx", corrupt_echo=True), v1("gen")
    with fleet([ctx], [gen]) as (client, node):
        with pytest.raises(openai.APIStatusError) as failed:
            chat(client, False)
        assert failed.value.status_code == 502 and events(node, "echo_mismatch") == 1
    assert "conflicting lifecycle contract" in failed.value.message
    assert ctx.control_paths() == [CONTEXT_ARTIFACT_ABORT_PATH] and gen.calls == [] and gen.bodies == []


# -- the bodies we send, against TensorRT-LLM's models ----------------------------------------------------------
def _sent_bodies() -> dict[str, dict[str, Any]]:
    ctx, gen = v1("ctx"), v1("gen", grant_ttl_s=RENEWED_TTL_S, hold_streams=True)
    with fleet([ctx], [gen]) as (client, _):
        stream = client.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=8, stream=True)
        next(iter(stream))
        assert eventually(lambda: GENERATION_GRANT_RENEW_PATH in gen.control_paths())
        stream.close()
        assert eventually(lambda: CONTEXT_ARTIFACT_ABORT_PATH in ctx.control_paths()
                          and GENERATION_GRANT_ABORT_PATH in gen.control_paths())
        gen.release_streams()
    return {path: body for path, body in [*gen.calls, *ctx.calls]}


MODELS: dict[str, type[BaseModel]] = {
    GENERATION_GRANT_PATH: GenerationGrantRequest, GENERATION_GRANT_RENEW_PATH: GenerationGrantRenewRequest,
    GENERATION_GRANT_ABORT_PATH: GenerationGrantAbortRequest, CONTEXT_ARTIFACT_ABORT_PATH: ContextArtifactAbortRequest,
}


def test_every_control_body_fails_trtllm_models_with_a_field_dropped_or_renamed() -> None:
    bodies = _sent_bodies()
    assert set(bodies) == set(MODELS)
    for path, body in bodies.items():
        model = MODELS[path]
        model.model_validate(body)  # as sent: valid
        for name in body:
            with pytest.raises(ValidationError):
                model.model_validate({**{k: v for k, v in body.items() if k != name}, f"{name}_x": body[name]})
            if model.model_fields[name].is_required():
                with pytest.raises(ValidationError):
                    model.model_validate({k: v for k, v in body.items() if k != name})

"""Generation first (``orchestrator/protocols/trtllm/generation_first.py``): our orchestrator in front of
strict trtllm-serve workers (``trtllm_worker``), v0 and lifecycle v1, over real HTTP, the official client as the
client: GEN sent first and CTX after, a GEN that cannot passed over, a CTX that finishes alone, a GEN that fails
first.
"""

from __future__ import annotations

import openai
import orjson
import pytest

from frontend.trtllm.lifecycle import CONTEXT_ARTIFACT_ABORT_PATH, GENERATION_GRANT_ABORT_PATH, GENERATION_GRANT_PATH
from tests.orchestrator.protocols.trtllm.test_lifecycle import (
    chat,
    fleet,
    hang_up_at_done_and_find_nothing_aborted,
    identity,
    params,
    v1,
)
from tests.orchestrator.protocols.trtllm.test_wire import MESSAGES
from tests.orchestrator.protocols.trtllm.trtllm_worker import FIRST, MODEL, REST, TrtllmWorker
from tests.waiting import eventually

GEN_FIRST = {"trtllm": {"schedule_style": "generation_first"}}


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "stream"])
@pytest.mark.parametrize("lifecycle", [False, True], ids=["v0", "v1"])
def test_generation_first_sends_gen_first_and_ctx_after(stream: bool, lifecycle: bool) -> None:
    order: list[str] = []
    ctx = TrtllmWorker("ctx", lifecycle_v1=lifecycle, order=order)
    gen = TrtllmWorker("gen", lifecycle_v1=lifecycle, order=order)
    with fleet([ctx], [gen], **GEN_FIRST) as (client, _):
        assert chat(client, stream) == FIRST + REST
    assert ctx.refused == [] and gen.refused == []
    sent_ctx, sent_gen = params(ctx.bodies[0]), params(gen.bodies[0])
    assert sent_ctx["schedule_style"] == sent_gen["schedule_style"] == 1
    assert sent_gen["ctx_request_id"] == sent_gen["disagg_request_id"] == sent_ctx["disagg_request_id"]
    assert sent_gen["ctx_info_endpoint"] == "tcp://context:9000"  # the CTX's /server_info, list to string
    assert orjson.loads(gen.bodies[0])["messages"] == [dict(m) for m in MESSAGES]  # the client's prompt
    if lifecycle:
        # The grant before anything is sent; CTX carries the admitted GEN's identity.
        assert order[0] == f"gen {GENERATION_GRANT_PATH}" and gen.calls[0][1]["schedule_style"] == 1
        assert sent_ctx["generation_endpoint_incarnation"] == gen.instance_id
        assert identity(sent_ctx) == identity(sent_gen) and gen.control_paths().count(GENERATION_GRANT_ABORT_PATH) == 0
        assert ctx.calls == []
    else:
        assert gen.calls == [] and "consumer_grant_id" not in sent_gen


def test_generation_first_with_a_gen_that_cannot_stays_context_first() -> None:
    """A v1 GEN without GENERATION_FIRST is never chosen for generation first; with no other, context first."""
    ctx, gen = v1("ctx"), v1("gen", generation_first=False)
    with fleet([ctx], [gen], **GEN_FIRST) as (client, _):
        assert chat(client, False) == FIRST + REST
    assert ctx.refused == [] and gen.refused == [] and ctx.calls == []
    assert params(ctx.bodies[0])["schedule_style"] == 0 and "generation_endpoint_name" not in params(ctx.bodies[0])
    assert gen.control_paths() == [GENERATION_GRANT_PATH] and gen.calls[0][1]["schedule_style"] == 0


def test_generation_first_passes_over_a_gen_that_cannot() -> None:
    ctx, unable, able = v1("ctx"), v1("gen", generation_first=False), v1("gen")
    with fleet([ctx], [unable, able], **GEN_FIRST) as (client, _):
        for _ in range(2):  # round robin: one of the two starts at the GEN that cannot
            assert chat(client, False) == FIRST + REST
    assert unable.calls == [] and unable.bodies == [] and len(able.bodies) == 2
    assert all(params(raw)["schedule_style"] == 1 for raw in ctx.bodies)


def test_generation_first_where_ctx_finishes_alone_drops_gen_and_its_grant() -> None:
    ctx, gen = v1("ctx"), v1("gen")
    with fleet([ctx], [gen], **GEN_FIRST) as (client, _):
        reply = client.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=1)
        assert reply.choices[0].message.content == FIRST
        assert eventually(lambda: GENERATION_GRANT_ABORT_PATH in gen.control_paths())


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "stream"])
@pytest.mark.parametrize("lifecycle", [False, True], ids=["v0", "v1"])
def test_generation_first_fails_at_once_when_gen_fails_before_ctx_answers(lifecycle: bool, stream: bool) -> None:
    """GEN's leg failed while CTX still prefills: the request ends with GEN's error now, not when CTX answers;
    CTX's leg is dropped and, under v1, the grant and the artifact aborted."""
    ctx = TrtllmWorker("ctx", lifecycle_v1=lifecycle, hold_context=True)
    gen = TrtllmWorker("gen", lifecycle_v1=lifecycle, fail_next=1)
    with fleet([ctx], [gen], **GEN_FIRST) as (client, _):
        with pytest.raises(openai.APIStatusError) as failed:
            client.with_options(timeout=10).chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=8,
                                                                    stream=stream)
        assert failed.value.status_code == 503 and "engine unavailable" in failed.value.message
        if lifecycle:
            assert eventually(lambda: GENERATION_GRANT_ABORT_PATH in gen.control_paths())
            assert eventually(lambda: CONTEXT_ARTIFACT_ABORT_PATH in ctx.control_paths())
        ctx.release_streams()


def test_generation_first_where_the_client_hangs_up_at_done_aborts_nothing() -> None:
    """GEN's stream, sent first under its grant, is settled like a context-first one: its end marker sent, the
    request succeeded, even if the client leaves before the end of GEN's body is read."""
    hang_up_at_done_and_find_nothing_aborted(**GEN_FIRST)

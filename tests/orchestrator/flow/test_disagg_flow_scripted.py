"""The flow over scripted workers: what only a scripted worker can make happen on cue (a GEN that refuses after
another failed, a 503 before the first byte), watched at the transport boundary."""

from __future__ import annotations

from contextlib import aclosing
from typing import Any

import orjson
import pytest

from frontend.config import parse_config
from frontend.errors import RelayedError, UpstreamUnavailableError
from frontend.guardrail import GenEngineFacts
from frontend.metrics import Metrics
from orchestrator.flow.disagg_flow import DisaggFlow
from orchestrator.flow.request import StreamedAnswer, WholeAnswer
from orchestrator.pool import WorkerPool
from orchestrator.routers import RoundRobinRouter
from orchestrator.upstream.base import Reply, WorkerTimeouts
from tests.cluster import sample
from tests.orchestrator.upstream.scripted_transport import ScriptedStream, ScriptedTransport, ScriptedTransports, Step
from tests.waiting import eventually_async

CTX, GEN_A, GEN_B = "http://ctx:1", "http://gen-a:1", "http://gen-b:1"
B64 = "AQAAAAIAAAADAAAA"
CTX_ANSWER = Reply(200, orjson.dumps({
    "id": "c", "object": "chat.completion", "prompt_token_ids_b64": B64,
    "choices": [{"index": 0, "message": {"role": "assistant", "content": "T"}, "finish_reason": None,
                 "disaggregated_params": {"request_type": "context_only", "ctx_request_id": "c1",
                                          "first_gen_tokens": [84], "encoded_opaque_state": "c3Q=",
                                          "prompt_len": 3}}]}))
GEN_ANSWER = Reply(200, b'{"id": "g", "choices": []}')
STREAM = [b'data: {"choices": []}\n\n', b"data: [DONE]\n\n"]


def flow_over(scripts: dict[str, list[Step]], **options: Any) -> tuple[DisaggFlow, dict[str, ScriptedTransport]]:
    gen_urls = [u for u in scripts if u != CTX]
    config = parse_config({"context_servers": {"urls": [CTX]}, "generation_servers": {"urls": gen_urls}, **options})
    transports = ScriptedTransports(scripts)

    def pool(name: str, urls: list[str]) -> WorkerPool:
        pool = WorkerPool(name, RoundRobinRouter(), WorkerTimeouts(), transport_factory=transports)
        for url in urls:
            member = pool.add(url)
            member.healthy = True
            member.facts = GenEngineFacts(kv_block_reuse=False, prompt_tokens_in_handoff=False)
        return pool

    return DisaggFlow(config, pool("ctx", [CTX]), pool("gen", gen_urls), Metrics()), transports.by_url


def chat(**extra: Any) -> dict[str, Any]:
    return {"model": "m", "messages": [{"role": "user", "content": "x" * 400}], "max_tokens": 4, **extra}


async def test_a_metadata_only_fallback_is_counted_once_however_many_gen_attempts() -> None:
    flow, transports = flow_over({CTX: [CTX_ANSWER], GEN_A: [UpstreamUnavailableError("refused")],
                                  GEN_B: [GEN_ANSWER]}, gen_tokids_metadata_only=True)
    answer = await flow.run(flow.new_request("chat", chat(frequency_penalty=0.5), 0.0))
    assert answer == WholeAnswer(GEN_ANSWER.content)
    gen_bodies = [c.body for url in (GEN_A, GEN_B) for c in transports[url].calls]
    assert len(gen_bodies) == 2
    for body in gen_bodies:  # the fallback relays the real tokens, as CTX sent them
        assert body is not None and b'"prompt_token_ids_b64":"' + B64.encode() + b'"' in body
    assert sample(flow.metrics, "disagg_metadata_only_fallback_total", reason="frequency_penalty") == 1


async def test_a_gen_refusal_is_relayed_as_it_came_and_the_hand_off_released() -> None:
    refusal = Reply(400, b'{"error": {"message": "no", "type": "invalid_request_error", "param": null,'
                         b' "code": null}}')
    flow, transports = flow_over({CTX: [CTX_ANSWER, Reply(200, b'{"released": true}')], GEN_A: [refusal]})
    with pytest.raises(RelayedError) as caught:
        await flow.run(flow.new_request("chat", chat(), 0.0))
    assert caught.value.status_code == 400
    assert caught.value.content is refusal.content
    ctx_calls = transports[CTX].calls
    assert await eventually_async(lambda: len(ctx_calls) == 2)
    assert ctx_calls[1].path == "/v1/disagg/release"


async def test_a_stream_refused_before_its_first_byte_moves_to_another_gen_and_closes_the_refusal() -> None:
    refused = ScriptedStream(503, [b'{"error": {}}'])
    flow, transports = flow_over({CTX: [CTX_ANSWER], GEN_A: [refused], GEN_B: [ScriptedStream(200, STREAM)]})
    request = flow.new_request("chat", chat(stream=True), 0.0)
    answer = await flow.run(request)
    assert isinstance(answer, StreamedAnswer)
    # (one piece: this GEN writes no token ids, so its frames are held until the end marker)
    assert b"".join([frame async for frame in answer.frames]) == b"".join(STREAM)
    assert refused.closed
    assert transports[GEN_B].opened[0].closed
    assert request.gen_worker == GEN_B
    assert sample(flow.metrics, "disagg_upstream_retries_total", step="gen", reason="status_5xx") == 1
    assert all(w.inflight == 0 for w in flow.gen_pool.workers)


async def test_a_stream_whose_relay_never_started_is_closed_by_close_upstream() -> None:
    """The client left while the answer's status line was being sent: the relay's generators were closed before
    they started, which runs none of their cleanup. The server then calls close_upstream, and GEN is told."""
    stream = ScriptedStream(200, STREAM)
    flow, _ = flow_over({CTX: [CTX_ANSWER], GEN_A: [stream]})
    answer = await flow.run(flow.new_request("chat", chat(stream=True), 0.0))
    assert isinstance(answer, StreamedAnswer)
    async with aclosing(answer.frames):  # type: ignore[type-var]  # what the server's exchange does
        pass
    assert not stream.closed  # a generator closed before it started runs no finally
    await answer.close_upstream()
    assert stream.closed and stream.iterated == []
    await answer.close_upstream()  # and again, as after a relay that closed it itself: harmless

"""The schedule and the wire chosen for a request: what TensorRT-LLM's wire cannot carry (the Responses API, n > 1,
the prompt's logprobs) goes over our native wire where both workers speak it too, and is refused, whatever its
placement, where they speak TensorRT-LLM's only."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import httpx
import orjson
import pytest

from tests.cluster import MODEL, Node, start_orchestrator, start_worker
from tests.orchestrator.protocols.trtllm.trtllm_worker import TrtllmWorker
from tests.servers import running
from workers.trtllm.settings import LifecycleSettings

CHAT = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 3}
UNCARRIED = {  # what TensorRT-LLM's wire cannot carry: (path, body, the parameter named in a refusal)
    "responses": ("/v1/responses", {"model": MODEL, "input": "hi", "max_output_tokens": 3}, "input"),
    "prompt-logprobs": ("/v1/chat/completions", {**CHAT, "prompt_logprobs": 1}, "prompt_logprobs"),
    "echo-logprobs": ("/v1/completions", {"model": MODEL, "prompt": "hi there", "max_tokens": 1, "echo": True,
                                          "logprobs": 1}, "echo"),
    "n2": ("/v1/chat/completions", {**CHAT, "n": 2}, "n"),
}


def post(node: Node, path: str, body: dict[str, Any]) -> httpx.Response:
    return httpx.post(node.url + path, json=body, timeout=60)


def ctx_bodies(ctx: Node) -> list[dict[str, Any]]:
    assert ctx.recorder is not None
    return [orjson.loads(e.request_body) for e in ctx.recorder.exchanges
            if e.method == "POST" and e.path.startswith("/v1/")]


@pytest.fixture(scope="module")
def ours_on_trtllm() -> Iterator[tuple[Node, Node]]:
    """(an orchestrator set to speak TensorRT-LLM's wire, its CTX): our workers, which speak ours as well."""
    with contextlib.ExitStack() as stack:
        ctx, gen = start_worker(stack, "context"), start_worker(stack, "generation")
        yield start_orchestrator(stack, [ctx.url], [gen.url], context_servers={"urls": [ctx.url], "protocol": "trtllm"},
                                 generation_servers={"urls": [gen.url], "protocol": "trtllm"}), ctx


@pytest.mark.parametrize("case", ["responses", "prompt-logprobs", "echo-logprobs"])
def test_what_trtllms_wire_cannot_carry_goes_over_ours_where_both_workers_speak_it(
        ours_on_trtllm: tuple[Node, Node], case: str) -> None:
    orchestrator, ctx = ours_on_trtllm
    path, body, _ = UNCARRIED[case]
    before = len(ctx_bodies(ctx))
    reply = post(orchestrator, path, body)
    assert reply.status_code == 200, reply.text
    sent = ctx_bodies(ctx)[before:]
    assert len(sent) == 1 and sent[0]["disaggregated_params"].get("native_extensions") is True  # our wire, via CTX
    if case == "echo-logprobs":  # the prompt's scores: real, as the aggregated worker gives them
        assert all(v is not None for v in reply.json()["choices"][0]["logprobs"]["token_logprobs"][1:])


def test_an_echo_with_logprobs_goes_over_ours_whatever_its_max_tokens(ours_on_trtllm: tuple[Node, Node]) -> None:
    """TensorRT-LLM's wire carries the prompt's logprobs only where GEN answers: one CTX ends at its first token
    (EOS, a stop) would lose them, so where both workers speak ours it goes over ours."""
    orchestrator, ctx = ours_on_trtllm
    path, body, _ = UNCARRIED["echo-logprobs"]
    before = len(ctx_bodies(ctx))
    reply = post(orchestrator, path, {**body, "max_tokens": 3})
    assert reply.status_code == 200, reply.text
    (sent,) = ctx_bodies(ctx)[before:]
    assert sent["disaggregated_params"].get("native_extensions") is True


def test_what_trtllms_wire_carries_stays_on_it(ours_on_trtllm: tuple[Node, Node]) -> None:
    orchestrator, ctx = ours_on_trtllm
    before = len(ctx_bodies(ctx))
    assert post(orchestrator, "/v1/chat/completions", CHAT).status_code == 200
    (sent,) = ctx_bodies(ctx)[before:]
    assert "native_extensions" not in sent["disaggregated_params"]


@pytest.mark.parametrize("local", [0, 1_000_000], ids=["through-ctx", "gen-alone"])
@pytest.mark.parametrize("case", sorted(UNCARRIED))
def test_trtllm_serve_workers_refuse_it_alike_whatever_the_placement(case: str, local: int) -> None:
    path, body, param = UNCARRIED[case]
    ctx, gen = TrtllmWorker("ctx"), TrtllmWorker("gen")
    with contextlib.ExitStack() as stack:
        ctx_url, gen_url = stack.enter_context(running(ctx.app())), stack.enter_context(running(gen.app()))
        orchestrator = start_orchestrator(stack, [ctx_url], [gen_url], max_local_prefill_length=local)
        reply = post(orchestrator, path, body)
    assert reply.status_code == 400, reply.text
    error = reply.json()["error"]
    assert "is not served over TensorRT-LLM's disaggregated wire" in error["message"]
    assert "trtllm-serve" in error["message"] and "disagg_protocols" in error["message"]
    assert error["param"] == param
    assert ctx.bodies == [] and gen.bodies == []


def test_our_workers_started_with_lifecycle_v1_serve_it_over_our_wire() -> None:
    """Lifecycle v1 governs TensorRT-LLM's wire only: our v1 workers, behind an orchestrator of default
    configuration, take what that wire carries in v1 and what it cannot carry over ours."""
    v1 = LifecycleSettings(protocol_version=1)
    with contextlib.ExitStack() as stack:
        ctx, gen = start_worker(stack, "context", lifecycle=v1), start_worker(stack, "generation", lifecycle=v1)
        orchestrator = start_orchestrator(stack, [ctx.url], [gen.url])
        assert post(orchestrator, "/v1/chat/completions", CHAT).status_code == 200
        before = len(ctx_bodies(ctx))
        # n > 1 is in the answer matrix: the synthetic engine samples one sequence.
        for case in ("responses", "prompt-logprobs", "echo-logprobs"):
            reply = post(orchestrator, *UNCARRIED[case][:2])
            assert reply.status_code == 200, (case, reply.text)
        sent = ctx_bodies(ctx)[:before]
        assert sent[-1]["disaggregated_params"].get("context_transceiver_lifecycle") is not None  # chat: v1
        assert all(body["disaggregated_params"].get("native_extensions") is True for body in ctx_bodies(ctx)[before:])

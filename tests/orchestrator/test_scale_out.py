"""Conditional disaggregation (short prompts go to GEN alone) and X-Request-Id propagation, on real servers."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import httpx
import openai
import pytest

from tests.cluster import MODEL, Node, sample, start_orchestrator, start_worker
from tests.waiting import eventually
from workers.engines.synthetic import synthetic_text

LOCAL_LIMIT = 100  # tokens, as the orchestrator estimates them (~4 characters a token)


@dataclass
class Nodes:
    ctx: Node
    gen: Node
    split: Node  # always disaggregates
    local: Node  # max_local_prefill_length = LOCAL_LIMIT


@pytest.fixture(scope="module")
def nodes() -> Iterator[Nodes]:
    with contextlib.ExitStack() as stack:
        ctx, gen = start_worker(stack, "context"), start_worker(stack, "generation")
        split = start_orchestrator(stack, [ctx.url], [gen.url])
        local = start_orchestrator(stack, [ctx.url], [gen.url], max_local_prefill_length=LOCAL_LIMIT)
        yield Nodes(ctx, gen, split, local)


def _posts(node: Node) -> int:
    return len([e for e in node.recorder.posts() if e.path.startswith("/v1/")])


# -- conditional disaggregation ----------------------------------------------------------------------------------
@pytest.mark.parametrize("stream", [False, True], ids=["whole", "stream"])
def test_a_short_prompt_goes_to_gen_alone_and_answers_the_same(nodes: Nodes, stream: bool) -> None:
    ctx_before, gen_before = _posts(nodes.ctx), _posts(nodes.gen)
    local_before = sample(nodes.local.metrics, "disagg_local_prefill_requests_total")
    messages: Any = [{"role": "user", "content": "short question"}]
    with openai.OpenAI(base_url=nodes.local.url + "/v1", api_key="x", max_retries=0, timeout=30) as local, \
            openai.OpenAI(base_url=nodes.split.url + "/v1", api_key="x", max_retries=0, timeout=30) as split:
        if stream:
            chunks = list(local.chat.completions.create(model=MODEL, messages=messages, max_tokens=9, stream=True,
                                                        stream_options={"include_usage": True}))
            text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
            usage = chunks[-1].usage
        else:
            reply = local.chat.completions.create(model=MODEL, messages=messages, max_tokens=9)
            text, usage = reply.choices[0].message.content or "", reply.usage
        reference = split.chat.completions.create(model=MODEL, messages=messages, max_tokens=9)
    assert text == synthetic_text(9) == reference.choices[0].message.content
    assert usage == reference.usage
    # One request split (the reference): CTX saw exactly that one; GEN saw both.
    assert _posts(nodes.ctx) == ctx_before + 1
    assert _posts(nodes.gen) == gen_before + 2
    assert sample(nodes.local.metrics, "disagg_local_prefill_requests_total") == local_before + 1
    local_body = [e for e in nodes.gen.recorder.posts() if e.path.startswith("/v1/")][gen_before].request_json()
    assert "disaggregated_params" not in local_body  # a plain request: GEN prefills it itself
    assert sample(nodes.split.metrics, "disagg_local_prefill_requests_total") == 0


def test_a_prompt_over_the_limit_is_still_split(nodes: Nodes) -> None:
    ctx_before = _posts(nodes.ctx)
    local_before = sample(nodes.local.metrics, "disagg_local_prefill_requests_total")
    with openai.OpenAI(base_url=nodes.local.url + "/v1", api_key="x", max_retries=0, timeout=30) as local:
        reply = local.completions.create(model=MODEL, prompt="x" * (LOCAL_LIMIT * 4 + 8), max_tokens=5)
    assert reply.choices[0].text == synthetic_text(5)
    assert _posts(nodes.ctx) == ctx_before + 1
    assert sample(nodes.local.metrics, "disagg_local_prefill_requests_total") == local_before


def test_a_local_prefill_error_is_relayed_as_the_workers_own(nodes: Nodes) -> None:
    reply = httpx.post(nodes.local.url + "/v1/chat/completions",
                       json={"model": MODEL, "messages": [{"role": "user", "content": "x"}], "max_tokens": 0},
                       timeout=10)
    assert reply.status_code == 400
    assert reply.json()["error"]["param"] == "max_tokens"


# -- X-Request-Id --------------------------------------------------------------------------------------------------
def _exchanges_after(node: Node, before: int) -> list[Any]:
    return [e for e in node.recorder.posts() if e.path.startswith("/v1/")][before:]


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "stream"])
def test_the_clients_request_id_reaches_both_workers_and_comes_back(nodes: Nodes, stream: bool) -> None:
    ctx_before, gen_before = _posts(nodes.ctx), _posts(nodes.gen)
    request_id = f"client-chosen-id-{stream}"
    body = {"model": MODEL, "messages": [{"role": "user", "content": "trace me"}], "max_tokens": 4, "stream": stream}
    with httpx.Client(timeout=30) as http:
        reply = http.post(nodes.split.url + "/v1/chat/completions", json=body, headers={"X-Request-Id": request_id})
    assert reply.status_code == 200
    assert reply.headers["x-request-id"] == request_id
    (ctx_exchange,) = _exchanges_after(nodes.ctx, ctx_before)
    (gen_exchange,) = _exchanges_after(nodes.gen, gen_before)
    assert ctx_exchange.headers["x-request-id"] == request_id
    assert gen_exchange.headers["x-request-id"] == request_id


def test_a_request_id_is_made_when_the_client_sends_none(nodes: Nodes) -> None:
    ctx_before, gen_before = _posts(nodes.ctx), _posts(nodes.gen)
    ids = []
    with httpx.Client(timeout=30) as http:
        for _ in range(2):
            reply = http.post(nodes.split.url + "/v1/completions", json={"model": MODEL, "prompt": "p",
                                                                         "max_tokens": 3})
            assert reply.status_code == 200
            ids.append(reply.headers["x-request-id"])
    assert len(set(ids)) == 2 and all(ids)
    assert [e.headers["x-request-id"] for e in _exchanges_after(nodes.ctx, ctx_before)] == ids
    assert [e.headers["x-request-id"] for e in _exchanges_after(nodes.gen, gen_before)] == ids


def test_the_request_id_reaches_gen_alone_on_local_prefill_and_comes_back_on_errors(nodes: Nodes) -> None:
    gen_before = _posts(nodes.gen)
    with httpx.Client(timeout=30) as http:
        reply = http.post(nodes.local.url + "/v1/completions", json={"model": MODEL, "prompt": "p", "max_tokens": 3},
                          headers={"X-Request-Id": "local-1"})
        assert reply.status_code == 200 and reply.headers["x-request-id"] == "local-1"
        (gen_exchange,) = _exchanges_after(nodes.gen, gen_before)
        assert gen_exchange.headers["x-request-id"] == "local-1"
        refused = http.post(nodes.split.url + "/v1/completions", json={"model": "nope", "prompt": "p"},
                            headers={"X-Request-Id": "err-1"})
        assert refused.status_code == 404
        assert refused.headers["x-request-id"] == "err-1"
    assert eventually(lambda: sample(nodes.split.metrics, "disagg_engine_inflight_requests", role="orchestrator") == 0)


@pytest.mark.parametrize("body", [b"{not json", b'{"prompt": "no model"}'], ids=["malformed", "no-model"])
def test_the_request_id_comes_back_on_the_orchestrators_own_errors(nodes: Nodes, body: bytes) -> None:
    reply = httpx.post(nodes.split.url + "/v1/completions", content=body, headers={"X-Request-Id": "own-err"},
                       timeout=10)
    assert reply.status_code == 400
    assert reply.headers.get("x-request-id") == "own-err"

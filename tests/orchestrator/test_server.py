"""The orchestrator's HTTP surface, driven by the official ``openai`` client through real CTX and GEN workers."""

from __future__ import annotations

import contextlib
import socket
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import httpx
import openai
import orjson
import pytest
from prometheus_client.parser import text_string_to_metric_families

from bench.driver.common import open_raw_post
from frontend.openai_output import Endpoint
from tests.cluster import (
    MODEL,
    Cluster,
    Node,
    assert_a_null_stream_is_a_whole_answer,
    sample,
    start_orchestrator,
    start_worker,
)
from tests.waiting import eventually
from workers.engines.byte_tokenizer import ByteTokenizer
from workers.engines.synthetic import SYNTHETIC_TEXT

MESSAGES: Any = [
    {"role": "system", "content": "Be brief."},
    {"role": "user", "content": "What is the capital of France? ünïcödé"},
]
PROMPT = "Once upon a time"
TOKENIZER = ByteTokenizer(50_000)
RESPONSES_EVENTS = [
    "response.created",
    "response.in_progress",
    "response.output_item.added",
    "response.content_part.added",
]
RESPONSES_END = ["response.output_text.done", "response.content_part.done", "response.output_item.done"]


def synthetic_text(n: int) -> str:
    return bytes(SYNTHETIC_TEXT[i % len(SYNTHETIC_TEXT)] for i in range(n)).decode()


def chat_prompt_len(messages: list[dict[str, Any]]) -> int:
    return int(TOKENIZER.encode(TOKENIZER.render_chat(messages)).size)


def expected_prompt_len(endpoint: Endpoint) -> int:
    if endpoint == "completions":
        return len(PROMPT.encode())
    if endpoint == "responses":
        return chat_prompt_len([{"role": "user", "content": PROMPT}])
    return chat_prompt_len(MESSAGES)


@dataclass(frozen=True)
class Outcome:
    text: str
    prompt_tokens: int
    completion_tokens: int
    finish: str | None
    events: tuple[str, ...] = ()


def generate(client: openai.OpenAI, endpoint: Endpoint, stream: bool, max_tokens: int) -> Outcome:
    """One request through ``client`` on ``endpoint``, reduced to what must match across deployments."""
    if endpoint == "chat":
        if not stream:
            chat = client.chat.completions.create(model=MODEL, messages=MESSAGES,
                                                  max_tokens=max_tokens)
            assert chat.usage is not None
            return Outcome(chat.choices[0].message.content or "", chat.usage.prompt_tokens,
                           chat.usage.completion_tokens, chat.choices[0].finish_reason)
        parts, finish, usage = [], None, None
        for chunk in client.chat.completions.create(model=MODEL, messages=MESSAGES,
                                                    max_tokens=max_tokens, stream=True,
                                                    stream_options={"include_usage": True}):
            if chunk.choices:
                parts.append(chunk.choices[0].delta.content or "")
                finish = chunk.choices[0].finish_reason or finish
            usage = chunk.usage or usage
        assert usage is not None
        return Outcome("".join(parts), usage.prompt_tokens, usage.completion_tokens, finish)
    if endpoint == "completions":
        if not stream:
            completion = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=max_tokens)
            assert completion.usage is not None
            return Outcome(completion.choices[0].text, completion.usage.prompt_tokens,
                           completion.usage.completion_tokens, completion.choices[0].finish_reason)
        parts, finish, usage = [], None, None
        for piece in client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=max_tokens, stream=True,
                                               stream_options={"include_usage": True}):
            if piece.choices:
                parts.append(piece.choices[0].text)
                finish = piece.choices[0].finish_reason or finish
            usage = piece.usage or usage
        assert usage is not None
        return Outcome("".join(parts), usage.prompt_tokens, usage.completion_tokens, finish)
    if not stream:
        response = client.responses.create(model=MODEL, input=PROMPT, max_output_tokens=max_tokens)
        assert response.usage is not None
        return Outcome(response.output_text, response.usage.input_tokens, response.usage.output_tokens,
                       response.status)
    events, parts, final = [], [], None
    for event in client.responses.create(model=MODEL, input=PROMPT, max_output_tokens=max_tokens, stream=True):
        events.append(event.type)
        if event.type == "response.output_text.delta":
            parts.append(event.delta)
        if event.type in ("response.completed", "response.incomplete"):
            final = event.response
    assert final is not None and final.usage is not None
    assert final.output_text == "".join(parts)
    return Outcome("".join(parts), final.usage.input_tokens, final.usage.output_tokens, final.status,
                   tuple(events))


ENDPOINTS: list[Endpoint] = ["chat", "completions", "responses"]


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "stream"])
@pytest.mark.parametrize("endpoint", ENDPOINTS)
def test_disaggregated_output_equals_aggregated_token_for_token(
    client: openai.OpenAI, aggregated_client: openai.OpenAI, endpoint: Endpoint, stream: bool
) -> None:
    max_tokens = 60  # past the end of the synthetic text, so the CTX/GEN seam and the wrap-around both show
    disaggregated = generate(client, endpoint, stream, max_tokens)
    aggregated = generate(aggregated_client, endpoint, stream, max_tokens)
    assert disaggregated.text == aggregated.text == synthetic_text(max_tokens)
    assert disaggregated.prompt_tokens == aggregated.prompt_tokens == expected_prompt_len(endpoint)
    assert disaggregated.completion_tokens == aggregated.completion_tokens == max_tokens
    assert disaggregated.finish == aggregated.finish == ("incomplete" if endpoint == "responses" else "length")
    if stream and endpoint == "responses":
        assert disaggregated.events == aggregated.events
        # One delta per token: CTX's first token, then one per GEN token after it.
        assert list(disaggregated.events) == [*RESPONSES_EVENTS, *["response.output_text.delta"] * max_tokens,
                                              *RESPONSES_END, "response.incomplete"]


def test_usage_counts_prompt_tokens_from_ctx_and_completion_tokens_from_both_steps(
    client: openai.OpenAI, cluster: Cluster
) -> None:
    ctx_before, gen_before = len(cluster.ctx.recorder.posts()), len(cluster.gen.recorder.posts())
    outcome = generate(client, "chat", False, 5)
    (ctx_exchange,) = cluster.ctx.recorder.posts()[ctx_before:]
    (gen_exchange,) = cluster.gen.recorder.posts()[gen_before:]
    ctx_answer = ctx_exchange.response_json()
    assert outcome.prompt_tokens == ctx_answer["choices"][0]["disaggregated_params"]["prompt_len"]
    assert ctx_answer["usage"]["completion_tokens"] == 1
    assert gen_exchange.response_json()["usage"]["completion_tokens"] == outcome.completion_tokens == 5


def raw_sse(url: str, path: str, body: dict[str, Any]) -> bytes:
    with httpx.Client(timeout=30) as http, http.stream("POST", url + path, json=body) as reply:
        assert reply.status_code == 200
        assert reply.headers["content-type"].startswith("text/event-stream")
        assert reply.headers["cache-control"] == "no-cache"
        return reply.read()


@pytest.mark.parametrize("path", ["/v1/chat/completions", "/v1/completions"])
def test_raw_stream_ends_with_done(cluster: Cluster, path: str) -> None:
    body: dict[str, Any] = {"model": MODEL, "max_tokens": 7, "stream": True}
    body.update({"messages": MESSAGES} if "chat" in path else {"prompt": PROMPT})
    raw = raw_sse(cluster.orchestrator.url, path, body)
    assert raw.endswith(b"\n\ndata: [DONE]\n\n")
    assert raw.count(b"data: [DONE]") == 1
    frames = raw.split(b"\n\n")[:-1]
    assert all(frame.startswith(b"data: ") for frame in frames)
    chunks = [orjson.loads(frame[6:]) for frame in frames[:-1]]
    assert all("error" not in chunk for chunk in chunks)
    assert len({chunk["id"] for chunk in chunks}) == 1


def test_raw_responses_stream_is_a_named_event_sequence(cluster: Cluster) -> None:
    raw = raw_sse(cluster.orchestrator.url, "/v1/responses",
                  {"model": MODEL, "input": PROMPT, "max_output_tokens": 3, "stream": True})
    frames = raw.split(b"\n\n")[:-1]
    names = []
    for number, frame in enumerate(frames):
        event_line, data_line = frame.split(b"\n")
        name = event_line.removeprefix(b"event: ").decode()
        data = orjson.loads(data_line.removeprefix(b"data: "))
        assert data["type"] == name
        assert data["sequence_number"] == number
        names.append(name)
    assert names == [*RESPONSES_EVENTS, *["response.output_text.delta"] * 3, *RESPONSES_END,
                     "response.incomplete"]
    assert b"[DONE]" not in raw


@pytest.mark.parametrize("path", ["/v1/chat/completions", "/v1/completions", "/v1/responses"])
def test_a_null_stream_is_the_default_whole_answer(cluster: Cluster, path: str) -> None:
    assert_a_null_stream_is_a_whole_answer(cluster.orchestrator.url, path)


def test_models_lists_the_served_model(client: openai.OpenAI) -> None:
    models = client.models.list()
    assert [m.id for m in models.data] == [MODEL]


def test_health_is_200_when_both_pools_are_healthy(cluster: Cluster) -> None:
    reply = httpx.get(cluster.orchestrator.url + "/health", timeout=10)
    assert reply.status_code == 200
    body = reply.json()
    assert body["status"] == "ok"
    assert body["context_servers"] == {cluster.ctx.url: True}
    assert body["generation_servers"] == {cluster.gen.url: True}


def closed_port_url() -> str:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    return f"http://127.0.0.1:{port}"  # nothing listens here once the socket is closed


def test_health_is_503_and_requests_fail_cleanly_without_a_healthy_gen(cluster: Cluster) -> None:
    with contextlib.ExitStack() as stack:
        dead_gen = closed_port_url()
        orchestrator = start_orchestrator(stack, [cluster.ctx.url], [dead_gen], connect_timeout_s=2)
        reply = httpx.get(orchestrator.url + "/health", timeout=10)
        assert reply.status_code == 503
        assert reply.json()["status"] == "unavailable"
        assert reply.json()["generation_servers"] == {dead_gen: False}
        with openai.OpenAI(base_url=orchestrator.url + "/v1", api_key="x", max_retries=0) as oai:
            with pytest.raises(openai.APIStatusError) as caught:
                oai.chat.completions.create(model=MODEL, messages=MESSAGES,
                                            max_tokens=4)
            assert caught.value.status_code == 503
            # A request CTX finishes by itself needs no GEN, so it is still served.
            short = oai.chat.completions.create(model=MODEL, messages=MESSAGES,
                                                max_tokens=1)
            assert short.choices[0].message.content == "T"


def metric_samples(url: str) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    reply = httpx.get(url + "/metrics", timeout=10)
    assert reply.status_code == 200
    assert reply.headers["content-type"].startswith("text/plain")
    return {
        (s.name, tuple(sorted(s.labels.items()))): s.value
        for family in text_string_to_metric_families(reply.text)
        for s in family.samples
    }


def value(samples: dict[tuple[str, tuple[tuple[str, str], ...]], float], name: str, **labels: str) -> float:
    return samples.get((name, tuple(sorted(labels.items()))), 0.0)


def test_metrics_on_every_process(client: openai.OpenAI, cluster: Cluster) -> None:
    orch_before = metric_samples(cluster.orchestrator.url)
    gen_before = metric_samples(cluster.gen.url)
    generate(client, "chat", False, 4)
    generate(client, "completions", True, 4)

    def orchestrator_counted_both() -> bool:
        now = metric_samples(cluster.orchestrator.url)
        return value(now, "disagg_requests_total", role="orchestrator", endpoint="completions", status="200") \
            > value(orch_before, "disagg_requests_total", role="orchestrator", endpoint="completions", status="200")

    assert eventually(orchestrator_counted_both)
    orch = metric_samples(cluster.orchestrator.url)
    chat_ok = {"role": "orchestrator", "endpoint": "chat", "status": "200"}
    assert value(orch, "disagg_requests_total", **chat_ok) == value(orch_before, "disagg_requests_total",
                                                                     **chat_ok) + 1
    assert value(orch, "disagg_time_to_first_token_seconds_count") > value(
        orch_before, "disagg_time_to_first_token_seconds_count")
    assert value(orch, "disagg_request_latency_seconds_count", endpoint="chat") == value(
        orch_before, "disagg_request_latency_seconds_count", endpoint="chat") + 1
    assert value(orch, "disagg_request_latency_seconds_bucket", endpoint="chat", le="+Inf") >= 1
    assert sum(v for (name, _), v in orch.items() if name == "disagg_ctx_step_seconds_count") >= 2
    assert ("disagg_engine_inflight_requests", (("role", "orchestrator"),)) in orch

    gen = metric_samples(cluster.gen.url)
    assert value(gen, "disagg_gen_prompt_path_total", path="array") == value(
        gen_before, "disagg_gen_prompt_path_total", path="array") + 2
    assert value(gen, "disagg_requests_total", role="generation", endpoint="chat", status="200") >= 1
    assert eventually(lambda: value(metric_samples(cluster.gen.url), "disagg_engine_inflight_requests",
                                    role="generation") == 0)
    ctx = metric_samples(cluster.ctx.url)
    assert value(ctx, "disagg_requests_total", role="context", endpoint="completions", status="200") >= 1
    assert ("disagg_engine_inflight_requests", (("role", "context"),)) in ctx
    assert value(ctx, "disagg_gen_prompt_path_total", path="array") == 0  # only GEN counts prompt paths


def test_inflight_gauges_return_to_zero(client: openai.OpenAI, cluster: Cluster) -> None:
    for stream in (False, True):
        generate(client, "responses", stream, 3)
    for node, role in ((cluster.orchestrator, "orchestrator"), (cluster.ctx, "context"),
                       (cluster.gen, "generation")):
        assert eventually(lambda node=node, role=role: sample(  # type: ignore[misc]
            node.metrics, "disagg_engine_inflight_requests", role=role) == 0)


# -- errors --------------------------------------------------------------------------------------------------
ErrorCase = tuple[str, dict[str, Any], int, str | None, str | None]
BASE_CHAT: dict[str, Any] = {"model": MODEL, "messages": MESSAGES, "max_tokens": 4}
ERRORS: list[ErrorCase] = [
    ("/v1/chat/completions", {**BASE_CHAT, "temperature": "hot"}, 400, "temperature", None),
    ("/v1/chat/completions", {**BASE_CHAT, "max_tokens": 0}, 400, "max_tokens", None),
    ("/v1/chat/completions", {**BASE_CHAT, "messages": [{"role": "user"}], "bogus": 1}, 400, "bogus", None),
    ("/v1/chat/completions", {**BASE_CHAT, "tools": [{"type": "function"}]}, 400, "tools.0.function", None),
    # The synthetic engine computes no logits to constrain, so a forced tool call is refused by name.
    ("/v1/chat/completions", {**BASE_CHAT, "tools": [{"type": "function", "function": {"name": "f"}}],
                              "tool_choice": "required"}, 400, "tool_choice", "unsupported_parameter"),
    ("/v1/chat/completions", {**BASE_CHAT, "n": 2}, 400, "n", "unsupported_parameter"),
    ("/v1/chat/completions", {**BASE_CHAT, "stream": "yes"}, 400, "stream", None),
    ("/v1/chat/completions", {**BASE_CHAT, "model": 7}, 400, "model", None),
    ("/v1/chat/completions", {**BASE_CHAT, "disaggregated_params": {"request_type": "context_only"}}, 400,
     "disaggregated_params", None),
    ("/v1/chat/completions", {**BASE_CHAT, "prompt_token_ids": [1, 50_000]}, 400, "prompt_token_ids",
     "invalid_prompt_tokens"),
    ("/v1/chat/completions", {**BASE_CHAT, "prompt_token_ids_b64": "!!!!"}, 400, "prompt_token_ids_b64",
     "invalid_prompt_tokens"),
    ("/v1/chat/completions", {**BASE_CHAT, "model": "gpt-nope"}, 404, "model", "model_not_found"),
    ("/v1/completions", {"model": MODEL, "prompt": PROMPT, "suffix": "x"}, 400, "suffix", "unsupported_parameter"),
    ("/v1/completions", {"model": MODEL, "prompt": [1, -3]}, 400, "prompt", "invalid_prompt_tokens"),
    ("/v1/completions", {"model": MODEL, "prompt": PROMPT, "max_tokens": 2_000_000}, 400, "max_tokens",
     "context_length_exceeded"),
    ("/v1/responses", {"model": MODEL, "input": PROMPT, "previous_response_id": "resp_1"}, 404,
     "previous_response_id", "previous_response_not_found"),
    ("/v1/responses", {"model": MODEL, "input": PROMPT, "store": "yes"}, 400, "store", None),
    ("/v1/responses", {"model": MODEL, "input": PROMPT, "reasoning": {"effort": "high"}}, 400, "reasoning",
     "unsupported_parameter"),
    ("/v1/responses", {"model": "gpt-nope", "input": PROMPT}, 404, "model", "model_not_found"),
]


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "stream"])
@pytest.mark.parametrize(("path", "body", "status", "param", "code"), ERRORS,
                         ids=[f"{c[0].rsplit('/', 1)[1]}-{c[3]}-{c[2]}" for c in ERRORS])
def test_bad_requests_get_openai_shaped_errors_and_serving_goes_on(
    cluster: Cluster, client: openai.OpenAI, path: str, body: dict[str, Any], status: int, param: str | None,
    code: str | None, stream: bool
) -> None:
    payload = {**body, "stream": True} if stream and body.get("stream") is None else body
    with httpx.Client(timeout=30) as http:
        reply = http.post(cluster.orchestrator.url + path, json=payload)
    assert reply.status_code == status
    assert reply.headers["content-type"] == "application/json"
    error = reply.json()["error"]
    assert set(error) == {"message", "type", "param", "code"}
    assert error["message"]
    assert error["type"] == "invalid_request_error"
    assert error["param"] == param
    if code is not None:
        assert error["code"] == code
    assert generate(client, "chat", False, 2).text == "Th"


def test_the_openai_client_sees_typed_errors(client: openai.OpenAI) -> None:
    with pytest.raises(openai.NotFoundError) as not_found:
        client.chat.completions.create(model="nope", messages=MESSAGES, max_tokens=2)
    assert not_found.value.code == "model_not_found"
    with pytest.raises(openai.BadRequestError) as bad:
        client.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=2,
                                       extra_body={"frobnicate": True})
    assert bad.value.param == "frobnicate"
    with pytest.raises(openai.BadRequestError) as tools:
        client.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=2,
                                       tools=[{"type": "function", "function": {"name": "f"}}],
                                       tool_choice="required")
    assert tools.value.param == "tool_choice"
    assert tools.value.code == "unsupported_parameter"


def test_a_too_large_body_is_413_and_serving_goes_on(client: openai.OpenAI, cluster: Cluster) -> None:
    ctx_before = len(cluster.ctx.recorder.posts())
    huge = "x" * (64 * 1024)
    with pytest.raises(openai.APIStatusError) as caught:
        client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": huge}], max_tokens=2)
    assert caught.value.status_code == 413
    assert caught.value.code == "payload_too_large"
    assert len(cluster.ctx.recorder.posts()) == ctx_before  # refused before any worker saw it
    assert generate(client, "completions", False, 3).text == "The"


@pytest.mark.parametrize(("body", "fragment"), [(b"{nope", "not valid JSON"), (b"[1]", "JSON object")])
def test_malformed_bodies_are_400(cluster: Cluster, body: bytes, fragment: str) -> None:
    reply = httpx.post(cluster.orchestrator.url + "/v1/chat/completions", content=body, timeout=10)
    assert reply.status_code == 400
    assert fragment in reply.json()["error"]["message"]


def test_errors_are_counted_by_status(cluster: Cluster) -> None:
    labels = {"role": "orchestrator", "endpoint": "responses", "status": "404"}
    before = sample(cluster.orchestrator.metrics, "disagg_requests_total", **labels)
    httpx.post(cluster.orchestrator.url + "/v1/responses", json={"model": "nope", "input": "x"}, timeout=10)
    assert sample(cluster.orchestrator.metrics, "disagg_requests_total", **labels) == before + 1


@pytest.fixture(scope="module")
def limited(cluster: Cluster) -> Iterator[tuple[Node, Node]]:
    """An orchestrator that admits one request at a time and queues none, in front of a slow GEN."""
    with contextlib.ExitStack() as stack:
        from workers.engines.synthetic import SyntheticConfig

        slow_gen = start_worker(stack, "generation", SyntheticConfig(inter_token_latency_s=0.05))
        orchestrator = start_orchestrator(stack, [cluster.ctx.url], [slow_gen.url], max_concurrent_requests=1,
                                          admission={"max_queued": 0})
        yield orchestrator, slow_gen


def test_over_the_concurrency_limit_is_429_and_a_client_leaving_frees_everything(
    limited: tuple[Node, Node]
) -> None:
    orchestrator, slow_gen = limited
    url = orchestrator.url
    # 20,000 tokens would take 1,000 s: whatever frees the slot below is the client leaving, however busy the machine.
    body = {"model": MODEL, "messages": MESSAGES, "max_tokens": 20_000, "stream": True}
    with httpx.Client(timeout=30) as http, http.stream("POST", url + "/v1/chat/completions", json=body) as first:
        assert first.status_code == 200
        chunks = first.iter_raw()  # keep a reference: a dropped iterator closes the connection
        next(chunks)  # the first request is now streaming, holding the only slot
        assert sample(orchestrator.metrics, "disagg_engine_inflight_requests", role="orchestrator") == 1
        second = http.post(url + "/v1/chat/completions", json={**body, "stream": False})
        assert second.status_code == 429
        assert second.headers["retry-after"] == "1"
        assert second.json()["error"]["type"] == "rate_limit_error"
    # The client left mid-stream: the slot and GEN's engine are freed.
    assert eventually(lambda: sample(orchestrator.metrics, "disagg_engine_inflight_requests",
                                     role="orchestrator") == 0)
    assert eventually(lambda: sample(slow_gen.metrics, "disagg_engine_inflight_requests",
                                     role="generation") == 0)
    with openai.OpenAI(base_url=url + "/v1", api_key="x", max_retries=0) as oai:
        again = oai.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=2)
    assert again.choices[0].message.content == "Th"


def test_a_client_that_gives_up_on_a_whole_answer_is_counted_499_and_gen_stops(limited: tuple[Node, Node]) -> None:
    orchestrator, slow_gen = limited
    labels = {"role": "orchestrator", "endpoint": "chat", "status": "499"}
    before = sample(orchestrator.metrics, "disagg_requests_total", **labels)
    errors_before = sample(orchestrator.metrics, "disagg_requests_total", role="orchestrator", endpoint="chat",
                           status="500")
    body = {"model": MODEL, "messages": MESSAGES, "max_tokens": 20_000}  # 1,000 s: only the client ends it
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(orchestrator.url + "/v1/chat/completions", json=body, timeout=httpx.Timeout(10, read=0.3))
    assert eventually(lambda: sample(orchestrator.metrics, "disagg_requests_total", **labels) == before + 1)
    assert sample(orchestrator.metrics, "disagg_requests_total", role="orchestrator", endpoint="chat",
                  status="500") == errors_before
    assert eventually(lambda: sample(slow_gen.metrics, "disagg_engine_inflight_requests",
                                     role="generation") == 0)


# -- a client leaving before the first token: both steps are stopped -------------------------------------------------
@pytest.fixture(scope="module")
def slow_steps(cluster: Cluster) -> Iterator[tuple[Node, Node, Node, Node]]:
    """(orchestrator, its CTX that takes a minute to prefill, orchestrator, its GEN that takes a minute to its first
    token); the other step of each is the shared cluster's."""
    with contextlib.ExitStack() as stack:
        from workers.engines.synthetic import SyntheticConfig

        slow_ctx = start_worker(stack, "context", SyntheticConfig(time_to_first_token_s=60))
        slow_gen = start_worker(stack, "generation", SyntheticConfig(inter_token_latency_s=60))
        before_ctx = start_orchestrator(stack, [slow_ctx.url], [cluster.gen.url])
        before_gen = start_orchestrator(stack, [cluster.ctx.url], [slow_gen.url])
        yield before_ctx, slow_ctx, before_gen, slow_gen


def _inflight(node: Node, role: str) -> float:
    return sample(node.metrics, "disagg_engine_inflight_requests", role=role)


def _client_requests(worker: Node) -> int:
    return len([e for e in worker.recorder.exchanges if e.path != "/health"])


def test_a_client_leaving_during_ctx_stops_ctx_and_never_reaches_gen(
    cluster: Cluster, slow_steps: tuple[Node, Node, Node, Node]
) -> None:
    orchestrator, slow_ctx, _, _ = slow_steps
    labels = {"role": "orchestrator", "endpoint": "completions", "status": "499"}
    left_before, gen_before = sample(orchestrator.metrics, "disagg_requests_total", **labels), \
        _client_requests(cluster.gen)
    sock = open_raw_post(orchestrator.url, "/v1/completions",
                         {"model": MODEL, "prompt": PROMPT, "max_tokens": 4, "stream": True})
    try:
        assert eventually(lambda: _inflight(slow_ctx, "context") == 1), "CTX never got the request"
    finally:
        sock.close()
    assert eventually(lambda: _inflight(slow_ctx, "context") == 0 and _inflight(orchestrator, "orchestrator") == 0)
    assert eventually(lambda: sample(orchestrator.metrics, "disagg_requests_total", **labels) == left_before + 1)
    assert _client_requests(cluster.gen) == gen_before


@pytest.mark.parametrize("path", ["/v1/completions", "/v1/chat/completions"])
def test_a_client_leaving_before_gens_first_token_stops_gen(
    cluster: Cluster, slow_steps: tuple[Node, Node, Node, Node], path: str
) -> None:
    _, _, orchestrator, slow_gen = slow_steps
    body: dict[str, Any] = {"model": MODEL, "max_tokens": 4, "stream": True}
    body.update({"messages": MESSAGES} if "chat" in path else {"prompt": PROMPT})
    sock = open_raw_post(orchestrator.url, path, body)
    try:
        # GEN accepted the hand-off and answered 200: the orchestrator's stream has started, the first token is a
        # minute away.
        assert sock.recv(4096).startswith(b"HTTP/1.1 200 OK\r\n")
        assert _inflight(slow_gen, "generation") == 1
        assert _inflight(cluster.ctx, "context") == 0  # CTX is done: the request waits on GEN alone
    finally:
        sock.close()
    assert eventually(lambda: _inflight(slow_gen, "generation") == 0
                      and _inflight(orchestrator, "orchestrator") == 0)
    assert _inflight(cluster.ctx, "context") == 0

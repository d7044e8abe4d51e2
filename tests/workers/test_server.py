"""The worker's HTTP surface: OpenAI endpoints of an aggregated (role ``both``) worker, models, health, metrics,
limits and engine failures, driven by the official client and raw HTTP."""

from __future__ import annotations

import contextlib
from collections.abc import AsyncGenerator, Iterator
from dataclasses import dataclass
from typing import Any

import httpx
import openai
import orjson
import pytest
from openai.types.chat import ChatCompletion

from tests.cluster import MODEL, Cluster, Node, Recorder, assert_a_null_stream_is_a_whole_answer, sample
from tests.servers import running
from tests.waiting import eventually
from workers.engines.outputs import EngineOutput
from workers.engines.request import GenerationRequest
from workers.engines.synthetic import SYNTHETIC_TEXT, SyntheticConfig, SyntheticEngine
from workers.server import create_worker_app
from workers.settings import WorkerSettings

MESSAGES: Any = [{"role": "user", "content": "Say something."}]


def synthetic_text(n: int) -> str:
    return bytes(SYNTHETIC_TEXT[i % len(SYNTHETIC_TEXT)] for i in range(n)).decode()


class FailingEngine(SyntheticEngine):
    """The synthetic engine with a runtime fault after ``fail_after`` outputs (a real engine, failing for real)."""

    def __init__(self, fail_after: int) -> None:
        super().__init__()
        self.fail_after = fail_after

    def generate(self, request: GenerationRequest) -> AsyncGenerator[EngineOutput, None]:
        return self._failing(super().generate(request))

    async def _failing(self, outputs: AsyncGenerator[EngineOutput, None]) -> AsyncGenerator[EngineOutput, None]:
        try:
            produced = 0
            async for output in outputs:
                if produced == self.fail_after:
                    raise RuntimeError("the device fell over")
                yield output
                produced += 1
        finally:
            await outputs.aclose()


@dataclass
class Special:
    small: Node  # max body 2 KiB, one request at a time, slow tokens
    fails_at_once: Node
    fails_mid_stream: Node


@pytest.fixture(scope="module")
def special() -> Iterator[Special]:
    with contextlib.ExitStack() as stack:
        def start(engine: SyntheticEngine, **settings: Any) -> Node:
            app = create_worker_app(engine, WorkerSettings(role="both", **settings))
            recorder = Recorder(app)
            return Node(stack.enter_context(running(recorder)), app, recorder)

        yield Special(
            small=start(SyntheticEngine(SyntheticConfig(inter_token_latency_s=0.02)), max_body_bytes=2048,
                        max_concurrent_requests=1),
            fails_at_once=start(FailingEngine(0)),
            fails_mid_stream=start(FailingEngine(3)),
        )


@pytest.fixture
def worker_client(cluster: Cluster) -> Iterator[openai.OpenAI]:
    with openai.OpenAI(base_url=cluster.aggregated.url + "/v1", api_key="x", max_retries=0, timeout=30) as oai:
        yield oai


def test_models_card_carries_the_engine_facts(cluster: Cluster, worker_client: openai.OpenAI) -> None:
    assert [m.id for m in worker_client.models.list().data] == [MODEL]
    card = httpx.get(cluster.gen.url + "/v1/models", timeout=10).json()["data"][0]
    assert card["max_model_len"] == 1_048_576
    assert card["engine_info"] == {"engine": "synthetic", "role": "generation", "vocab_size": 50_000,
                                   "kv_block_reuse": False, "prompt_tokens_in_handoff": False,
                                   "model_hash": "synthetic-v1", "disagg_protocols": ["native", "trtllm"]}


@pytest.mark.parametrize("node", ["ctx", "gen", "aggregated"])
def test_health(cluster: Cluster, node: str) -> None:
    worker: Node = getattr(cluster, node)
    reply = httpx.get(worker.url + "/health", timeout=10)
    assert reply.status_code == 200
    assert reply.json()["status"] == "ok"
    assert reply.json()["role"] == {"ctx": "context", "gen": "generation", "aggregated": "both"}[node]


def test_chat_logprobs(worker_client: openai.OpenAI) -> None:
    chat = worker_client.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=4, logprobs=True,
                                                 top_logprobs=2)
    ChatCompletion.model_validate(chat.model_dump())
    logprobs = chat.choices[0].logprobs
    assert logprobs is not None and logprobs.content is not None
    assert "".join(t.token for t in logprobs.content) == "The "
    assert all(t.logprob == 0.0 and len(t.top_logprobs) == 2 for t in logprobs.content)


@pytest.mark.parametrize(("options", "param"), [
    ({"response_format": {"type": "json_object"}}, "response_format"),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "s", "schema": {"type": "object"}}}},
     "response_format"),
    ({"tools": [{"type": "function", "function": {"name": "f"}}], "tool_choice": "required"}, "tool_choice"),
])
def test_the_synthetic_engine_refuses_structured_output(
    worker_client: openai.OpenAI, options: dict[str, Any], param: str
) -> None:
    with pytest.raises(openai.BadRequestError) as caught:
        worker_client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "hi"}],
                                              max_tokens=2, **options)
    assert caught.value.param == param and "structured output" in caught.value.message
    # Tools it need not constrain are served: auto answers in text.
    reply = worker_client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "hi"}],
                                                  max_tokens=2, tools=options.get("tools", []))
    assert reply.choices[0].message.content


def test_top_logprobs_without_logprobs_is_400(worker_client: openai.OpenAI) -> None:
    with pytest.raises(openai.BadRequestError) as caught:
        worker_client.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=4, top_logprobs=2)
    assert caught.value.param == "top_logprobs"


@pytest.mark.parametrize("stream", [False, True])
def test_completion_echo_prepends_the_prompt(worker_client: openai.OpenAI, stream: bool) -> None:
    if stream:
        text = "".join(c.choices[0].text for c in worker_client.completions.create(
            model=MODEL, prompt="Echo: ", max_tokens=3, echo=True, stream=True) if c.choices)
    else:
        text = worker_client.completions.create(model=MODEL, prompt="Echo: ", max_tokens=3, echo=True
                                                ).choices[0].text
    assert text == "Echo: The"


def test_completion_echo_with_logprobs_covers_the_prompt(worker_client: openai.OpenAI) -> None:
    completion = worker_client.completions.create(model=MODEL, prompt="ab", max_tokens=2, echo=True, logprobs=1)
    logprobs = completion.choices[0].logprobs
    assert logprobs is not None
    assert logprobs.tokens is not None and logprobs.token_logprobs is not None
    assert len(logprobs.tokens) == 4
    assert logprobs.token_logprobs[0] is None  # nothing predicts the first prompt token


@pytest.mark.parametrize("stream", [False, True])
def test_stop_strings_cut_the_text(worker_client: openai.OpenAI, stream: bool) -> None:
    if stream:
        parts, finish = [], None
        for chunk in worker_client.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=40,
                                                           stop=["fox", "zzz"], stream=True):
            parts.append(chunk.choices[0].delta.content or "")
            finish = chunk.choices[0].finish_reason or finish
        text = "".join(parts)
    else:
        chat = worker_client.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=40, stop="fox")
        text, finish = chat.choices[0].message.content or "", chat.choices[0].finish_reason
    assert text == "The quick brown "
    assert finish == "stop"


def test_responses_instructions_count_as_prompt(worker_client: openai.OpenAI) -> None:
    plain = worker_client.responses.create(model=MODEL, input="hi", max_output_tokens=2)
    instructed = worker_client.responses.create(model=MODEL, input="hi", instructions="Be kind.",
                                                max_output_tokens=2)
    assert plain.usage is not None and instructed.usage is not None
    assert instructed.usage.input_tokens == plain.usage.input_tokens + len("<|system|>\nBe kind.\n")
    assert instructed.output_text == "Th"


def test_aggregated_max_tokens_default_and_context_limit(worker_client: openai.OpenAI) -> None:
    completion = worker_client.completions.create(model=MODEL, prompt="x")
    assert completion.choices[0].text == synthetic_text(16)  # OpenAI's default for completions
    with pytest.raises(openai.BadRequestError) as caught:
        worker_client.completions.create(model=MODEL, prompt="x", max_tokens=1_048_576)
    assert caught.value.code == "context_length_exceeded"
    assert caught.value.param == "max_tokens"


@pytest.mark.parametrize(
    ("body", "status", "param"),
    [
        ({"model": "other", "messages": MESSAGES}, 404, "model"),
        ({"model": MODEL, "messages": MESSAGES, "colour": "blue"}, 400, "colour"),
        ({"model": MODEL, "messages": MESSAGES, "tool_choice": "required"}, 400, "tool_choice"),
        ({"model": MODEL, "messages": MESSAGES, "logit_bias": {"abc": 1}}, 400, "logit_bias"),
        ({"model": MODEL, "messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {}}]}]},
         400, "messages"),
        ({"model": MODEL}, 400, "messages"),
    ],
)
def test_bad_requests_are_openai_errors_and_the_worker_goes_on(
    cluster: Cluster, worker_client: openai.OpenAI, body: dict[str, Any], status: int, param: str
) -> None:
    reply = httpx.post(cluster.aggregated.url + "/v1/chat/completions", json=body, timeout=10)
    assert reply.status_code == status
    assert reply.json()["error"]["param"] == param
    assert worker_client.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=2
                                                 ).choices[0].message.content == "Th"


@pytest.mark.parametrize("path", ["/v1/chat/completions", "/v1/completions", "/v1/responses"])
def test_a_null_stream_is_the_default_whole_answer(cluster: Cluster, path: str) -> None:
    assert_a_null_stream_is_a_whole_answer(cluster.aggregated.url, path)


def test_too_large_body_is_413(special: Special) -> None:
    reply = httpx.post(special.small.url + "/v1/completions",
                       json={"model": MODEL, "prompt": "x" * 4096, "max_tokens": 1}, timeout=10)
    assert reply.status_code == 413
    assert reply.json()["error"]["code"] == "payload_too_large"
    assert sample(special.small.metrics, "disagg_requests_total", role="both", endpoint="completions",
                  status="413") == 1
    ok = httpx.post(special.small.url + "/v1/completions", json={"model": MODEL, "prompt": "x", "max_tokens": 1},
                    timeout=10)
    assert ok.status_code == 200


def test_over_the_concurrency_limit_is_429(special: Special) -> None:
    body = {"model": MODEL, "prompt": "x", "max_tokens": 500, "stream": True}
    with httpx.Client(timeout=30) as http, http.stream("POST", special.small.url + "/v1/completions",
                                                      json=body) as first:
        chunks = first.iter_raw()
        next(chunks)
        second = http.post(special.small.url + "/v1/completions", json={**body, "stream": False})
        assert second.status_code == 429
        assert second.headers["retry-after"] == "1"
    # The first client left mid-stream: its slot comes back and the engine stops.
    assert eventually(lambda: sample(special.small.metrics, "disagg_engine_inflight_requests", role="both") == 0)
    ok = httpx.post(special.small.url + "/v1/completions", json={"model": MODEL, "prompt": "x", "max_tokens": 2},
                    timeout=10)
    assert ok.json()["choices"][0]["text"] == "Th"


def test_an_engine_failure_is_a_500_engine_error(special: Special) -> None:
    reply = httpx.post(special.fails_at_once.url + "/v1/chat/completions",
                       json={"model": MODEL, "messages": MESSAGES, "max_tokens": 5}, timeout=10)
    assert reply.status_code == 500
    error = reply.json()["error"]
    assert error["code"] == "engine_error"
    assert "device fell over" not in error["message"]  # the engine's own words stay in the log
    assert sample(special.fails_at_once.metrics, "disagg_engine_inflight_requests", role="both") == 0


def test_an_engine_failure_before_the_first_streamed_token_is_a_500_engine_error(special: Special) -> None:
    reply = httpx.post(special.fails_at_once.url + "/v1/chat/completions",
                       json={"model": MODEL, "messages": MESSAGES, "max_tokens": 5, "stream": True}, timeout=10)
    assert reply.status_code == 500
    assert reply.json()["error"]["code"] == "engine_error"


def test_an_engine_failure_before_the_first_streamed_token_is_still_an_openai_error(special: Special) -> None:
    reply = httpx.post(special.fails_at_once.url + "/v1/chat/completions",
                       json={"model": MODEL, "messages": MESSAGES, "max_tokens": 5, "stream": True}, timeout=10)
    assert reply.status_code == 500
    assert set(reply.json()["error"]) == {"message", "type", "param", "code"}
    assert sample(special.fails_at_once.metrics, "disagg_engine_inflight_requests", role="both") == 0


@pytest.mark.parametrize("path", ["/v1/chat/completions", "/v1/completions"])
def test_an_engine_failure_mid_stream_ends_the_stream_with_an_error_event(special: Special, path: str) -> None:
    body: dict[str, Any] = {"model": MODEL, "max_tokens": 10, "stream": True}
    body.update({"messages": MESSAGES} if "chat" in path else {"prompt": "x"})
    raw = httpx.post(special.fails_mid_stream.url + path, json=body, timeout=10).content
    frames = raw.split(b"\n\n")
    assert frames[-2:] == [b"data: [DONE]", b""]
    error = orjson.loads(frames[-3].removeprefix(b"data: "))["error"]
    assert error["code"] == "engine_error"
    with openai.OpenAI(base_url=special.fails_mid_stream.url + "/v1", api_key="x", max_retries=0) as oai, \
            pytest.raises(openai.APIError):
        for _ in oai.completions.create(model=MODEL, prompt="x", max_tokens=10, stream=True):
            pass


def test_responses_stream_failure_is_an_error_event(special: Special) -> None:
    raw = httpx.post(special.fails_mid_stream.url + "/v1/responses",
                     json={"model": MODEL, "input": "x", "max_output_tokens": 10, "stream": True}, timeout=10).content
    last = raw.split(b"\n\n")[-2]
    assert last.startswith(b"event: error\n")
    assert orjson.loads(last.split(b"\ndata: ")[1])["code"] == "engine_error"


def test_worker_metrics_text(cluster: Cluster, worker_client: openai.OpenAI) -> None:
    worker_client.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=2)
    text = httpx.get(cluster.aggregated.url + "/metrics", timeout=10).text
    assert 'disagg_requests_total{endpoint="chat",role="both",status="200"}' in text \
        or 'disagg_requests_total{role="both",endpoint="chat",status="200"}' in text
    assert 'disagg_engine_inflight_requests{role="both"} 0.0' in text


def test_a_client_that_gives_up_is_counted_499(special: Special) -> None:
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(special.small.url + "/v1/completions", json={"model": MODEL, "prompt": "x", "max_tokens": 500},
                   timeout=httpx.Timeout(10, read=0.3))
    assert eventually(lambda: sample(special.small.metrics, "disagg_engine_inflight_requests", role="both") == 0)
    labels = {"role": "both", "endpoint": "completions"}
    assert sample(special.small.metrics, "disagg_requests_total", **labels, status="500") == 0
    assert sample(special.small.metrics, "disagg_requests_total", **labels, status="499") == 1


def test_a_stream_whose_client_leaves_before_the_first_token_stops_at_once() -> None:
    """The first token can be a whole prefill away: a client that leaves during it must stop the work then."""
    engine = SyntheticEngine(SyntheticConfig(time_to_first_token_s=600.0))  # only the client's leaving ends it
    app = create_worker_app(engine, WorkerSettings(role="both"))
    with running(app) as url:
        body = {"model": "synthetic", "prompt": "hello", "max_tokens": 4, "stream": True}
        with pytest.raises(httpx.ReadTimeout), httpx.Client(timeout=httpx.Timeout(10, read=0.5)) as client:
            client.post(url + "/v1/completions", json=body)
        assert eventually(lambda: app.state.service.inflight == 0)  # not after the 600 s prefill
        assert eventually(lambda: not engine._running)
        assert sample(app.state.metrics, "disagg_requests_total", role="both", endpoint="completions",
                      status="499") == 1


def test_a_stream_says_its_token_ids_only_to_whoever_asks(cluster: Cluster) -> None:
    body = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 5, "stream": True}
    url = cluster.aggregated.url + "/v1/chat/completions"
    plain = httpx.post(url, json=body, timeout=30).content
    asked = httpx.post(url, json=body, headers={"x-disagg-stream-token-ids": "1"}, timeout=30).content
    assert b": token_ids" not in plain
    lines = [line.removeprefix(b": token_ids ") for line in asked.split(b"\n") if line.startswith(b": token_ids ")]
    assert bytes(int(token) for line in lines for token in line.split(b",")) == SYNTHETIC_TEXT[:5]

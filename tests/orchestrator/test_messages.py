"""``/v1/messages`` on the orchestrator's edge (synthetic workers): it runs as chat through CTX and GEN, with
``metadata.user_id`` as the conversation; Anthropic's credentials, its 529 where admission sheds load, its error
shape for count_tokens, the metrics' ``messages`` label, a client that leaves stopping both legs, and a GEN that
dies mid-stream ending the stream with Anthropic's error event; one trace, its root span named for the route;
``message_start`` saying the prompt's tokens wherever the prompt is prefilled; an unexpected error, and one after
the stream began, logged with the request id and cause."""

from __future__ import annotations

import contextlib
import logging
import threading
from collections.abc import AsyncIterator, Awaitable, Callable, Collection, Iterator
from typing import Any

import anthropic
import httpx
import orjson
import pytest

from frontend.anthropic.errors import AnthropicError
from frontend.asgi_fast_path import Exchange, RawHeaders
from frontend.config import parse_config
from frontend.errors import UpstreamError
from frontend.metrics import Metrics
from orchestrator.flow.retry import AnswerT, Attempted, RetryPolicy
from orchestrator.member import PoolMember
from orchestrator.messages import MESSAGES_PATH, count_tokens, serve_messages
from orchestrator.pool import WorkerPool
from orchestrator.routers import RoundRobinRouter, RoutingKey
from orchestrator.server import create_orchestrator_app
from orchestrator.upstream.base import WorkerTimeouts
from tests.cluster import MODEL, Node, sample, start_orchestrator, start_worker
from tests.orchestrator.test_faults import dying_gen
from tests.servers import running
from tests.span_capture import captured_spans
from tests.waiting import eventually
from workers.engines.synthetic import SyntheticConfig

KEY = "secret"
BODY: dict[str, Any] = {"model": MODEL, "max_tokens": 4, "messages": [{"role": "user", "content": "hi"}]}


@pytest.fixture(scope="module")
def system() -> Iterator[tuple[str, Node, Node]]:
    with contextlib.ExitStack() as stack:
        slow = SyntheticConfig(inter_token_latency_s=0.02)
        ctx = start_worker(stack, "context", slow)
        gen = start_worker(stack, "generation", slow)
        config = parse_config({"context_servers": {"urls": [ctx.url]}, "generation_servers": {"urls": [gen.url]},
                               "max_concurrent_requests": 1, "admission": {"max_queued": 0}})
        yield stack.enter_context(running(create_orchestrator_app(config, api_key=KEY))), ctx, gen


@pytest.fixture
def url(system: tuple[str, Node, Node]) -> str:
    return system[0]


def idle(url: str) -> bool:
    """The orchestrator holds no request (its one running slot is free for the next test)."""
    metrics = httpx.get(url + "/metrics").text
    return 'disagg_engine_inflight_requests{role="orchestrator"} 0.0' in metrics


def test_it_runs_as_chat_through_ctx_and_gen_with_the_user_as_the_conversation(
        system: tuple[str, Node, Node]) -> None:
    url, ctx, gen = system
    assert ctx.recorder is not None and gen.recorder is not None
    ctx_before, gen_before = len(ctx.recorder.posts()), len(gen.recorder.posts())
    client = anthropic.Anthropic(base_url=url, api_key=KEY, max_retries=0)
    client.messages.create(**BODY, metadata={"user_id": "agent-42"})
    (to_ctx,) = ctx.recorder.posts()[ctx_before:]
    (to_gen,) = gen.recorder.posts()[gen_before:]
    assert to_ctx.path == to_gen.path == "/v1/chat/completions"
    assert to_ctx.request_json()["conversation_params"] == {"conversation_id": "agent-42"}
    assert to_ctx.request_json()["disaggregated_params"]["request_type"] == "context_only"


def start_events(url: str, **body: Any) -> tuple[dict[str, Any], dict[str, Any]]:
    """A streamed answer's ``message_start`` usage and its final usage, as the SDK assembles them."""
    client = anthropic.Anthropic(base_url=url, api_key=KEY, max_retries=0)
    with client.messages.stream(**{**BODY, **body}) as stream:
        events = list(stream)
        final = stream.get_final_message()
    assert events[0].type == "message_start"
    return events[0].message.usage.model_dump(), final.usage.model_dump()


@pytest.mark.parametrize("placement", ["through CTX", "GEN alone", "CTX alone"])
def test_message_start_says_the_prompts_tokens(system: tuple[str, Node, Node], placement: str) -> None:
    """The prompt's counts are known before the first token: GEN's stream says them from its first chunk on, and so
    does the replay of an answer CTX finished (max_tokens 1)."""
    url, ctx, gen = system
    body = {"max_tokens": 1} if placement == "CTX alone" else {}
    with contextlib.ExitStack() as stack:
        if placement == "GEN alone":  # conditional disaggregation: a short prompt is prefilled where it is decoded
            url = start_orchestrator(stack, [ctx.url], [gen.url], max_local_prefill_length=100_000).url
        assert eventually(lambda: idle(system[0]))
        assert ctx.recorder is not None and gen.recorder is not None
        ctx_before, gen_before = len(ctx.recorder.posts()), len(gen.recorder.posts())
        started, final = start_events(url, **body)
        whole = anthropic.Anthropic(base_url=url, api_key=KEY, max_retries=0).messages.create(**{**BODY, **body})
        assert (len(ctx.recorder.posts()) == ctx_before) is (placement == "GEN alone")
        assert (len(gen.recorder.posts()) == gen_before) is (placement == "CTX alone")
    assert started["input_tokens"] > 0 and started["output_tokens"] == 0
    for name in ("input_tokens", "cache_read_input_tokens"):
        assert started[name] == final[name] == getattr(whole.usage, name)


def test_a_client_that_leaves_stops_both_legs(system: tuple[str, Node, Node]) -> None:
    url, ctx, gen = system
    # 20,000 tokens at 20 ms each would hold GEN for 400 s: whatever ends it is the client leaving.
    with httpx.stream("POST", url + "/v1/messages", headers={"x-api-key": KEY}, timeout=60,
                      json={**BODY, "max_tokens": 20_000, "stream": True}) as reply:
        for piece in reply.iter_bytes():
            if b"content_block_delta" in piece:
                break  # gone mid-stream
    assert eventually(lambda: sample(gen.metrics, "disagg_engine_inflight_requests", role="generation") == 0)
    assert sample(ctx.metrics, "disagg_engine_inflight_requests", role="context") == 0
    assert eventually(lambda: idle(url))


def test_x_api_key_and_bearer_both_authenticate(url: str) -> None:
    by_key = anthropic.Anthropic(base_url=url, api_key=KEY, max_retries=0).messages.create(**BODY)
    assert by_key.type == "message"
    by_bearer = anthropic.Anthropic(base_url=url, auth_token=KEY, max_retries=0).messages.create(**BODY)
    assert by_bearer.usage.output_tokens == by_key.usage.output_tokens
    with pytest.raises(anthropic.AuthenticationError) as refused:
        anthropic.Anthropic(base_url=url, api_key="wrong", max_retries=0).messages.create(**BODY)
    assert refused.value.body["error"]["type"] == "authentication_error"  # type: ignore[index]
    counted = httpx.post(url + "/v1/messages/count_tokens", headers={"x-api-key": "wrong"}, json=BODY)
    assert counted.status_code == 401 and counted.json()["type"] == "error"


def test_admission_sheds_load_as_anthropics_529(url: str) -> None:
    started, done = threading.Event(), threading.Event()

    def hold_the_slot() -> None:  # 20,000 tokens (400 s): the slot is held until this client leaves
        with httpx.stream("POST", url + "/v1/messages", headers={"x-api-key": KEY}, timeout=60,
                          json={**BODY, "max_tokens": 20_000, "stream": True}) as held:
            for _ in held.iter_bytes():
                started.set()
                if done.is_set():
                    break  # the slot is freed as the client leaves

    holder = threading.Thread(target=hold_the_slot)
    holder.start()
    try:
        assert eventually(started.is_set)
        shed = httpx.post(url + "/v1/messages", headers={"x-api-key": KEY}, json=BODY, timeout=30)
        assert shed.status_code == 529, shed.text
        assert shed.json()["error"]["type"] == "overloaded_error"
        assert "retry-after" in shed.headers
    finally:
        done.set()
        assert eventually(lambda: not holder.is_alive())
        assert eventually(lambda: idle(url))
    shed_lines = [line for line in httpx.get(url + "/metrics").text.splitlines()
                  if line.startswith("disagg_requests_total{") and 'status="529"' in line]
    assert len(shed_lines) == 1 and 'endpoint="messages"' in shed_lines[0]


def test_count_tokens_errors_are_anthropics(url: str) -> None:
    reply = httpx.post(url + "/v1/messages/count_tokens", headers={"x-api-key": KEY},
                       json={"model": MODEL, "messages": [{"role": "user", "content": [{"type": "image"}]}]})
    assert reply.status_code == 400
    assert reply.json() == {"type": "error", "error": {"type": "invalid_request_error",
                                                       "message": reply.json()["error"]["message"]}}
    assert reply.json()["error"]["message"].startswith("messages.0.content.0.type")
    not_json = httpx.post(url + "/v1/messages/count_tokens", headers={"x-api-key": KEY}, content=b"[1]")
    assert not_json.status_code == 400 and not_json.json()["type"] == "error"


def test_a_gen_dying_mid_stream_ends_the_stream_with_an_anthropic_error_event(
        system: tuple[str, Node, Node]) -> None:
    _, ctx, _ = system
    with contextlib.ExitStack() as stack:
        dying_url = stack.enter_context(running(dying_gen("breaks")))
        orchestrator = start_orchestrator(stack, [ctx.url], [dying_url])
        with httpx.stream("POST", orchestrator.url + "/v1/messages", timeout=30,
                          json={**BODY, "max_tokens": 50, "stream": True}) as reply:
            assert reply.status_code == 200
            frames = reply.read().split(b"\n\n")
        assert frames[-1] == b""
        name, data = frames[-2].split(b"\n")
        assert name == b"event: error"
        error = orjson.loads(data.removeprefix(b"data: "))
        assert error["type"] == "error" and error["error"]["type"] == "api_error"
        assert "GEN" in error["error"]["message"]
        assert b"event: message_stop" not in b"".join(frames)
        received: list[str] = []
        client = anthropic.Anthropic(base_url=orchestrator.url, api_key="x", max_retries=0)
        with pytest.raises(anthropic.APIStatusError) as caught, \
                client.messages.stream(**{**BODY, "max_tokens": 50}) as stream:
            received.extend(stream.text_stream)
        assert "".join(received) == "The "
        assert "GEN" in str(caught.value)


def test_one_request_is_one_trace_named_messages_at_the_edge(system: tuple[str, Node, Node],
                                                              monkeypatch: pytest.MonkeyPatch) -> None:
    url, _, _ = system
    with captured_spans(monkeypatch) as exported:
        reply = httpx.post(url + "/v1/messages", headers={"x-api-key": KEY}, json=BODY, timeout=30)
        assert reply.status_code == 200
        assert eventually(lambda: "generation chat" in {span.name for span in exported.get_finished_spans()})
        spans = exported.get_finished_spans()
    (root,) = [span for span in spans if span.name == "orchestrator messages"]
    names = {span.name for span in spans if span.context.trace_id == root.context.trace_id}  # one trace
    assert {"admission", "ctx.call", "handoff", "gen.call", "context chat", "generation chat"} <= names


class SilentExchange(Exchange):
    """An exchange whose client takes whatever is sent: the route's own behaviour, without a server."""

    def __init__(self) -> None:
        super().__init__({"type": "http", "path": MESSAGES_PATH, "headers": [(b"x-request-id", b"req-9")]}, None)

    async def _send_start(self, status: int, headers: RawHeaders) -> None:
        pass

    async def _send_body(self, body: bytes, more: bool) -> None:
        pass


def messages_records(caplog: pytest.LogCaptureFixture) -> list[logging.LogRecord]:
    return [record for record in caplog.records if record.name == "disagg_serve.messages"]


async def test_an_unexpected_error_is_a_500_logged_with_the_request_id_and_cause(
        caplog: pytest.LogCaptureFixture) -> None:
    async def broken(_: Exchange) -> None:
        raise RuntimeError("a bug")

    with pytest.raises(AnthropicError) as raised:
        await serve_messages(SilentExchange(), broken)
    assert raised.value.status_code == 500
    assert raised.value.to_dict() == {"type": "error", "error": {"type": "api_error",
                                                                 "message": "internal server error"}}
    (record,) = messages_records(caplog)
    assert "req-9" in record.getMessage() and "RuntimeError: a bug" in record.getMessage()
    assert record.exc_info is not None


async def test_an_error_once_the_stream_has_begun_is_logged_with_the_request_id_and_cause(
        caplog: pytest.LogCaptureFixture) -> None:
    async def frames() -> AsyncIterator[bytes]:
        yield b'data: {"id": "chatcmpl-1", "model": "m", "choices": []}\n\n'

    async def cut(exchange: Exchange) -> None:
        await exchange.stream(frames(), [])
        raise UpstreamError("the GEN stream broke")

    with pytest.raises(AnthropicError):
        await serve_messages(SilentExchange(), cut)
    (record,) = messages_records(caplog)
    assert "req-9" in record.getMessage() and "the GEN stream broke" in record.getMessage()


class BrokenRetry(RetryPolicy):
    """A policy with a bug in it."""

    async def run(self, step: str, pool: WorkerPool, key: RoutingKey,
                  attempt: Callable[[PoolMember], Awaitable[AnswerT]], avoid: Collection[PoolMember] = (),
                  judges_workers: bool = True, wait_from: float | None = None) -> Attempted[AnswerT]:
        raise RuntimeError("a bug")


async def test_count_tokens_answers_an_unexpected_error_as_anthropics_500_logged_with_its_cause(
        caplog: pytest.LogCaptureFixture) -> None:
    pool = WorkerPool("ctx", RoundRobinRouter(), WorkerTimeouts())
    with pytest.raises(AnthropicError) as raised:
        await count_tokens(BrokenRetry(0, Metrics()), pool, orjson.dumps(BODY), {"X-Request-Id": "req-12"})
    assert raised.value.status_code == 500 and raised.value.kind == "api_error"
    (record,) = messages_records(caplog)
    assert "req-12" in record.getMessage() and "RuntimeError: a bug" in record.getMessage()

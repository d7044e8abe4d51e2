"""API keys on the orchestrator: ``create_orchestrator_app(config, api_key=...)`` in front of real workers.

Every ``/v1/*`` route needs ``Authorization: Bearer <key>``; a missing or wrong key is a 401 in OpenAI's shape;
``/health`` and ``/metrics`` stay open for probes and scrapers.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import httpx
import openai
import pytest

from frontend.config import parse_config
from orchestrator.server import create_orchestrator_app
from tests.cluster import MODEL, Node, Recorder, sample, start_worker
from tests.servers import running

API_KEY = "sk-test-key-1234"
MESSAGES: Any = [{"role": "user", "content": "hello"}]
ROUTES = [
    ("POST", "/v1/chat/completions", {"model": MODEL, "messages": MESSAGES, "max_tokens": 2}),
    ("POST", "/v1/completions", {"model": MODEL, "prompt": "hi", "max_tokens": 2}),
    ("POST", "/v1/responses", {"model": MODEL, "input": "hi", "max_output_tokens": 2}),
    ("GET", "/v1/models", None),
]


def _requests_seen(worker: Node) -> int:
    """Client requests a worker saw, health checks aside."""
    return len([e for e in worker.recorder.exchanges if e.path != "/health"])


@pytest.fixture(scope="module")
def guarded() -> Iterator[tuple[Node, Node, Node]]:
    with contextlib.ExitStack() as stack:
        ctx, gen = start_worker(stack, "context"), start_worker(stack, "generation")
        # No health checks after start-up: a background /health call must not count as a request a worker saw.
        config = parse_config({"context_servers": {"urls": [ctx.url]}, "generation_servers": {"urls": [gen.url]},
                               "health_check_interval_s": 3600})
        app = create_orchestrator_app(config, api_key=API_KEY)
        recorder = Recorder(app)
        yield Node(stack.enter_context(running(recorder)), app, recorder), ctx, gen


@pytest.mark.parametrize("authorization", [
    None, "", "Bearer", "Bearer wrong", f"Bearer {API_KEY}x", f"Bearer {API_KEY[:-1]}",
    f"Basic {API_KEY}", API_KEY, f"Token {API_KEY}", f"Bearer {API_KEY.upper()}",
], ids=["none", "empty", "scheme-only", "wrong", "longer", "shorter", "basic", "bare", "token",
        "case"])
@pytest.mark.parametrize(("method", "path", "body"), ROUTES, ids=[r[1] for r in ROUTES])
def test_a_missing_or_wrong_key_is_401_in_openai_shape(
    guarded: tuple[Node, Node, Node], method: str, path: str, body: dict[str, Any] | None, authorization: str | None
) -> None:
    orch, ctx, _ = guarded
    ctx_before = _requests_seen(ctx)
    headers = {"Authorization": authorization} if authorization is not None else {}
    reply = httpx.request(method, orch.url + path, json=body, headers=headers, timeout=10)
    assert reply.status_code == 401
    error = reply.json()["error"]
    assert set(error) == {"message", "type", "param", "code"}
    assert error["type"] == "authentication_error"
    assert error["code"] == "invalid_api_key"
    assert API_KEY not in reply.text  # the key is never echoed
    assert _requests_seen(ctx) == ctx_before  # refused before any worker saw it


@pytest.mark.parametrize(("method", "path", "body"), ROUTES, ids=[r[1] for r in ROUTES])
@pytest.mark.parametrize("scheme", ["Bearer", "bearer", "BEARER"])
def test_the_right_key_is_served(guarded: tuple[Node, Node, Node], method: str, path: str,
                                 body: dict[str, Any] | None, scheme: str) -> None:
    orch, _, _ = guarded
    reply = httpx.request(method, orch.url + path, json=body, headers={"Authorization": f"{scheme} {API_KEY}"},
                          timeout=30)
    assert reply.status_code == 200, reply.text


def test_the_official_client_with_and_without_the_key(guarded: tuple[Node, Node, Node]) -> None:
    orch, _, _ = guarded
    with openai.OpenAI(base_url=orch.url + "/v1", api_key=API_KEY, max_retries=0, timeout=30) as good:
        assert good.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=2
                                            ).choices[0].message.content == "Th"
        streamed = "".join(c.choices[0].delta.content or "" for c in good.chat.completions.create(
            model=MODEL, messages=MESSAGES, max_tokens=2, stream=True) if c.choices)
        assert streamed == "Th"
        assert [m.id for m in good.models.list()] == [MODEL]
    with openai.OpenAI(base_url=orch.url + "/v1", api_key="not-it", max_retries=0, timeout=30) as bad, \
            pytest.raises(openai.AuthenticationError) as caught:
        bad.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=2)
    assert caught.value.code == "invalid_api_key"


def test_health_and_metrics_stay_open(guarded: tuple[Node, Node, Node]) -> None:
    orch, _, _ = guarded
    assert httpx.get(orch.url + "/health", timeout=10).status_code == 200
    metrics = httpx.get(orch.url + "/metrics", timeout=10)
    assert metrics.status_code == 200
    assert "disagg_requests_total" in metrics.text
    assert API_KEY not in metrics.text


def test_refused_requests_are_counted_and_hold_no_slot(guarded: tuple[Node, Node, Node]) -> None:
    orch, _, _ = guarded
    for _ in range(3):
        httpx.post(orch.url + "/v1/completions", json={"model": MODEL, "prompt": "x"}, timeout=10)
    assert sample(orch.metrics, "disagg_engine_inflight_requests", role="orchestrator") == 0


def test_workers_have_no_key_of_their_own_so_they_belong_on_a_private_network(guarded: tuple[Node, Node, Node]) -> None:
    # Documented behaviour, pinned: the key guards the orchestrator, the one public entry point.
    _, ctx, _ = guarded
    reply = httpx.post(ctx.url + "/v1/completions", json={"model": MODEL, "prompt": "x", "max_tokens": 1},
                       timeout=10)
    assert reply.status_code == 200

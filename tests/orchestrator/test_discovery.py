"""Dynamic membership: workers registered at run time over the admin API, and workers found by DNS.

Real orchestrator and synthetic workers on loopback; the admin API is driven over HTTP, and a worker built with
``registration=Registration(...)`` announces itself at start-up and leaves at shutdown by itself.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import httpx
import openai
import pytest

from entrypoints.launcher import free_port
from frontend.config import parse_config
from orchestrator.server import create_orchestrator_app
from tests.cluster import MODEL, Node, Recorder, RecordingEngine, start_worker
from tests.servers import ServerThread, running
from tests.waiting import eventually
from workers.engines.synthetic import synthetic_text
from workers.registration import Registration
from workers.server import create_worker_app
from workers.settings import WorkerSettings

ADMIN_KEY = "admin-secret"
MESSAGES: Any = [{"role": "user", "content": "hello"}]


def _orchestrator(stack: contextlib.ExitStack, raw: dict[str, Any], admin_key: str | None) -> Node:
    config = parse_config({"health_check_interval_s": 0.2, **raw})
    app = create_orchestrator_app(config, admin_key=admin_key)
    recorder = Recorder(app)
    return Node(stack.enter_context(running(recorder)), app, recorder)


@pytest.fixture(scope="module")
def ctx() -> Iterator[Node]:
    with contextlib.ExitStack() as stack:
        yield start_worker(stack, "context")


@pytest.fixture
def registering(ctx: Node) -> Iterator[Node]:
    """An orchestrator whose GEN pool starts empty and is filled by registration."""
    with contextlib.ExitStack() as stack:
        yield _orchestrator(stack, {"context_servers": {"urls": [ctx.url]},
                                    "generation_servers": {"registration": True}}, ADMIN_KEY)


def _admin(method: str, url: str, body: dict[str, Any] | None = None, key: str | None = ADMIN_KEY) -> httpx.Response:
    headers = {"Authorization": f"Bearer {key}"} if key is not None else {}
    return httpx.request(method, url + "/admin/workers", json=body, headers=headers, timeout=10)


def _chat(url: str, n: int = 4) -> str:
    with openai.OpenAI(base_url=url + "/v1", api_key="x", max_retries=0, timeout=30) as client:
        reply = client.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=n)
    return reply.choices[0].message.content or ""


def test_a_worker_registered_at_run_time_receives_traffic_and_deregistration_removes_it(registering: Node) -> None:
    url = registering.url
    assert httpx.get(url + "/health", timeout=10).status_code == 503  # no GEN yet
    with contextlib.ExitStack() as stack:
        gen_a, gen_b = start_worker(stack, "generation"), start_worker(stack, "generation")
        added = _admin("POST", url, {"role": "generation", "url": gen_a.url + "/"})
        assert added.status_code == 201, added.text
        assert added.json() == {"url": gen_a.url, "healthy": True}  # checked at once, serves at once
        assert httpx.get(url + "/health", timeout=10).status_code == 200
        assert _chat(url) == synthetic_text(4)
        assert len(gen_a.recorder.posts("/v1/chat/completions")) == 1

        assert _admin("POST", url, {"role": "generation", "url": gen_b.url}).status_code == 201
        assert _admin("POST", url, {"role": "generation", "url": gen_b.url}).status_code == 201  # idempotent
        listing = _admin("GET", url).json()
        assert [w["url"] for w in listing["generation"]] == [gen_a.url, gen_b.url]
        assert [w["url"] for w in listing["context"]] == [registering.app.state.pools["context"].workers[0].url]
        for _ in range(4):
            assert _chat(url) == synthetic_text(4)
        assert len(gen_b.recorder.posts("/v1/chat/completions")) == 2  # round robin over both

        removed = _admin("DELETE", url, {"role": "generation", "url": gen_a.url})
        assert removed.status_code == 200
        assert removed.json() == {"url": gen_a.url, "removed": True}
        assert _admin("DELETE", url, {"role": "generation", "url": gen_a.url}).json()["removed"] is False
        before = len(gen_a.recorder.posts())
        for _ in range(4):
            assert _chat(url) == synthetic_text(4)
        assert len(gen_a.recorder.posts()) == before  # no traffic after removal
        assert [w["url"] for w in _admin("GET", url).json()["generation"]] == [gen_b.url]


def test_a_worker_built_with_registration_joins_by_itself_and_leaves_at_shutdown(registering: Node) -> None:
    port = free_port()
    advertise = f"http://127.0.0.1:{port}"
    engine = RecordingEngine()
    app = create_worker_app(engine, WorkerSettings(role="generation"),
                            registration=Registration(registering.url, advertise, "generation", ADMIN_KEY))
    server = ServerThread(app, port=port)
    pool = registering.app.state.pools["generation"]
    try:
        assert server.start() == advertise
        assert eventually(lambda: any(w.url == advertise and w.healthy for w in pool.workers))
        assert _chat(registering.url, 6) == synthetic_text(6)
        assert len(engine.requests) == 1
    finally:
        server.stop()
    assert [w.url for w in pool.workers] == []  # it said goodbye while shutting down
    assert httpx.get(registering.url + "/health", timeout=10).status_code == 503


def test_a_worker_with_the_wrong_admin_key_is_refused_and_never_joins(registering: Node) -> None:
    port = free_port()
    app = create_worker_app(RecordingEngine(), WorkerSettings(role="generation"),
                            registration=Registration(registering.url, f"http://127.0.0.1:{port}", "generation",
                                                      "wrong-key"))
    server = ServerThread(app, port=port)
    try:
        server.start()
        assert eventually(lambda: any(e.path == "/admin/workers" and e.done
                                      for e in registering.recorder.posts()), timeout_s=10)
    finally:
        server.stop()
    attempts = [e for e in registering.recorder.posts() if e.path == "/admin/workers"]
    assert [e.status for e in attempts] == [401]  # refused once, not retried forever
    assert registering.app.state.pools["generation"].workers == []


def test_the_admin_api_needs_the_admin_key(registering: Node) -> None:
    url = registering.url
    body = {"role": "generation", "url": "http://127.0.0.1:9"}
    for key in (None, "wrong", ADMIN_KEY + "x"):
        for method in ("POST", "DELETE", "GET"):
            reply = _admin(method, url, body if method != "GET" else None, key=key)
            assert reply.status_code == 401, (method, key)
            error = reply.json()["error"]
            assert set(error) == {"message", "type", "param", "code"}
            assert error["type"] == "authentication_error"
            assert "admin key" in error["message"]
    assert registering.app.state.pools["generation"].workers == []
    # A bare API key (no "Bearer") is refused too.
    reply = httpx.post(url + "/admin/workers", json=body, headers={"Authorization": ADMIN_KEY}, timeout=10)
    assert reply.status_code == 401


@pytest.mark.parametrize(
    ("body", "param"),
    [
        ({"role": "decode", "url": "http://127.0.0.1:9"}, "role"),
        ({"url": "http://127.0.0.1:9"}, "role"),
        ({"role": "generation", "url": "ftp://127.0.0.1:9"}, "url"),
        ({"role": "generation", "url": 7}, "url"),
    ],
)
def test_bad_admin_bodies_are_400_naming_the_field(registering: Node, body: dict[str, Any], param: str) -> None:
    reply = _admin("POST", registering.url, body)
    assert reply.status_code == 400
    assert reply.json()["error"]["param"] == param


def test_without_an_admin_key_the_admin_api_is_403(ctx: Node) -> None:
    with contextlib.ExitStack() as stack:
        gen = start_worker(stack, "generation")
        orch = _orchestrator(stack, {"context_servers": {"urls": [ctx.url]},
                                     "generation_servers": {"urls": [gen.url]}}, admin_key=None)
        for method in ("POST", "DELETE", "GET"):
            for key in (None, ADMIN_KEY):
                reply = _admin(method, orch.url, {"role": "generation", "url": gen.url}, key=key)
                assert reply.status_code == 403
                error = reply.json()["error"]
                assert set(error) == {"message", "type", "param", "code"}
                assert error["type"] == "permission_error"
                assert error["code"] == "admin_disabled"
        assert [w.url for w in orch.app.state.pools["generation"].workers] == [gen.url]  # unchanged
        assert _chat(orch.url) == synthetic_text(4)


def test_dns_discovery_finds_a_worker_by_name(ctx: Node) -> None:
    with contextlib.ExitStack() as stack:
        gen = start_worker(stack, "generation")
        port = int(gen.url.rsplit(":", 1)[1])
        orch = _orchestrator(stack, {
            "context_servers": {"urls": [ctx.url]},
            "generation_servers": {"discovery": {"dns_name": "localhost", "port": port, "interval_s": 0.2}},
        }, admin_key=None)
        pool = orch.app.state.pools["generation"]
        assert eventually(lambda: any(w.url == gen.url and w.healthy for w in pool.workers))
        found = {w.url: w.healthy for w in pool.workers}
        # localhost is 127.0.0.1 here, and maybe ::1 too: nothing listens there, so that one just stays out.
        assert set(found) <= {gen.url, f"http://[::1]:{port}"}
        assert found[gen.url] is True
        assert found.get(f"http://[::1]:{port}") in (None, False)
        for _ in range(4):
            assert _chat(orch.url) == synthetic_text(4)
        assert len(gen.recorder.posts("/v1/chat/completions")) == 4
        assert httpx.get(orch.url + "/health", timeout=10).json()["generation_servers"] == found

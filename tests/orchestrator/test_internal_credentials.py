"""The orchestrator's credentials on its calls to workers, whole requests over real HTTP: workers that
require the deployment secret serve an orchestrator that holds it and refuse one that does not; workers that require
TensorRT-LLM's own key (``internal_request_auth_key``, spoken to in its wire under lifecycle v1) serve an
orchestrator that signs its grant calls and GEN requests with it, and refuse one that does not."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import httpx
import pytest

from frontend.config import parse_config
from frontend.internal_secret import InternalSecret
from orchestrator.server import create_orchestrator_app
from tests.cluster import MODEL
from tests.servers import running
from workers.engines.synthetic import SyntheticEngine
from workers.server import create_worker_app
from workers.settings import Role, WorkerSettings
from workers.trtllm.settings import LifecycleSettings

SECRET = InternalSecret("deployment-secret-" + "o" * 24)
TRTLLM_KEY = "trtllm-internal-request-auth-key"
BODY = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4}


def _worker(stack: contextlib.ExitStack, role: Role, **settings: Any) -> str:
    return stack.enter_context(running(create_worker_app(SyntheticEngine(), WorkerSettings(role=role, **settings))))


def _orchestrator(stack: contextlib.ExitStack, ctx: str, gen: str, protocol: str, **credentials: Any) -> str:
    config = parse_config({"context_servers": {"urls": [ctx], "protocol": protocol},
                           "generation_servers": {"urls": [gen], "protocol": protocol}})
    return stack.enter_context(running(create_orchestrator_app(config, **credentials)))


def _chat(url: str) -> httpx.Response:
    return httpx.post(url + "/v1/chat/completions", json=BODY, timeout=60)


@pytest.fixture(scope="module")
def guarded() -> Iterator[tuple[str, str]]:
    """(an orchestrator with the deployment secret, one without), in front of workers that require it."""
    with contextlib.ExitStack() as stack:
        ctx = _worker(stack, "context", internal_secret=SECRET)
        gen = _worker(stack, "generation", internal_secret=SECRET)
        yield (_orchestrator(stack, ctx, gen, "native", internal_secret=SECRET),
               _orchestrator(stack, ctx, gen, "native"))


def test_an_orchestrator_holding_the_secret_is_served(guarded: tuple[str, str]) -> None:
    reply = _chat(guarded[0])
    assert reply.status_code == 200, reply.text
    assert reply.json()["choices"][0]["message"]["content"]


def test_an_orchestrator_without_the_secret_is_refused_by_the_workers(guarded: tuple[str, str]) -> None:
    reply = _chat(guarded[1])
    assert reply.status_code == 401, reply.text  # GEN's refusal of a hand-off from an unproven caller, relayed
    assert reply.json()["error"]["code"] == "invalid_internal_credentials"


@pytest.fixture(scope="module")
def trtllm_keyed() -> Iterator[tuple[str, str, Any]]:
    """(an orchestrator with TensorRT-LLM's key, one without, GEN's app), in front of a lifecycle v1 pair that
    requires it."""
    v1 = LifecycleSettings(protocol_version=1)
    gen_app = create_worker_app(SyntheticEngine(), WorkerSettings(role="generation", trtllm_auth_key=TRTLLM_KEY,
                                                                  lifecycle=v1))
    with contextlib.ExitStack() as stack:
        ctx = _worker(stack, "context", trtllm_auth_key=TRTLLM_KEY, lifecycle=v1)
        gen = stack.enter_context(running(gen_app))
        yield (_orchestrator(stack, ctx, gen, "trtllm", trtllm_auth_key=TRTLLM_KEY),
               _orchestrator(stack, ctx, gen, "trtllm"), gen_app)


def test_an_orchestrator_signing_with_tensorrt_llms_key_is_served(trtllm_keyed: tuple[str, str, Any]) -> None:
    grants = trtllm_keyed[2].state.service.lifecycle.grants
    before = len(grants)
    reply = _chat(trtllm_keyed[0])
    assert reply.status_code == 200, reply.text
    assert reply.json()["choices"][0]["message"]["content"]
    assert len(grants) == before + 1  # under lifecycle v1: a signed grant call, then a signed GEN request


def test_an_orchestrator_that_does_not_sign_is_refused(trtllm_keyed: tuple[str, str, Any]) -> None:
    reply = _chat(trtllm_keyed[1])
    assert reply.status_code == 502 and "status 401" in reply.json()["error"]["message"], reply.text


def test_generation_first_under_v1_with_the_secret_end_to_end() -> None:
    """Our orchestrator, our v1 workers, generation first, everything guarded: GEN pulls its hand-off from CTX's
    board with the deployment secret and its attempt's claim (workers/trtllm/generation_first.py)."""
    v1 = LifecycleSettings(protocol_version=1)
    ctx_app = create_worker_app(SyntheticEngine(), WorkerSettings(role="context", internal_secret=SECRET,
                                                                  lifecycle=v1))
    board = ctx_app.state.service.board
    claims: list[str | None] = []
    claim = board.claim

    async def counted(disagg_request_id: int, wait_s: float, presented: str | None = None) -> Any:
        claims.append(presented)
        return await claim(disagg_request_id, wait_s, presented)

    board.claim = counted
    with contextlib.ExitStack() as stack:
        ctx = stack.enter_context(running(ctx_app))
        gen = _worker(stack, "generation", internal_secret=SECRET, lifecycle=v1)
        config = parse_config({"context_servers": {"urls": [ctx], "protocol": "trtllm"},
                               "generation_servers": {"urls": [gen], "protocol": "trtllm"},
                               "trtllm": {"schedule_style": "generation_first"}})
        orchestrator = stack.enter_context(running(create_orchestrator_app(config, internal_secret=SECRET)))
        reply = _chat(orchestrator)
    assert reply.status_code == 200, reply.text
    assert len(claims) == 1 and claims[0] is not None  # one pull, with the attempt's transfer_session_id

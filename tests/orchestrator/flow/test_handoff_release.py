"""Releasing a hand-off no GEN will take: on the CTX worker that made it, in the background, best effort."""

from __future__ import annotations

import asyncio
import logging

import orjson
import pytest

from frontend.errors import UpstreamUnavailableError
from orchestrator.flow.handoff_release import HandoffReleaser
from orchestrator.pool import WorkerPool
from orchestrator.protocols.base import ContextAnswer
from orchestrator.protocols.native import NativeProtocol
from orchestrator.routers import RoundRobinRouter
from orchestrator.upstream.base import Reply, WorkerTimeouts
from tests.orchestrator.upstream.scripted_transport import ScriptedTransports, Step
from tests.waiting import eventually_async

CTX_URL = "http://ctx:1"
HANDED_OFF = ContextAnswer(response={}, handoff={"ctx_request_id": "c9", "encoded_opaque_state": "c3Q="},
                           finished=False, prompt_len=3, prompt_b64=None)


def releaser(script: list[Step]) -> tuple[HandoffReleaser, ScriptedTransports]:
    transports = ScriptedTransports({CTX_URL: script})
    pool = WorkerPool("ctx", RoundRobinRouter(), WorkerTimeouts(), transport_factory=transports)
    pool.add(CTX_URL)
    return HandoffReleaser(pool, lambda _: NativeProtocol(), timeout_s=5), transports


async def test_the_hand_off_is_released_on_the_ctx_worker_that_made_it() -> None:
    release, transports = releaser([Reply(200, b'{"released": true}')])
    release.release(HANDED_OFF, CTX_URL, {"X-Request-Id": "r1"})
    calls = transports.by_url[CTX_URL].calls
    assert await eventually_async(lambda: len(calls) == 1)
    assert calls[0].path == "/v1/disagg/release"
    assert orjson.loads(calls[0].body or b"") == {"ctx_request_id": "c9", "encoded_opaque_state": "c3Q="}
    assert calls[0].headers == {"X-Request-Id": "r1"}


@pytest.mark.parametrize("ctx_worker", [None, "http://gone:1"])
async def test_nothing_is_sent_when_the_ctx_worker_is_unknown_or_gone(ctx_worker: str | None) -> None:
    release, transports = releaser([])
    release.release(HANDED_OFF, ctx_worker, {})
    await asyncio.sleep(0)
    assert transports.by_url[CTX_URL].calls == []


async def test_nothing_is_sent_for_a_request_ctx_never_handed_off() -> None:
    release, transports = releaser([])
    release.release(None, CTX_URL, {})
    finished = ContextAnswer(response={}, handoff={"ctx_request_id": "c9"}, finished=True, prompt_len=None,
                             prompt_b64=None)
    release.release(finished, CTX_URL, {})
    await asyncio.sleep(0)
    assert transports.by_url[CTX_URL].calls == []


async def test_a_failed_release_is_only_logged(caplog: pytest.LogCaptureFixture) -> None:
    release, transports = releaser([UpstreamUnavailableError("worker http://ctx:1 is unreachable")])
    with caplog.at_level(logging.INFO, logger="disagg_serve.handoff_release"):
        release.release(HANDED_OFF, CTX_URL, {})
        assert await eventually_async(lambda: "expires on its own" in caplog.text)
    assert len(transports.by_url[CTX_URL].calls) == 1

"""Anthropic's Messages API on a worker (synthetic engine): an exception no layer expected, on ``/v1/messages``
(role ``both``) and ``/v1/messages/count_tokens``, is answered as Anthropic's 500 and logged with the request id
and its cause (the 500 does not say it)."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import httpx
import pytest

import workers.messages
from tests.cluster import MODEL, Node, sample, start_worker

BODY: dict[str, Any] = {"model": MODEL, "max_tokens": 2, "messages": [{"role": "user", "content": "hi"}]}


@pytest.fixture(scope="module")
def worker() -> Iterator[Node]:
    with contextlib.ExitStack() as stack:
        yield start_worker(stack, "both")


def broken(*_: Any) -> Any:
    raise RuntimeError("a bug")


@pytest.mark.parametrize(("path", "step"), [("/v1/messages", "messages_request"),
                                            ("/v1/messages/count_tokens", "count_tokens_request")])
def test_an_unexpected_error_is_anthropics_500_logged_with_the_request_id_and_cause(
        worker: Node, path: str, step: str, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    body = BODY if path == "/v1/messages" else {k: v for k, v in BODY.items() if k != "max_tokens"}
    assert httpx.post(worker.url + path, json=body, timeout=30).status_code == 200
    counted = sample(worker.metrics, "disagg_requests_total", role="both", endpoint="messages", status="500")
    monkeypatch.setattr(workers.messages, step, broken)
    reply = httpx.post(worker.url + path, json=body, headers={"x-request-id": "req-11"}, timeout=30)
    assert reply.status_code == 500
    assert reply.json() == {"type": "error", "error": {"type": "api_error", "message": "internal server error"}}
    (record,) = [record for record in caplog.records if record.name == "disagg_serve.messages"]
    assert "req-11" in record.getMessage() and "RuntimeError: a bug" in record.getMessage()
    assert record.exc_info is not None
    if path == "/v1/messages":  # counted as the 500 it answered
        assert sample(worker.metrics, "disagg_requests_total", role="both", endpoint="messages",
                      status="500") == counted + 1

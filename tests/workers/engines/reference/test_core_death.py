"""``kill -9`` of a reference engine core (a real core process): the worker turns unhealthy, its requests in flight
end with OpenAI-shaped errors, the orchestrator routes around it, nothing stays parked, and the core comes back.
"""

from __future__ import annotations

import contextlib
import os
import pathlib
import signal
import threading
from collections.abc import Iterator
from dataclasses import replace
from typing import Any

import httpx
import orjson
import pytest

from tests.waiting import eventually
from tests.workers.engines.reference.cluster import RefNode, start_orchestrator, start_reference_worker
from tests.workers.engines.reference.ledger import assert_ledger_balances
from tests.workers.engines.reference.tiny_model import write_tiny_model
from workers.engines.reference.options import ReferenceOptions

CONTEXT = 8192


@pytest.fixture(scope="module")
def options(tmp_path_factory: pytest.TempPathFactory) -> ReferenceOptions:
    model = write_tiny_model(tmp_path_factory.mktemp("death") / "tiny.gguf", seed=0, context_length=CONTEXT)
    return ReferenceOptions(model_path=str(model), served_model_name="tiny", blas_threads=1, prefill_chunk=16)


def _health(node: RefNode) -> int:
    return httpx.get(node.url + "/health", timeout=30).status_code


def _kill_core(node: RefNode) -> int:
    assert node.engine is not None and node.engine.core_pid is not None
    pid = node.engine.core_pid
    os.kill(pid, signal.SIGKILL)
    return pid


def _long_body(stream: bool) -> dict[str, Any]:
    return {"model": "tiny", "prompt": "Once upon a time", "max_tokens": CONTEXT - 200, "ignore_eos": True,
            "temperature": 0, "stream": stream}


@contextlib.contextmanager
def _in_background(work: Any) -> Iterator[dict[str, Any]]:
    result: dict[str, Any] = {}

    def run() -> None:
        try:
            result["value"] = work()
        except Exception as exc:
            result["error"] = exc

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    yield result
    thread.join(timeout=120)
    assert not thread.is_alive(), "a request in flight never ended"


def test_killing_the_core_fails_requests_in_flight_cleanly_and_the_core_restarts(options: ReferenceOptions) -> None:
    with contextlib.ExitStack() as stack:
        worker = start_reference_worker(stack, "both", options)
        assert worker.engine is not None
        engine = worker.engine
        with httpx.Client(timeout=120) as http, \
                http.stream("POST", worker.url + "/v1/completions", json=_long_body(stream=True)) as streamed:
            assert streamed.status_code == 200
            frames = streamed.iter_lines()
            assert next(line for line in frames if line.startswith("data: "))  # it streams
            with _in_background(lambda: httpx.post(worker.url + "/v1/completions", json=_long_body(stream=False),
                                                   timeout=120)) as whole:
                assert eventually(lambda: engine.kv_store_stats() == (0, 0) and _active(worker) == 2,
                                  every_s=0.05)
                old_pid = _kill_core(worker)
            rest = [line for line in frames if line.startswith("data: ")]
        # Streamed: an error event in OpenAI's shape, then the end marker.
        assert rest[-1] == "data: [DONE]"
        error = orjson.loads(rest[-2].removeprefix("data: "))["error"]
        assert error["type"] and error["message"] and "code" in error
        # Whole: a 5xx with an OpenAI error body.
        reply = whole["value"]
        assert 500 <= reply.status_code < 600
        assert reply.json()["error"]["message"]
        # Restarted: a new core process, healthy again, and it serves.
        assert eventually(lambda: engine.core_pid != old_pid and _health(worker) == 200, every_s=0.05)
        assert engine.restarts == 1
        again = httpx.post(worker.url + "/v1/completions", timeout=60,
                           json={"model": "tiny", "prompt": "Hello", "max_tokens": 3, "temperature": 0})
        assert again.status_code == 200, again.text


def _active(node: RefNode) -> int:
    text = httpx.get(node.url + "/metrics", timeout=10).text
    return int(sum(float(line.split()[-1]) for line in text.splitlines()
                   if line.startswith("disagg_engine_inflight_requests{")))


def test_a_worker_whose_core_died_answers_503_and_the_orchestrator_routes_around_it(
    options: ReferenceOptions, tmp_path: pathlib.Path
) -> None:
    stays_dead = replace(options, restart_dead_core=False)  # so that the 503 holds while the test looks at it
    with contextlib.ExitStack() as stack:
        doomed = start_reference_worker(stack, "context", stays_dead)
        spare = start_reference_worker(stack, "context", options)
        gen = start_reference_worker(stack, "generation", options)
        orchestrator = start_orchestrator(stack, [doomed.url, spare.url], [gen.url], health_check_interval_s=0.2)
        body = {"model": "tiny", "prompt": "Hello there", "max_tokens": 4, "temperature": 0}
        assert httpx.post(orchestrator.url + "/v1/completions", json=body, timeout=60).status_code == 200
        _kill_core(doomed)
        assert eventually(lambda: _health(doomed) == 503, every_s=0.05)
        assert _health(doomed) == 503  # no restart here: it stays unhealthy
        for _ in range(4):  # round robin or not, every request is served by the spare CTX
            reply = httpx.post(orchestrator.url + "/v1/completions", json=body, timeout=60)
            assert reply.status_code == 200, reply.text
        assert_ledger_balances(spare.url)

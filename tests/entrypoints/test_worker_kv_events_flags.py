"""The worker's KV-event flags: on by default at the worker's own host (any free port), ``off`` turns either off,
one of several front ends publishes none; and a real ``disagg-serve worker`` announces what it bound."""

from __future__ import annotations

import contextlib
import os
import pathlib
import socket
import subprocess
import sys
from collections.abc import Iterator
from typing import Any

import httpx
import pytest

from entrypoints.arguments import build_parser
from entrypoints.cli import kv_events_endpoints
from tests.waiting import eventually

REPO = pathlib.Path(__file__).resolve().parents[2]


def endpoints(*argv: str) -> tuple[str | None, str | None]:
    return kv_events_endpoints(build_parser().parse_args(["worker", *argv]))


def test_by_default_both_bind_any_free_port_at_the_workers_host() -> None:
    assert endpoints() == ("tcp://127.0.0.1:0", "tcp://127.0.0.1:0")
    assert endpoints("--host", "0.0.0.0") == ("tcp://0.0.0.0:0", "tcp://0.0.0.0:0")
    assert endpoints("--host", "::") == ("tcp://[::]:0", "tcp://[::]:0")


def test_given_endpoints_are_taken_as_they_are_and_off_turns_them_off() -> None:
    assert endpoints("--kv-events-endpoint", "tcp://*:5557", "--kv-events-replay-endpoint", "tcp://*:5558") == (
        "tcp://*:5557", "tcp://*:5558")
    assert endpoints("--kv-events-replay-endpoint", "off") == ("tcp://127.0.0.1:0", None)
    assert endpoints("--kv-events-endpoint", "off") == (None, None)  # no events: no replay either


def test_the_environment_sets_them_too(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("DISAGG_KV_EVENTS_REPLAY_ENDPOINT", "off")
    assert endpoints() == ("tcp://127.0.0.1:0", None)
    monkeypatch.setenv("DISAGG_KV_EVENTS_ENDPOINT", "off")
    assert endpoints() == (None, None)


def test_one_of_several_front_ends_publishes_none() -> None:
    assert endpoints("--reuse-port") == (None, None)
    assert endpoints("--reuse-port", "--kv-events-endpoint", "tcp://*:5557") == (None, None)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port: int = s.getsockname()[1]
        return port


@contextlib.contextmanager
def worker(*argv: str) -> Iterator[str]:
    port = free_port()
    env = {k: v for k, v in os.environ.items() if not k.startswith("DISAGG_")}
    process = subprocess.Popen([sys.executable, "-m", "entrypoints.cli", "--log-level", "warning", "worker",
                                "--engine", "simulated", "--port", str(port), *argv], cwd=REPO, env=env)
    url = f"http://127.0.0.1:{port}"
    try:
        def healthy() -> bool:
            if process.poll() is not None:
                return True
            try:
                return httpx.get(url + "/health", timeout=5).status_code == 200
            except httpx.HTTPError:
                return False

        assert eventually(healthy, every_s=0.1) and process.poll() is None, "the worker did not start"
        yield url
    finally:
        process.terminate()
        process.wait(timeout=30)


def engine_info(url: str) -> dict[str, Any]:
    info: dict[str, Any] = httpx.get(url + "/v1/models", timeout=10).json()["data"][0]["engine_info"]
    return info


@pytest.mark.parametrize("argv", [(), ("--kv-events-endpoint", "off")])
def test_a_worker_announces_the_endpoints_it_bound(argv: tuple[str, ...]) -> None:
    with worker(*argv) as url:
        info = engine_info(url)
    if argv:
        assert "kv_events" not in info
        return
    events = info["kv_events"]
    assert events["endpoint"].startswith("tcp://127.0.0.1:") and not events["endpoint"].endswith(":0")
    assert events["replay_endpoint"].startswith("tcp://127.0.0.1:")
    assert events["capacity_tokens"] > 0 and events["topic"] == "prefix-chain"

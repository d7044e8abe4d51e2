"""Several HTTP front-end processes on one port (``--api-workers 2``), as real ``disagg-serve`` subprocesses.

Each request goes over a fresh TCP connection so that the kernel's SO_REUSEPORT spreads them over the front ends.
Which process served what is read from the Prometheus multiprocess files each front end writes (one file per PID),
and ``/metrics`` must report the sum over all of them.
"""

from __future__ import annotations

import glob
import json
import os
import select
import shutil
import signal
import subprocess
import sys
import threading
import time
from collections import Counter
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from prometheus_client.mmap_dict import MmapedDict
from prometheus_client.parser import text_string_to_metric_families

from bench.driver.common import (
    Processes,
    Server,
    descendants,
    free_port,
    orchestrator_config,
    wait_healthy,
    worker_args,
)
from entrypoints.supervisor import FrontEndSupervisor
from tests.waiting import eventually
from tests.workers.engines.reference.tiny_model import write_tiny_model

CORE_MODULE = "workers.engines.reference.core"


def _cmdline(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
    except OSError:
        return ""


def _alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_bytes().rsplit(b")", 1)[1].split()[0]
    except (OSError, IndexError):
        return False
    return state != b"Z"


def _front_ends(supervisor: int) -> list[int]:
    return [pid for pid in descendants(supervisor)[1:] if "--reuse-port" in _cmdline(pid)]


def _multiproc_dir(pid: int) -> Path:
    environ = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
    for entry in environ:
        if entry.startswith(b"PROMETHEUS_MULTIPROC_DIR="):
            return Path(entry.split(b"=", 1)[1].decode())
    raise AssertionError(f"process {pid} has no PROMETHEUS_MULTIPROC_DIR")


def _served_by_pid(metrics_dir: Path, role: str) -> Counter[int]:
    """Requests answered 200, per front-end PID, from each process's own counter file."""
    served: Counter[int] = Counter()
    for path in glob.glob(str(metrics_dir / "counter_*.db")):
        pid = int(Path(path).stem.split("_")[-1])
        for key, value, _timestamp, _pos in MmapedDict.read_all_values_from_file(path):  # type: ignore[no-untyped-call]
            _metric, name, labels, _help = json.loads(key)
            if name == "disagg_requests_total" and labels.get("role") == role and labels.get("status") == "200":
                served[pid] += int(value)
    return served


def _merged_requests(url: str, role: str) -> float:
    text = httpx.get(url + "/metrics", timeout=10).text
    return sum(s.value for family in text_string_to_metric_families(text) for s in family.samples
               if s.name == "disagg_requests_total" and s.labels.get("role") == role
               and s.labels.get("status") == "200")


def _wait_for_front_ends(server: Server, count: int, timeout_s: float = 60.0) -> list[int]:
    """Both front ends up: each answers /health over fresh connections (the kernel picks which one)."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        pids = _front_ends(server.pid)
        if len(pids) == count:
            answers = []
            for _ in range(12):
                try:
                    with httpx.Client(timeout=5) as fresh:
                        answers.append(fresh.get(server.url + "/health").status_code)
                except httpx.HTTPError:
                    answers.append(0)
            if answers == [200] * 12:
                return pids
        assert server.process.poll() is None, server.log_tail()
        time.sleep(0.2)
    raise AssertionError(f"{server.name}: {count} front ends not ready:\n{server.log_tail()}")


def _stop_with_sigterm(server: Server, family: list[int]) -> None:
    server.process.send_signal(signal.SIGTERM)
    assert server.process.wait(timeout=60) == 0, server.log_tail()
    eventually(lambda: not any(_alive(pid) for pid in family), every_s=0.1)
    assert [pid for pid in family if _alive(pid)] == []


def test_an_orchestrator_with_two_front_ends_counts_every_request_once(tmp_path: Path) -> None:
    ctx_port, gen_port, port = free_port(), free_port(), free_port()
    with Processes(log_dir=tmp_path) as processes:
        ctx = processes.disagg_serve("ctx", worker_args("context", "synthetic", ctx_port), ctx_port)
        gen = processes.disagg_serve("gen", worker_args("generation", "synthetic", gen_port), gen_port)
        config = orchestrator_config(tmp_path / "orchestrator.yaml", port, [ctx.url], [gen.url],
                                     health_check_interval_s=0.5)
        orch = processes.disagg_serve("orchestrator", ["orchestrator", "--config", str(config), "--api-workers", "2"],
                                      port)
        wait_healthy([ctx, gen], 60)
        front_ends = _wait_for_front_ends(orch, 2)
        metrics_dir = _multiproc_dir(front_ends[0])
        body = {"model": "synthetic", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 3}
        for _ in range(40):
            with httpx.Client(timeout=30) as fresh:  # a new connection each time: the kernel spreads them
                reply = fresh.post(orch.url + "/v1/chat/completions", json=body)
            assert reply.status_code == 200, reply.text
            assert reply.json()["choices"][0]["message"]["content"] == "The"
        assert _merged_requests(orch.url, "orchestrator") == 40  # any front end answers with the sum
        # No front end keeps a response store (a follow-up could reach the other one): refused, never a random 404.
        follow_up = {"model": "synthetic", "input": "hi", "previous_response_id": "resp_1"}
        reply = httpx.post(orch.url + "/v1/responses", json=follow_up, timeout=30)
        assert (reply.status_code, reply.json()["error"]["param"]) == (400, "previous_response_id")
        served = _served_by_pid(metrics_dir, "orchestrator")
        assert sum(served.values()) == 40
        assert set(served) == set(front_ends), served  # both front ends served some
        assert all(_alive(pid) for pid in front_ends)
        family = descendants(orch.pid)
        _stop_with_sigterm(orch, family)
        assert not metrics_dir.exists()  # the supervisor cleaned up after itself


def test_with_a_redis_store_two_front_ends_serve_one_conversation_between_them(tmp_path: Path, redis_url: str
                                                                                ) -> None:
    ctx_port, gen_port, port = free_port(), free_port(), free_port()
    with Processes(log_dir=tmp_path) as processes:
        ctx = processes.disagg_serve("ctx", worker_args("context", "synthetic", ctx_port), ctx_port)
        gen = processes.disagg_serve("gen", worker_args("generation", "synthetic", gen_port), gen_port)
        config = orchestrator_config(tmp_path / "orchestrator.yaml", port, [ctx.url], [gen.url])
        orch = processes.disagg_serve("orchestrator", ["orchestrator", "--config", str(config), "--api-workers", "2",
                                                       "--response-store-url", redis_url], port)
        wait_healthy([ctx, gen], 60)
        front_ends = _wait_for_front_ends(orch, 2)
        metrics_dir = _multiproc_dir(front_ends[0])
        previous: str | None = None
        inputs = []
        for n in range(24):
            body: dict[str, Any] = {"model": "synthetic", "input": f"Turn {n}", "max_output_tokens": 2}
            if previous is not None:
                body["previous_response_id"] = previous
            with httpx.Client(timeout=30) as fresh:  # a new connection each time: the kernel spreads them
                reply = fresh.post(orch.url + "/v1/responses", json=body)
            assert reply.status_code == 200, reply.text
            previous = reply.json()["id"]
            inputs.append(reply.json()["usage"]["input_tokens"])
        assert inputs == sorted(set(inputs))  # no turn lost its history, whichever process served it
        served = _served_by_pid(metrics_dir, "orchestrator")
        assert set(served) == set(front_ends), served  # both front ends served turns of it


def test_a_reference_worker_with_two_front_ends_shares_one_engine_core(tmp_path: Path) -> None:
    model = write_tiny_model(tmp_path / "tiny.gguf", seed=0)
    port = free_port()
    with Processes(log_dir=tmp_path) as processes:
        worker = processes.disagg_serve("worker", worker_args(
            "both", "reference", port, "--api-workers", "2", "--model", str(model), "--blas-threads", "1"), port)
        front_ends = _wait_for_front_ends(worker, 2, timeout_s=120)
        family = descendants(worker.pid)
        cores = [pid for pid in family if CORE_MODULE in _cmdline(pid)]
        assert len(cores) == 1, [_cmdline(pid) for pid in family]
        metrics_dir = _multiproc_dir(front_ends[0])
        body = {"model": "tiny", "prompt": "Hello world", "max_tokens": 4, "temperature": 0}
        texts = set()
        for _ in range(16):
            with httpx.Client(timeout=60) as fresh:
                reply = fresh.post(worker.url + "/v1/completions", json=body)
            assert reply.status_code == 200, reply.text
            texts.add(reply.json()["choices"][0]["text"])
        assert len(texts) == 1  # one engine, one greedy answer, whichever front end took the request
        served = _served_by_pid(metrics_dir, "both")
        assert sum(served.values()) == 16
        assert set(served) == set(front_ends), served
        assert [pid for pid in descendants(worker.pid) if CORE_MODULE in _cmdline(pid)] == cores  # still one
        _stop_with_sigterm(worker, family)


@pytest.fixture(autouse=True)
def _no_stray_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    # A developer's DISAGG_* variables must not change what these subprocesses do.
    for name in list(os.environ):
        if name.startswith("DISAGG_") or name == "PROMETHEUS_MULTIPROC_DIR":
            monkeypatch.delenv(name)


@pytest.fixture
def supervisor(monkeypatch: pytest.MonkeyPatch) -> Iterator[tuple[FrontEndSupervisor, list[list[int]]]]:
    """A supervisor, and what each of its watch loop's waits returned: a wait that ended by its timeout (60 s here)
    rather than by a wake-up returns an empty list."""
    monkeypatch.setattr("entrypoints.supervisor._WATCH_S", 60.0)
    woken_by: list[list[int]] = []
    real_select = select.select

    def recorded(*args: Any) -> Any:
        ready = real_select(*args)
        woken_by.append(list(ready[0]))
        return ready

    monkeypatch.setattr(select, "select", recorded)  # the module the supervisor calls it from
    previous = signal.getsignal(signal.SIGTERM)
    watcher = FrontEndSupervisor([], 0)
    try:
        yield watcher, woken_by
    finally:
        signal.signal(signal.SIGTERM, previous)
        for child in watcher.children:
            child.kill()
            child.wait()
        shutil.rmtree(watcher.workdir, ignore_errors=True)


def waiting_child() -> subprocess.Popen[bytes]:
    return subprocess.Popen([sys.executable, "-c", "import os; os.read(0, 1)"], stdin=subprocess.PIPE)


def test_the_supervisor_wakes_at_once_when_a_front_end_exits(
        supervisor: tuple[FrontEndSupervisor, list[list[int]]]) -> None:
    watcher, woken_by = supervisor
    child = waiting_child()
    watcher.children.append(child)
    assert child.stdin is not None
    threading.Thread(target=child.stdin.close).start()  # the child exits, whenever the watch loop has begun
    assert watcher._watch() == 1
    assert all(woken_by), woken_by  # every wait ended by the wake-up pipe (SIGCHLD), none by its timeout


def test_the_supervisor_wakes_at_once_on_sigterm(supervisor: tuple[FrontEndSupervisor, list[list[int]]]) -> None:
    watcher, woken_by = supervisor
    watcher.children.append(waiting_child())
    signal.signal(signal.SIGTERM, watcher._on_signal)
    threading.Thread(target=os.kill, args=(os.getpid(), signal.SIGTERM)).start()
    assert watcher._watch() == 0
    assert all(woken_by), woken_by

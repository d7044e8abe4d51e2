"""GEN workers restarted under load cost the clients nothing: the only GEN of a pool restarted with SIGTERM, and
every GEN of a pool rolled one by one (SIGTERM, wait for the exit, start again on the same port).

The GEN workers are real ``disagg-serve worker`` processes, stopped by a real SIGTERM (their drain:
workers/drain.py); the CTX worker and the orchestrator are real servers on loopback in this process, so the test
can read the orchestrator's view of its pool. The load is a fixed set of clients on the official ``openai`` client,
each streaming chat completions in a loop; every answer's text is checked. Nothing waits on the clock: each step
waits for the state it needs (a process's exit, the orchestrator's view of a worker).
"""

from __future__ import annotations

import contextlib
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import httpx
import openai
import pytest

from entrypoints.launcher import free_port
from frontend.process_lifetime import die_with_parent
from orchestrator.member import PoolMember
from tests.cluster import MODEL, Node, sample, start_orchestrator, start_worker
from tests.waiting import eventually
from workers.engines.synthetic import synthetic_text

REPO_ROOT = Path(__file__).resolve().parents[2]
CLIENTS = 8
AFTER_RESTART = 4  # requests each client makes once every restart is over, before the load stops
MAX_PER_CLIENT = 3000  # the load's bound, should a restart never end


@dataclass
class GenProcess:
    """A ``disagg-serve worker --role generation`` process on a fixed port, started again on the same one."""

    port: int
    log: Path
    process: subprocess.Popen[bytes] | None = None
    itl_ms: int = 2
    drain_timeout_s: float | None = None  # the worker's default unless given

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def start(self) -> None:
        with open(self.log, "ab") as log:
            self.process = subprocess.Popen(
                [sys.executable, "-m", "entrypoints.cli", "--log-level", "warning", "worker", "--role", "generation",
                 "--engine", "synthetic", "--synthetic-itl-ms", str(self.itl_ms), "--port", str(self.port),
                 *([] if self.drain_timeout_s is None else ["--drain-timeout-s", str(self.drain_timeout_s)])],
                stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, cwd=REPO_ROOT,
                preexec_fn=die_with_parent)

    def healthy(self) -> bool:
        assert self.process is not None
        assert self.process.poll() is None, self.log.read_text(errors="replace")[-2000:]
        with contextlib.suppress(httpx.HTTPError):
            return httpx.get(self.url + "/health", timeout=5).status_code == 200
        return False

    def sigterm_and_wait(self) -> int:
        assert self.process is not None
        self.process.send_signal(signal.SIGTERM)
        return self.process.wait(timeout=120)

    def stop(self) -> None:
        if self.process is not None and self.process.poll() is None:
            self.process.kill()
            self.process.wait(timeout=30)


@dataclass
class Load:
    """``CLIENTS`` clients streaming chat completions until told to stop; every outcome kept with its start time."""

    url: str
    errors: list[str] = field(default_factory=list)
    started: list[float] = field(default_factory=list)  # of every request that succeeded
    restarts_over: threading.Event = field(default_factory=threading.Event)
    threads: list[threading.Thread] = field(default_factory=list)

    def start(self) -> None:
        self.threads = [threading.Thread(target=self._client, args=(i,), daemon=True) for i in range(CLIENTS)]
        for thread in self.threads:
            thread.start()

    def _client(self, index: int) -> None:
        after = 0
        with openai.OpenAI(base_url=self.url + "/v1", api_key="x", max_retries=0, timeout=60) as client:
            for n in range(MAX_PER_CLIENT):
                tokens = 4 + (index + n) % 13
                started = time.monotonic()
                try:
                    text = "".join(chunk.choices[0].delta.content or "" for chunk in client.chat.completions.create(
                        model=MODEL, messages=[{"role": "user", "content": f"client {index} request {n}"}],
                        max_tokens=tokens, stream=True) if chunk.choices)
                except openai.APIError as exc:
                    self.errors.append(f"{type(exc).__name__}: {exc}")
                    continue
                if text != synthetic_text(tokens):
                    self.errors.append(f"wrong text {text!r}")
                    continue
                self.started.append(started)
                if self.restarts_over.is_set():
                    after += 1
                    if after >= AFTER_RESTART:
                        return

    def finish(self) -> None:
        self.restarts_over.set()
        for thread in self.threads:
            thread.join(timeout=120)
        assert not any(thread.is_alive() for thread in self.threads)


@pytest.fixture(scope="module")
def gens(tmp_path_factory: pytest.TempPathFactory) -> Iterator[list[GenProcess]]:
    logs = tmp_path_factory.mktemp("gen-logs")
    processes = [GenProcess(free_port(), logs / f"gen{i}.log") for i in range(2)]
    try:
        for gen in processes:
            gen.start()
        for gen in processes:
            assert eventually(gen.healthy), gen.log.read_text(errors="replace")[-2000:]
        yield processes
    finally:
        for gen in processes:
            gen.stop()


@pytest.fixture(scope="module")
def ctx() -> Iterator[Node]:
    with contextlib.ExitStack() as stack:
        yield start_worker(stack, "context")


def member(orchestrator: Node, url: str) -> PoolMember:
    workers: list[PoolMember] = orchestrator.app.state.pools["generation"].workers
    return next(w for w in workers if w.url == url)


def restart(orchestrator: Node, gen: GenProcess) -> tuple[float, float]:
    """SIGTERM ``gen``, wait for its exit, start it again on its port, and wait until the orchestrator routes to it
    again: (when the SIGTERM was sent, when it was back)."""
    sigterm_at = time.monotonic()
    assert gen.sigterm_and_wait() == -signal.SIGTERM  # drained, then exited by the signal, as uvicorn re-raises it
    assert member(orchestrator, gen.url).draining  # the orchestrator was told, so it waited rather than failed
    gen.start()
    assert eventually(lambda: member(orchestrator, gen.url).routable), gen.log.read_text(errors="replace")[-2000:]
    return sigterm_at, time.monotonic()


def test_the_only_gen_restarting_under_load_costs_no_client_an_error(ctx: Node, gens: list[GenProcess]) -> None:
    gen = gens[0]
    with contextlib.ExitStack() as stack:
        orchestrator = start_orchestrator(stack, [ctx.url], [gen.url], max_retries=1)
        load = Load(orchestrator.url)
        load.start()
        assert eventually(lambda: len(load.started) >= CLIENTS or bool(load.errors))  # under load before the stop
        sigterm_at, back_at = restart(orchestrator, gen)
        load.finish()
        assert load.errors == []
        # Requests came in while the pool had no worker: they waited for the new process instead of failing.
        assert any(sigterm_at < started < back_at for started in load.started)
        assert member(orchestrator, gen.url).breaker.allows()


def test_rolling_every_gen_one_by_one_under_streaming_load_costs_no_client_an_error(
        ctx: Node, gens: list[GenProcess]) -> None:
    with contextlib.ExitStack() as stack:
        orchestrator = start_orchestrator(stack, [ctx.url], [gen.url for gen in gens], max_retries=1)
        assert eventually(lambda: all(member(orchestrator, gen.url).routable for gen in gens))
        load = Load(orchestrator.url)
        load.start()
        assert eventually(lambda: len(load.started) >= CLIENTS or bool(load.errors))
        for gen in gens:
            restart(orchestrator, gen)
        load.finish()
        assert load.errors == []
        assert all(member(orchestrator, gen.url).routable for gen in gens)


def test_a_stream_still_running_at_its_gens_drain_timeout_goes_on_on_another_gen(
        ctx: Node, tmp_path: Path) -> None:
    # Slow GENs (20 ms a token) with a short drain: a 300-token stream outlives the drain of the GEN it is on.
    tokens = 300
    slow = [GenProcess(free_port(), tmp_path / f"slow{i}.log", itl_ms=20, drain_timeout_s=0.5) for i in range(2)]
    try:
        for gen in slow:
            gen.start()
        assert all(eventually(gen.healthy) for gen in slow)
        with contextlib.ExitStack() as stack:
            orchestrator = start_orchestrator(stack, [ctx.url], [gen.url for gen in slow])
            assert eventually(lambda: all(member(orchestrator, gen.url).routable for gen in slow))
            with openai.OpenAI(base_url=orchestrator.url + "/v1", api_key="x", max_retries=0, timeout=60) as client:
                stream = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "long"}],
                                                        max_tokens=tokens, stream=True)
                chunks = [next(stream)]
                assert eventually(lambda: any(member(orchestrator, gen.url).inflight for gen in slow))
                [serving] = [gen for gen in slow if member(orchestrator, gen.url).inflight]
                chunks.append(next(stream))  # the client has text
                assert serving.sigterm_and_wait() == -signal.SIGTERM  # its drain timed out: the stream was cut
                chunks += list(stream)
        text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
        assert text == synthetic_text(tokens)  # nothing lost, repeated or reordered
        assert [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason] == ["length"]
        # Continued by mid-stream migration, on the other GEN.
        assert sample(orchestrator.metrics, "disagg_stream_migrations_total", pool="gen", worker=serving.url,
                      outcome="resumed") == 1
    finally:
        for gen in slow:
            gen.stop()

"""Routing stays consistent across orchestrator processes: the picture of every cache comes from the workers.

Real simulated-engine workers (a bounded LRU prefix cache, KV events on loopback ZMQ), real orchestrators on
loopback, the official ``openai`` client. The same multi-turn work goes once through one orchestrator and once
through two that share nothing, the client alternating between them request by request; each run on fresh
workers. The fleet's prefix-cache hit ratio (the engines' own counters) must agree within 2 points, and be well
above what round robin gets on the same work (so a router that routed blind would fail it): with workers that
publish KV events, and with workers that publish none.

Requests go one at a time, and before each one the test waits (on a condition, tests/waiting.py) until every
orchestrator's index agrees with what every worker says it holds; and every run's workers listen at the same
addresses (routing breaks ties by rendezvous hashing of worker URLs). So the runs are deterministic, and what is
measured is the routing, not the few milliseconds an event takes on the wire or which ports the OS handed out.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import openai
import pytest

from frontend.config import parse_config
from orchestrator.server import create_orchestrator_app
from tests.servers import ServerThread, running
from tests.waiting import eventually
from workers.engines.options import SimulatedConfig
from workers.engines.simulated import SimulatedEngine
from workers.server import create_worker_app
from workers.settings import Role, WorkerSettings

CTX_WORKERS = 3
CACHE_TOKENS = 4096  # per worker: two system prompts and a few conversations fit, not all of them
SYSTEM_PROMPTS = [f"You are assistant {name}. " * 60 for name in ("Ada", "Grace")]  # ~1.3k tokens each
CONVERSATIONS = 7  # odd: a conversation's turns alternate between the two orchestrators
TURNS = 4


@dataclass
class Worker:
    url: str
    app: Any
    engine: SimulatedEngine


def start_worker(stack: contextlib.ExitStack, role: Role, events: bool, port: int,
                 cache_tokens: int = CACHE_TOKENS) -> Worker:
    engine = SimulatedEngine(SimulatedConfig(prefill_base_s=0.0, prefill_tokens_per_s=1e9,
                                             prefix_cache_tokens=cache_tokens, inter_token_latency_s=0.0))
    endpoint = "tcp://127.0.0.1:0" if events else None
    app = create_worker_app(engine, WorkerSettings(role=role, kv_events_endpoint=endpoint,
                                                   kv_events_replay_endpoint=endpoint))
    server = ServerThread(app, port=port)
    url = server.start()
    stack.callback(server.stop)
    return Worker(url, app, engine)


PORTS: list[int] = []  # the workers' ports, chosen by the first run and kept by every later one


@contextlib.contextmanager
def fleet(orchestrators: int, events: bool, router: str, cache_tokens: int
          ) -> Iterator[tuple[list[Worker], list[Any], list[str]]]:
    with contextlib.ExitStack() as stack:
        ports = PORTS or [0] * (CTX_WORKERS + 1)
        ctx = [start_worker(stack, "context", events, port, cache_tokens) for port in ports[:CTX_WORKERS]]
        gen = start_worker(stack, "generation", events, ports[CTX_WORKERS])
        if not PORTS:
            PORTS.extend(int(w.url.rsplit(":", 1)[1]) for w in (*ctx, gen))
        # No decay of recent work: requests go one at a time, at whatever pace this machine allows, and the
        # placement of new conversations must not depend on it.
        config = parse_config({"context_servers": {"urls": [w.url for w in ctx],
                                                   "router": {"type": router, "recent_half_s": 1e9}},
                               "generation_servers": {"urls": [gen.url]}})
        apps = [create_orchestrator_app(config) for _ in range(orchestrators)]
        urls = [stack.enter_context(running(app)) for app in apps]
        yield ctx, apps, urls


def in_agreement(ctx: list[Worker], orchestrators: list[Any]) -> bool:
    """Every orchestrator's index holds, for every CTX worker, exactly what that worker says it holds."""
    try:
        for worker in ctx:
            holdings = worker.app.state.kv_events.service.holdings
            held = frozenset(holdings.held()) if holdings is not None else frozenset()
            for app in orchestrators:
                if app.state.pools["context"].index.held(worker.url) != held:
                    return False
    except RuntimeError:  # a set read while the worker's loop changed it: look again
        return False
    return True


def run_work(orchestrators: int, events: bool = True, router: str = "cache_aware",
             cache_tokens: int = CACHE_TOKENS) -> float:
    """The fleet's prefix-cache hit ratio over the multi-turn work."""
    with fleet(orchestrators, events, router, cache_tokens) as (ctx, apps, urls):
        clients = [openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0) for url in urls]
        histories: list[list[dict[str, str]]] = [
            [{"role": "system", "content": SYSTEM_PROMPTS[c % 2]}] for c in range(CONVERSATIONS)]
        sent = 0
        for turn in range(TURNS):
            for conversation, history in enumerate(histories):
                history.append({"role": "user", "content": f"Question {turn} of conversation {conversation}: "
                                                           + "tell me more. " * 12})
                assert eventually(lambda: in_agreement(ctx, apps))
                answer = clients[sent % len(clients)].chat.completions.create(
                    model="simulated", messages=history, max_tokens=16)  # type: ignore[arg-type]
                sent += 1
                history.append({"role": "assistant", "content": answer.choices[0].message.content or ""})
        for client in clients:
            client.close()
        stats = [w.engine.stats() for w in ctx]
        queried = sum(s.queried_tokens for s in stats)
        assert sum(s.prefills for s in stats) == CONVERSATIONS * TURNS
        return sum(s.hit_tokens for s in stats) / queried


@pytest.fixture(scope="module")
def one_orchestrator() -> float:
    return run_work(1)


def test_two_orchestrators_hit_the_cache_as_one_does(one_orchestrator: float) -> None:
    two = run_work(2)
    assert abs(two - one_orchestrator) <= 0.02, (one_orchestrator, two)


@pytest.fixture(scope="module")
def round_robin() -> float:
    return run_work(2, router="round_robin")


def test_the_hit_ratio_is_the_routers_doing(one_orchestrator: float, round_robin: float) -> None:
    assert one_orchestrator > round_robin + 0.1, (one_orchestrator, round_robin)


# Without events no router sees what an engine evicts, and each process's model of a cache holds only half of what
# went there: with caches this size each worker keeps its share of the conversations, so what the run measures is
# where two processes put them.
NO_EVENTS_CACHE_TOKENS = 16_384


def test_where_workers_publish_nothing_two_orchestrators_hit_the_cache_as_one_does() -> None:
    """No events: each orchestrator knows only what it sent where, half of each conversation's turns. A
    conversation is kept together by what both compute alike (its opening's name, hashed with each worker's),
    not by one process's memory, so two hit the cache as one does, and well above round robin."""
    one = run_work(1, events=False, cache_tokens=NO_EVENTS_CACHE_TOKENS)
    two = run_work(2, events=False, cache_tokens=NO_EVENTS_CACHE_TOKENS)
    round_robin = run_work(2, events=False, router="round_robin", cache_tokens=NO_EVENTS_CACHE_TOKENS)
    assert abs(two - one) <= 0.02, (one, two)
    assert two > round_robin + 0.05, (two, round_robin)

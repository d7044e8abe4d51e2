"""Routers: which worker of a pool takes a request.

Unit tests use real ``PoolMember`` objects made from URLs, with ``healthy`` and the in-flight counts set by hand
(exactly the fields the orchestrator itself maintains). The integration tests run every router type over two CTX
and two GEN synthetic workers behind one orchestrator, on loopback.
"""

from __future__ import annotations

import contextlib
import threading
from collections import Counter
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import httpx
import openai
import pytest

from frontend.config import RouterConfig, parse_config
from orchestrator.member import PoolMember
from orchestrator.routers import (
    LeastLoadedRouter,
    PrefixAffinityRouter,
    RoundRobinRouter,
    RoutingKey,
    make_router,
    routing_key,
)
from orchestrator.server import create_orchestrator_app
from tests.cluster import MODEL, Node, Recorder, RecordingEngine, start_worker
from tests.orchestrator.members import idle_members
from tests.servers import ServerThread, running
from tests.waiting import DEFAULT_TIMEOUT_S, eventually
from workers.engines.synthetic import SYNTHETIC_TEXT, SyntheticConfig
from workers.server import create_worker_app
from workers.settings import Role, WorkerSettings

ROUTER_TYPES = ["cache_aware", "round_robin", "least_loaded", "prefix_affinity"]


def synthetic_text(n: int) -> str:
    return bytes(SYNTHETIC_TEXT[i % len(SYNTHETIC_TEXT)] for i in range(n)).decode()


@pytest.fixture
def pool() -> Iterator[list[PoolMember]]:
    """Three healthy, idle workers (their transports are never used here, only closed)."""
    with idle_members(3, 9100) as workers:
        yield workers


KEY = RoutingKey("hello", 10)


# -- round robin -----------------------------------------------------------------------------------------------
def test_round_robin_cycles_over_the_workers_in_order(pool: list[PoolMember]) -> None:
    router = RoundRobinRouter()
    picks = [router.pick(pool, KEY) for _ in range(9)]
    assert picks == pool * 3


def test_round_robin_skips_unhealthy_and_excluded_workers(pool: list[PoolMember]) -> None:
    router = RoundRobinRouter()
    pool[1].healthy = False
    picks = [router.pick(pool, KEY) for _ in range(6)]
    assert set(map(id, picks)) == {id(pool[0]), id(pool[2])}
    assert Counter(map(id, picks)) == {id(pool[0]): 3, id(pool[2]): 3}
    assert all(router.pick(pool, KEY, [pool[0]]) is pool[2] for _ in range(4))
    assert router.pick(pool, KEY, [pool[0], pool[2]]) is None
    pool[0].healthy = pool[2].healthy = False
    assert router.pick(pool, KEY) is None
    assert router.pick([], KEY) is None


# -- least loaded ----------------------------------------------------------------------------------------------
def test_least_loaded_picks_the_fewest_requests_in_flight(pool: list[PoolMember]) -> None:
    router = LeastLoadedRouter(by_prompt_tokens=False)
    for worker, load in zip(pool, (3, 1, 2), strict=True):
        worker.inflight = load
    assert all(router.pick(pool, KEY) is pool[1] for _ in range(6))  # the tie-rotation never overrides load
    assert all(router.pick(pool, KEY, [pool[1]]) is pool[2] for _ in range(4))
    pool[1].healthy = False
    assert router.pick(pool, KEY) is pool[2]


def test_least_loaded_spreads_ties(pool: list[PoolMember]) -> None:
    router = LeastLoadedRouter(by_prompt_tokens=False)
    picks = [router.pick(pool, KEY) for _ in range(6)]
    assert Counter(map(id, picks)) == {id(w): 2 for w in pool}


def test_least_loaded_by_prompt_tokens_picks_the_fewest_tokens_in_flight(pool: list[PoolMember]) -> None:
    # pool[1] holds the most requests but the fewest prompt tokens: one long prompt weighs more than many short.
    for worker, (requests, tokens) in zip(pool, ((1, 100_000), (5, 300), (1, 50_000)), strict=True):
        worker.inflight, worker.inflight_prompt_tokens = requests, tokens
    by_tokens = make_router(RouterConfig(type="least_loaded", load_metric="prompt_tokens"))
    by_requests = make_router(RouterConfig(type="least_loaded", load_metric="requests"))
    assert all(by_tokens.pick(pool, KEY) is pool[1] for _ in range(6))
    assert all(by_requests.pick(pool, KEY) is pool[2] for _ in range(6))  # ties on requests broken by tokens
    assert all(by_tokens.pick(pool, KEY, [pool[1]]) is pool[2] for _ in range(4))


# -- prefix affinity -------------------------------------------------------------------------------------------
def test_prefix_affinity_sends_equal_prefixes_to_the_same_worker(pool: list[PoolMember]) -> None:
    router = PrefixAffinityRouter(prefix_chars=16, load_factor=1.25)
    for prefix in ("system: you are helpful", "Once upon a time", "def main():", "ünïcödé \ud800"):
        key = RoutingKey(prefix, 100)
        first = router.pick(pool, key)
        assert all(router.pick(pool, key) is first for _ in range(5))
    # Only the first prefix_chars characters count.
    a = router.pick(pool, RoutingKey("0123456789abcdef" + "tail one", 5))
    b = router.pick(pool, RoutingKey("0123456789abcdef" + "another tail", 5))
    assert a is b


def test_prefix_affinity_spreads_different_prefixes(pool: list[PoolMember]) -> None:
    router = PrefixAffinityRouter(prefix_chars=1024, load_factor=1.25)
    picks = Counter(id(router.pick(pool, RoutingKey(f"conversation {i}: hello", 10))) for i in range(300))
    assert set(picks) == {id(w) for w in pool}
    assert min(picks.values()) >= 30  # no worker starved (uniform would be 100 each)


def test_prefix_affinity_is_stable_when_another_worker_leaves(pool: list[PoolMember]) -> None:
    router = PrefixAffinityRouter(prefix_chars=1024, load_factor=1.25)
    keys = [RoutingKey(f"doc {i}", 10) for i in range(100)]
    before = {k: router.pick(pool, k) for k in keys}
    pool[2].healthy = False
    after = {k: router.pick(pool, k) for k in keys}
    # Consistent hashing: only the keys the departed worker owned move.
    assert all(after[k] is before[k] for k in keys if before[k] is not pool[2])
    assert all(after[k] is not pool[2] for k in keys)


def test_prefix_affinity_spills_when_the_owner_is_over_the_load_bound(pool: list[PoolMember]) -> None:
    router = PrefixAffinityRouter(prefix_chars=1024, load_factor=1.25)
    key = RoutingKey("a shared system prompt", 10)
    owner = router.pick(pool, key)
    assert owner is not None
    owner.inflight = 5  # mean with this request = 2, bound = 2.5: the owner is over it
    spilled = router.pick(pool, key)
    assert spilled is not owner and spilled is not None
    assert all(router.pick(pool, key) is spilled for _ in range(3))  # spilling is deterministic (next on ring)
    owner.inflight = 1
    for worker in pool:
        if worker is not owner:
            worker.inflight = 2
    assert router.pick(pool, key) is owner  # back under the bound: affinity returns
    owner.inflight = 3
    for worker in pool:
        if worker is not owner:
            worker.inflight = 0
    # mean with this request = 4/3, bound 5/3: the owner (3) must not take a fourth while others are idle
    assert router.pick(pool, key) is not owner


def test_prefix_affinity_all_excluded_or_unhealthy_is_none(pool: list[PoolMember]) -> None:
    router = PrefixAffinityRouter(prefix_chars=1024, load_factor=1.25)
    assert router.pick(pool, KEY, pool) is None
    for worker in pool:
        worker.healthy = False
    assert router.pick(pool, KEY) is None


def test_prefix_affinity_holds_under_even_light_load(pool: list[PoolMember]) -> None:
    router = PrefixAffinityRouter(prefix_chars=1024, load_factor=1.25)
    keys = [RoutingKey(f"doc {i}", 10) for i in range(30)]
    owners = {k: router.pick(pool, k) for k in keys}
    assert len({id(w) for w in owners.values()}) == 3
    for worker in pool:
        worker.inflight = 1  # even load: the mean with the new request is 4/3, well within 1.25x of it
    assert all(router.pick(pool, k) is owners[k] for k in keys)


# -- routing key -----------------------------------------------------------------------------------------------
@pytest.mark.parametrize(
    ("body", "prefix_chars", "expected"),
    [
        ({"model": "m", "prompt": "abcdefgh"}, 1024, RoutingKey("abcdefgh", 3)),
        ({"model": "m", "prompt": "abcdefgh"}, 3, RoutingKey("abc", 3)),
        ({"model": "m", "messages": [{"role": "system", "content": "sys"}, {"role": "user", "content": "hello"}]},
         1024, RoutingKey("syshello", 3)),
        ({"model": "m", "messages": [{"role": "system", "content": "sys"}, {"role": "user", "content": "hello"}]},
         5, RoutingKey("syshe", 3)),
        ({"model": "m", "messages": [{"role": "user", "content": [{"type": "text", "text": "part one"},
                                                                   {"type": "image_url", "image_url": {}},
                                                                   {"type": "text", "text": "two"}]}]},
         1024, RoutingKey("part onetwo", 3)),
        ({"model": "m", "instructions": "be brief", "input": "question?"}, 1024, RoutingKey("be briefquestion?", 5)),
        ({"model": "m", "input": [{"role": "user", "content": "x" * 400}]}, 10, RoutingKey("x" * 10, 101)),
        ({"model": "m", "prompt": ["one prompt"]}, 1024, RoutingKey("one prompt", 3)),
        ({"model": "m", "prompt_token_ids": [1, 2, 3, 4, 5, 6, 7], "prompt": "text"}, 1024, RoutingKey("text", 7)),
        ({"model": "m"}, 1024, RoutingKey("", 1)),
        ({"model": "m", "messages": 5, "prompt": {"a": 1}, "input": [3, None]}, 1024, RoutingKey("", 1)),
    ],
)
def test_routing_key_reads_the_prompt_start_and_estimates_tokens(
    body: dict[str, Any], prefix_chars: int, expected: RoutingKey
) -> None:
    key = routing_key(body, prefix_chars)
    assert (key.prompt_prefix, key.prompt_tokens) == (expected.prompt_prefix, expected.prompt_tokens)


@pytest.mark.parametrize(
    ("body", "follow_up"),
    [
        ({"messages": [{"role": "system", "content": "s"}, {"role": "user", "content": "q"}]}, False),
        ({"messages": [{"role": "user", "content": "q"}, {"role": "assistant", "content": "a"},
                       {"role": "user", "content": "q2"}]}, True),
        ({"messages": [{"role": "user", "content": "q"}, {"role": "assistant", "content": None, "tool_calls": []},
                       {"role": "tool", "content": "42"}]}, True),
        ({"input": "q"}, False),
        ({"input": [{"role": "user", "content": "q"}, {"type": "function_call_output", "output": "x"}]}, True),
        ({"prompt": "a completion cannot say"}, None),
    ],
)
def test_routing_key_says_whether_the_prompt_continues_a_conversation(body: dict[str, Any],
                                                                      follow_up: bool | None) -> None:
    assert routing_key(body, 1024).follow_up is follow_up


def test_routing_key_estimate_grows_with_the_prompt_without_tokenizing() -> None:
    short = routing_key({"model": "m", "prompt": "x" * 400}, 1024)
    long = routing_key({"model": "m", "prompt": "x" * 400_000}, 1024)
    assert short.prompt_tokens == 101
    assert long.prompt_tokens == 100_001
    assert len(long.prompt_prefix) == 1024


# -- integration: two CTX and two GEN behind one orchestrator, for each router type -----------------------------
def _start_pair(stack: contextlib.ExitStack, role: Role) -> list[Node]:
    return [start_worker(stack, role, SyntheticConfig(inter_token_latency_s=0.002)) for _ in range(2)]


def _orchestrator_with_router(stack: contextlib.ExitStack, ctx: list[str], gen: list[str], kind: str,
                              **options: Any) -> Node:
    router = {"type": kind, "prefix_chars": 64}
    config = parse_config({"context_servers": {"urls": ctx, "router": router},
                           "generation_servers": {"urls": gen, "router": router}, **options})
    app = create_orchestrator_app(config)
    recorder = Recorder(app)
    return Node(stack.enter_context(running(recorder)), app, recorder)


def _chat(client: openai.OpenAI, prompt: str, max_tokens: int = 4, stream: bool = False) -> str:
    messages: Any = [{"role": "user", "content": prompt}]
    if not stream:
        reply = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=max_tokens)
        return reply.choices[0].message.content or ""
    return "".join(chunk.choices[0].delta.content or "" for chunk in client.chat.completions.create(
        model=MODEL, messages=messages, max_tokens=max_tokens, stream=True) if chunk.choices)


@pytest.mark.parametrize("kind", ROUTER_TYPES)
def test_load_spreads_over_both_ctx_and_both_gen(kind: str) -> None:
    with contextlib.ExitStack() as stack:
        ctx, gen = _start_pair(stack, "context"), _start_pair(stack, "generation")
        orch = _orchestrator_with_router(stack, [n.url for n in ctx], [n.url for n in gen], kind)
        with openai.OpenAI(base_url=orch.url + "/v1", api_key="x", max_retries=0, timeout=30) as client, \
                ThreadPoolExecutor(max_workers=6) as threads:
            prompts = [f"request number {i} about topic {i * 7919 % 101}" for i in range(24)]
            texts = list(threads.map(lambda p: _chat(client, p, 20), prompts))
        assert texts == [synthetic_text(20)] * 24
        ctx_counts = [len(n.recorder.posts("/v1/chat/completions")) for n in ctx]
        gen_counts = [len(n.recorder.posts("/v1/chat/completions")) for n in gen]
        assert sum(ctx_counts) == 24 and sum(gen_counts) == 24
        assert min(ctx_counts) >= 4 and min(gen_counts) >= 4, (ctx_counts, gen_counts)
        if kind == "round_robin":
            assert ctx_counts == [12, 12] and gen_counts == [12, 12]


def test_prefix_affinity_keeps_a_conversation_on_one_ctx_worker() -> None:
    with contextlib.ExitStack() as stack:
        ctx, gen = _start_pair(stack, "context"), _start_pair(stack, "generation")
        orch = _orchestrator_with_router(stack, [n.url for n in ctx], [n.url for n in gen], "prefix_affinity")
        with openai.OpenAI(base_url=orch.url + "/v1", api_key="x", max_retries=0, timeout=30) as client:
            for turn in range(6):  # one shared prefix (> prefix_chars), different tails, sequential
                assert _chat(client, "S" * 80 + f" turn {turn}", 3) == synthetic_text(3)
        counts = sorted(len(n.recorder.posts("/v1/chat/completions")) for n in ctx)
        assert counts == [0, 6]
        counts = sorted(len(n.recorder.posts("/v1/chat/completions")) for n in gen)
        assert counts == [0, 6]


class _Loop:
    """Requests in a loop on a thread (alternating whole and streamed) until told to stop; every outcome kept."""

    def __init__(self, url: str) -> None:
        self.url = url
        self.outcomes: list[str] = []
        self.stop = threading.Event()
        self.thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        with openai.OpenAI(base_url=self.url + "/v1", api_key="x", max_retries=0, timeout=30) as client:
            for i in range(2000):  # bounded; normally stopped long before
                if self.stop.is_set():
                    return
                try:
                    text = _chat(client, f"loop {i}", 5, stream=i % 2 == 1)
                    self.outcomes.append("ok" if text == synthetic_text(5) else f"wrong text {text!r}")
                except openai.APIError as exc:
                    self.outcomes.append(f"error {type(exc).__name__}: {exc}")

    def __enter__(self) -> _Loop:
        self.thread.start()
        return self

    def __exit__(self, *_: object) -> None:
        self.stop.set()
        self.thread.join(timeout=30)

    def wait_for(self, count: int, timeout_s: float = DEFAULT_TIMEOUT_S) -> None:
        assert eventually(lambda: len(self.outcomes) >= count, timeout_s)


@pytest.mark.parametrize("kind", ROUTER_TYPES)
def test_a_worker_killed_mid_run_is_routed_around(kind: str) -> None:
    threads: list[ServerThread] = []
    try:
        nodes: dict[str, list[tuple[str, Recorder]]] = {}
        for role in ("context", "generation"):
            for _ in range(2):
                recorder = Recorder(create_worker_app(RecordingEngine(), WorkerSettings(role=role)))
                server = ServerThread(recorder)
                threads.append(server)
                nodes.setdefault(role, []).append((server.start(), recorder))
        ctx_urls = [u for u, _ in nodes["context"]]
        gen_urls = [u for u, _ in nodes["generation"]]
        with contextlib.ExitStack() as stack:
            orch = _orchestrator_with_router(stack, ctx_urls, gen_urls, kind, health_check_interval_s=0.2,
                                             health_failure_threshold=2)
            ctx_pool, gen_pool = orch.app.state.pools["context"], orch.app.state.pools["generation"]
            with _Loop(orch.url) as loop:
                loop.wait_for(10)
                threads[0].stop()  # a CTX worker dies
                threads[2].stop()  # and a GEN worker
                killed_at = len(loop.outcomes)
                dead = {ctx_urls[0], gen_urls[0]}
                assert eventually(lambda: all(not w.healthy for p in (ctx_pool, gen_pool) for w in p.workers
                                              if w.url in dead))
                loop.wait_for(killed_at + 20)
            assert set(loop.outcomes) == {"ok"}, [o for o in loop.outcomes if o != "ok"][:3]
            # The survivors took everything after the death.
            assert len(nodes["context"][1][1].posts("/v1/chat/completions")) >= 20
            assert len(nodes["generation"][1][1].posts("/v1/chat/completions")) >= 20
            with httpx.Client(timeout=10) as http:
                health = http.get(orch.url + "/health").json()
            assert health["context_servers"] == {ctx_urls[0]: False, ctx_urls[1]: True}
            assert health["generation_servers"] == {gen_urls[0]: False, gen_urls[1]: True}
    finally:
        for server in threads:
            server.stop()

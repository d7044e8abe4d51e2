"""The worker publishes what its engine holds under prefix-chain names: real workers (the synthetic engine, with
a prefix cache of its own size) on loopback, an orchestrator in front, and real ZMQ subscribers reading them.

A request's chain (``CHAIN_HEADER``) is recorded once the engine holds the prompt's KV: at the first output of a
context-only or aggregated request, and once a generation-only request's hand-off is accepted; never for a request
that failed before that, never from a malformed header, and never by an engine that reuses no KV."""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator, Iterator
from dataclasses import dataclass
from typing import Any

import httpx
import pybase64
import pytest
import zmq

from frontend.config import parse_config
from frontend.internal_secret import INTERNAL_TOKEN_HEADER, InternalSecret
from frontend.kv_events import BlockRemoved, BlockStored, EventPublisher, EventSubscriber, KVCacheEvent
from frontend.prefix_chain import CHAIN_HEADER, PrefixChain, chain_of
from orchestrator.server import create_orchestrator_app
from tests.cluster import MODEL, Node, Recorder, RecordingEngine, start_orchestrator
from tests.servers import running
from tests.waiting import eventually_async
from workers.engines.synthetic import SyntheticConfig
from workers.server import create_worker_app
from workers.settings import Role, WorkerSettings

CAPACITY = 200_000


class ReusingEngine(RecordingEngine):
    """The synthetic engine, declaring a prefix cache (as an engine with KV reuse on does)."""

    def __init__(self, capacity: int | None = CAPACITY) -> None:
        super().__init__(SyntheticConfig())
        self.capacity = capacity

    def kv_capacity_tokens(self) -> int | None:
        return self.capacity


def start(stack: contextlib.ExitStack, role: Role, engine: RecordingEngine, **settings: Any) -> Node:
    app = create_worker_app(engine, WorkerSettings(role=role, **settings))
    recorder = Recorder(app)
    return Node(stack.enter_context(running(recorder)), app, recorder, engine)


@dataclass
class Fleet:
    ctx: Node
    gen: Node
    both: Node
    orchestrator: Node
    plain: Node  # an engine that reuses nothing
    silent: Node  # KV reuse on, events off


@pytest.fixture(scope="module")
def fleet() -> Iterator[Fleet]:
    with contextlib.ExitStack() as stack:
        ctx = start(stack, "context", ReusingEngine())
        gen = start(stack, "generation", ReusingEngine())
        both = start(stack, "both", ReusingEngine())
        orchestrator = start_orchestrator(stack, [ctx.url], [gen.url])
        plain = start(stack, "both", RecordingEngine())
        silent = start(stack, "both", ReusingEngine(), kv_events_endpoint=None)
        yield Fleet(ctx, gen, both, orchestrator, plain, silent)


def card(node: Node) -> dict[str, Any]:
    reply = httpx.get(node.url + "/v1/models", timeout=10)
    assert reply.status_code == 200
    info: dict[str, Any] = reply.json()["data"][0]["engine_info"]
    return info


class Events:
    """Everything one subscriber read from a worker, batch by batch."""

    def __init__(self) -> None:
        self.batches: list[list[KVCacheEvent]] = []
        self.resets = 0

    def apply(self, events: list[KVCacheEvent]) -> None:
        self.batches.append(events)

    def reset(self) -> None:
        self.resets += 1

    def stored(self) -> list[int]:
        return [h for batch in self.batches for e in batch if isinstance(e, BlockStored)
                for h in e.block_hashes if isinstance(h, int)]

    def held(self) -> set[int]:
        names: set[int] = set()
        for batch in self.batches:
            for event in batch:
                if isinstance(event, BlockStored):
                    names.update(h for h in event.block_hashes if isinstance(h, int))
                elif isinstance(event, BlockRemoved):
                    names.difference_update(h for h in event.block_hashes if isinstance(h, int))
        return names


@contextlib.asynccontextmanager
async def following(node: Node) -> AsyncIterator[Events]:
    events = card(node)["kv_events"]
    seen = Events()
    subscriber = EventSubscriber(events["endpoint"], events["replay_endpoint"], seen.apply, seen.reset)
    subscriber.start()
    try:
        yield seen
    finally:
        await subscriber.aclose()


def prompt(seed: int, size: int = 3_000) -> str:
    return "".join(chr(97 + (seed * 7 + i * 13) % 26) for i in range(size))


async def complete(node: Node, text: str, chain: PrefixChain | str | None, *, stream: bool = False,
                   **extra: Any) -> httpx.Response:
    headers = {}
    if chain is not None:
        headers[CHAIN_HEADER] = chain if isinstance(chain, str) else chain.header_value()
    body = {"model": MODEL, "prompt": text, "max_tokens": 3, "stream": stream, **extra}
    async with httpx.AsyncClient(timeout=30) as client:
        reply = await client.post(node.url + "/v1/completions", json=body, headers=headers)
        await reply.aread()
        return reply


async def wait_for_links(events: Events, links: tuple[int, ...]) -> None:
    assert await eventually_async(lambda: set(links) <= set(events.stored()))


def test_a_worker_that_reuses_kv_advertises_its_events_on_its_card(fleet: Fleet) -> None:
    events = card(fleet.both)["kv_events"]
    assert set(events) == {"endpoint", "replay_endpoint", "topic", "incarnation", "capacity_tokens"}
    assert events["endpoint"].startswith("tcp://127.0.0.1:") and not events["endpoint"].endswith(":0")
    assert events["replay_endpoint"].startswith("tcp://127.0.0.1:")
    assert events["replay_endpoint"] != events["endpoint"]
    assert events["topic"] == "prefix-chain"
    assert events["capacity_tokens"] == CAPACITY
    assert len(events["incarnation"]) == 16 and int(events["incarnation"], 16) >= 0
    assert card(fleet.ctx)["kv_events"]["incarnation"] != events["incarnation"]  # each worker start its own


def test_a_worker_that_reuses_nothing_or_publishes_nothing_has_no_events_on_its_card(fleet: Fleet) -> None:
    assert "kv_events" not in card(fleet.plain)
    assert "kv_events" not in card(fleet.silent)


def test_a_worker_that_reuses_kv_says_its_capacity_with_or_without_events(fleet: Fleet) -> None:
    """An orchestrator that reads no events from it bounds its model of the cache by it."""
    assert card(fleet.silent)["kv_capacity_tokens"] == card(fleet.both)["kv_capacity_tokens"] == CAPACITY
    assert "kv_capacity_tokens" not in card(fleet.plain)


async def test_an_aggregated_request_publishes_exactly_its_chain(fleet: Fleet) -> None:
    async with following(fleet.both) as seen:
        text = prompt(1)
        chain = chain_of([text.encode()])
        reply = await complete(fleet.both, text, chain)
        assert reply.status_code == 200, reply.text
        await wait_for_links(seen, chain.links)
        [batch] = [b for b in seen.batches if any(isinstance(e, BlockStored) and chain.links[0] in e.block_hashes
                                                  for e in b)]
        stored = [e for e in batch if isinstance(e, BlockStored)]
        assert [h for e in stored for h in e.block_hashes] == list(chain.links)
        assert stored[0].parent_block_hash is None
        prompt_len = reply.json()["usage"]["prompt_tokens"]
        assert sum(e.block_size * len(e.block_hashes) for e in stored) == pytest.approx(
            prompt_len * chain.covered_bytes(len(chain.links)) / chain.total_bytes, abs=len(chain.links))


async def test_a_streamed_request_publishes_once_its_first_token_came(fleet: Fleet) -> None:
    async with following(fleet.both) as seen:
        text = prompt(2)
        chain = chain_of([text.encode()])
        reply = await complete(fleet.both, text, chain, stream=True)
        assert reply.status_code == 200 and b"data: [DONE]" in reply.content
        await wait_for_links(seen, chain.links)
        assert seen.resets == 0


async def test_a_malformed_header_or_a_failed_request_publishes_nothing(fleet: Fleet) -> None:
    node = fleet.both
    async with following(node) as seen:
        bad = await complete(node, prompt(3), "not-a-chain")
        assert bad.status_code == 200  # served as if it had come without one
        refused = await complete(node, prompt(4), chain_of([prompt(4).encode()]), max_tokens=10_000_000)
        assert refused.status_code == 400  # failed before the engine ran
        text = prompt(5)
        chain = chain_of([text.encode()])
        assert (await complete(node, text, chain)).status_code == 200
        await wait_for_links(seen, chain.links)
        # Published in order, so what came before this request's batch is all the others published.
        assert set(seen.stored()) & set(chain_of([prompt(4).encode()]).links) == set()


async def test_a_gen_request_whose_handoff_is_refused_publishes_nothing(fleet: Fleet) -> None:
    async with following(fleet.gen) as seen:
        refused_chain = chain_of([prompt(6).encode()])
        disagg = {"request_type": "generation_only", "ctx_request_id": "1", "disagg_request_id": 1,
                  "first_gen_tokens": [84], "encoded_opaque_state": pybase64.b64encode(b"nonsense").decode()}
        reply = await complete(fleet.gen, prompt(6), refused_chain, disaggregated_params=disagg)
        assert reply.status_code == 400, reply.text
        # A whole request through the orchestrator: the next batch GEN publishes is that one's.
        text = prompt(7)
        chain = await through_orchestrator(fleet, text)
        await wait_for_links(seen, chain.links)
        assert set(seen.stored()) & set(refused_chain.links) == set()


async def through_orchestrator(fleet: Fleet, text: str) -> PrefixChain:
    sent_before = len(fleet.gen.recorder.posts("/v1/completions"))
    body = {"model": MODEL, "prompt": text, "max_tokens": 4}
    async with httpx.AsyncClient(timeout=30) as client:
        reply = await client.post(fleet.orchestrator.url + "/v1/completions", json=body)
    assert reply.status_code == 200, reply.text
    exchange = fleet.gen.recorder.posts("/v1/completions")[sent_before]
    return PrefixChain.from_header(exchange.headers[CHAIN_HEADER])


async def test_ctx_and_gen_both_publish_the_chain_the_orchestrator_sent(fleet: Fleet) -> None:
    async with following(fleet.ctx) as ctx_seen, following(fleet.gen) as gen_seen:
        ctx_sent = len(fleet.ctx.recorder.posts("/v1/completions"))
        chain = await through_orchestrator(fleet, prompt(8, 20_000))
        assert PrefixChain.from_header(
            fleet.ctx.recorder.posts("/v1/completions")[ctx_sent].headers[CHAIN_HEADER]) == chain
        assert chain.link_bytes(0) != chain.link_bytes(len(chain.links) - 1)  # links of more than one size
        await wait_for_links(ctx_seen, chain.links)
        await wait_for_links(gen_seen, chain.links)
        assert set(chain.links) <= ctx_seen.held() and set(chain.links) <= gen_seen.held()


async def test_the_gauge_reads_what_is_held(fleet: Fleet) -> None:
    node = fleet.both
    text = prompt(9)
    assert (await complete(node, text, chain_of([text.encode()]))).status_code == 200
    holdings = node.app.state.service.holdings
    assert holdings is not None and holdings.tokens > 0
    async with httpx.AsyncClient(timeout=10) as client:
        metrics = (await client.get(node.url + "/metrics")).text
        plain = (await client.get(fleet.plain.url + "/metrics")).text
    line = next(line for line in metrics.splitlines()
                if line.startswith("disagg_worker_prefix_holdings_tokens "))
    assert float(line.split()[1]) == holdings.tokens
    assert "disagg_worker_prefix_holdings_tokens 0.0" in plain


class ClosingEngine(ReusingEngine):
    def __init__(self) -> None:
        super().__init__()
        self.closed = False

    async def aclose(self) -> None:
        self.closed = True


async def test_an_endpoint_in_use_fails_start_up_and_closes_the_engine() -> None:
    taken = EventPublisher("tcp://127.0.0.1:0", None)
    try:
        engine = ClosingEngine()
        app = create_worker_app(engine, WorkerSettings(role="both", kv_events_endpoint=taken.endpoint))
        with pytest.raises(zmq.ZMQError):
            async with app.router.lifespan_context(app):
                pass
        assert engine.closed
    finally:
        await taken.aclose()


# -- with the deployment secret ----------------------------------------------------------------------------------------
SECRET = InternalSecret("the-deployment-secret-0123456789")


@dataclass
class SecuredFleet:
    ctx: Node
    gen: Node
    orchestrator: Node


@pytest.fixture(scope="module")
def secured() -> Iterator[SecuredFleet]:
    with contextlib.ExitStack() as stack:
        ctx = start(stack, "context", ReusingEngine(), internal_secret=SECRET)
        gen = start(stack, "generation", ReusingEngine(), internal_secret=SECRET)
        config = parse_config({"context_servers": {"urls": [ctx.url]}, "generation_servers": {"urls": [gen.url]}})
        app = create_orchestrator_app(config, internal_secret=SECRET)
        recorder = Recorder(app)
        yield SecuredFleet(ctx, gen, Node(stack.enter_context(running(recorder)), app, recorder))


@contextlib.asynccontextmanager
async def following_with(node: Node, secret: InternalSecret | None) -> AsyncIterator[Events]:
    events = card(node)["kv_events"]
    seen = Events()
    subscriber = EventSubscriber(events["endpoint"], events["replay_endpoint"], seen.apply, seen.reset, secret=secret)
    subscriber.start()
    try:
        yield seen
    finally:
        await subscriber.aclose()


async def test_with_the_secret_a_chain_from_anyone_but_the_orchestrator_is_ignored(secured: SecuredFleet) -> None:
    """A forged chain (no token, or a wrong one) would be published as held, and every orchestrator would route
    by it. The request is served all the same; only a chain with the deployment's token is recorded."""
    node = secured.ctx
    async with following_with(node, SECRET) as seen:
        forged = [chain_of([prompt(seed).encode()]) for seed in (20, 21)]
        assert (await complete(node, prompt(20), forged[0])).status_code == 200
        async with httpx.AsyncClient(timeout=30) as client:
            reply = await client.post(node.url + "/v1/completions",
                                      json={"model": MODEL, "prompt": prompt(21), "max_tokens": 3},
                                      headers={CHAIN_HEADER: forged[1].header_value(),
                                               INTERNAL_TOKEN_HEADER: "a-guessed-token-0123456789"})
            assert reply.status_code == 200, reply.text
            text = prompt(22)
            genuine = chain_of([text.encode()])
            reply = await client.post(node.url + "/v1/completions",
                                      json={"model": MODEL, "prompt": text, "max_tokens": 3},
                                      headers={CHAIN_HEADER: genuine.header_value(), **SECRET.headers()})
            assert reply.status_code == 200, reply.text
        await wait_for_links(seen, genuine.links)
        # Published in order: a forged chain recorded would have come before the genuine one.
        assert not set(seen.stored()) & (set(forged[0].links) | set(forged[1].links))
        holdings = node.app.state.service.holdings
        assert holdings is not None and all(link not in holdings for chain in forged for link in chain.links)


async def test_an_orchestrator_with_the_secret_follows_its_workers_and_sends_chains_they_believe(
        secured: SecuredFleet) -> None:
    sent = len(secured.ctx.recorder.posts("/v1/completions"))
    async with httpx.AsyncClient(timeout=30) as client:
        reply = await client.post(secured.orchestrator.url + "/v1/completions",
                                  json={"model": MODEL, "prompt": prompt(23, 20_000), "max_tokens": 3})
    assert reply.status_code == 200, reply.text
    chain = PrefixChain.from_header(secured.ctx.recorder.posts("/v1/completions")[sent].headers[CHAIN_HEADER])
    index = secured.orchestrator.app.state.pools["context"].index
    # Over CURVE: the orchestrator's subscriber holds the key pair, so the worker's events reach its picture.
    assert await eventually_async(lambda: set(chain.links) <= index.held(secured.ctx.url))
    assert index.publishes(secured.ctx.url)


async def test_a_subscriber_without_the_secret_reads_nothing_from_a_secured_worker(secured: SecuredFleet) -> None:
    async with following_with(secured.gen, None) as stranger, following_with(secured.gen, SECRET) as member:
        async with httpx.AsyncClient(timeout=30) as client:
            reply = await client.post(secured.orchestrator.url + "/v1/completions",
                                      json={"model": MODEL, "prompt": prompt(24), "max_tokens": 3})
        assert reply.status_code == 200, reply.text
        assert await eventually_async(lambda: bool(member.batches))
        assert stranger.batches == [] and stranger.resets == 0

"""The cache index: what each worker holds by prefix-chain link, from its KV events and from what was sent."""

from __future__ import annotations

import asyncio

import zmq
import zmq.asyncio

from frontend.kv_events import AllBlocksCleared, BlockRemoved, BlockStored, EventPublisher
from frontend.prefix_chain import chain_of
from orchestrator.cache_index import CATCH_UP_S, SENT_LINKS_PER_WORKER, CacheIndex, EventSource
from tests.waiting import eventually_async

W1, W2 = "http://w1", "http://w2"
SYSTEM = b"s" * 8192
CHAIN = chain_of([SYSTEM, b"u" * 4096])


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def stored(links: tuple[int, ...]) -> BlockStored:
    return BlockStored(list(links), None, [], 16, None, None, None)


def test_events_say_what_a_worker_holds_and_matching_finds_the_longest_held_prefix() -> None:
    index = CacheIndex()
    index.subscribe(W1, None)
    assert index.matched_links(W1, CHAIN) == 0
    index.apply(W1, [stored(CHAIN.links[:10])])
    assert index.matched_links(W1, CHAIN) == 10
    assert index.matched_links(W2, CHAIN) == 0
    index.apply(W1, [stored(CHAIN.links)])
    assert index.matched_links(W1, CHAIN) == len(CHAIN.links)
    index.apply(W1, [BlockRemoved(list(CHAIN.links[5:]), None)])
    assert index.matched_links(W1, CHAIN) == 5
    index.apply(W1, [AllBlocksCleared()])
    assert index.matched_links(W1, CHAIN) == 0


def test_every_length_of_held_prefix_is_found() -> None:
    index = CacheIndex()
    index.subscribe(W1, None)
    for held in range(len(CHAIN.links) + 1):
        index.reset(W1)
        index.apply(W1, [stored(CHAIN.links[:held])])
        assert index.matched_links(W1, CHAIN) == held


def test_a_prompt_that_differs_after_the_shared_start_matches_only_the_start() -> None:
    index = CacheIndex()
    index.subscribe(W1, None)
    index.apply(W1, [stored(CHAIN.links)])
    other = chain_of([SYSTEM, b"v" * 4096])
    shared = sum(1 for a, b in zip(CHAIN.links, other.links, strict=False) if a == b)
    assert 0 < shared < len(other.links)
    assert index.matched_links(W1, other) == shared


def test_what_was_sent_counts_until_the_events_should_have_said_so() -> None:
    clock = Clock()
    index = CacheIndex(pending_s=10.0, clock=clock)
    index._of(W1).source = EventSource("tcp://w1:1", None, "a")  # publishes (no subscriber needed here)
    index.note_sent(W1, CHAIN)
    assert index.matched_links(W1, CHAIN) == len(CHAIN.links)
    clock.now = 10.5
    assert index.matched_links(W1, CHAIN) == 0  # the worker never said it holds it: it does not


def test_what_was_sent_counts_until_the_events_should_have_said_so_and_is_kept_bounded() -> None:
    clock = Clock()
    index = CacheIndex(pending_s=1e9, clock=clock)
    index._of(W1).source = EventSource("tcp://w1:1", None, "a")
    for i in range(SENT_LINKS_PER_WORKER // len(CHAIN.links) + 2):
        index.note_sent(W1, chain_of([str(i).encode() * 4096, b"x" * 8192]))
    assert len(index._of(W1).sent) <= SENT_LINKS_PER_WORKER


def test_a_worker_without_events_holds_what_was_sent_there_as_long_as_its_capacity_allows() -> None:
    clock = Clock()
    index = CacheIndex(pending_s=10.0, clock=clock)
    # its card: ~64 KiB of text at 4 B a token
    asyncio.run(index.describe(W2, {"engine_info": {"kv_capacity_tokens": 16_384}}))
    index.note_sent(W2, CHAIN)
    clock.now = 1e6  # time alone ages nothing: only what came after
    assert index.matched_links(W2, CHAIN) == len(CHAIN.links)
    assert index.matched_links(W2, CHAIN, events_only=True) == 0
    for i in range(8):  # 96 KiB of other conversations
        index.note_sent(W2, chain_of([str(i).encode() * 4096, b"x" * 8192]))
    assert index.matched_links(W2, CHAIN) == 0  # the oldest went first
    held, keeps = index.modelled_fill(W2)  # type: ignore[misc]
    assert held <= keeps == 16_384 * 4


def test_a_worker_without_events_whose_card_says_nothing_keeps_the_pools_capacity() -> None:
    index = CacheIndex(kv_capacity_tokens=1_000)
    asyncio.run(index.describe(W2, {"engine_info": {}}))
    index.note_sent(W2, CHAIN)  # 12 KiB: more than 1,000 tokens at 4 B a token
    assert 0 < index.matched_links(W2, CHAIN) < len(CHAIN.links)


def test_answers_correct_the_model_of_a_worker_without_events_only() -> None:
    index = CacheIndex(pending_s=10.0, clock=Clock())
    asyncio.run(index.describe(W2, {"engine_info": {"kv_capacity_tokens": 1_000_000}}))
    index.note_sent(W2, CHAIN)
    index.learn(W2, CHAIN, len(CHAIN.links), CHAIN.total_bytes, cached_tokens=0)  # it held none of it
    assert index._of(W2).model.share < 1.0
    index._of(W1).source = EventSource("tcp://w1:1", None, "a")  # its events are the truth: nothing to correct
    index.learn(W1, CHAIN, len(CHAIN.links), CHAIN.total_bytes, cached_tokens=0)
    assert index._of(W1).model.share == 1.0


def test_a_forgotten_worker_holds_nothing() -> None:
    index = CacheIndex()
    index.subscribe(W1, None)
    index.apply(W1, [stored(CHAIN.links)])
    index.forget(W1)
    assert index.matched_links(W1, CHAIN) == 0


def test_events_overrule_what_was_sent() -> None:
    index = CacheIndex(pending_s=10.0, clock=Clock())
    index._of(W1).source = EventSource("tcp://w1:1", None, "a")
    index.note_sent(W1, CHAIN)
    index.apply(W1, [stored(CHAIN.links)])
    index.apply(W1, [BlockRemoved(list(CHAIN.links[10:]), None)])
    # Evicted by the worker moments after it was sent: not held, though this process sent it there just now.
    assert index.matched_links(W1, CHAIN) == 10
    assert index.held(W1) == frozenset(CHAIN.links[:10])


def test_a_batch_for_a_worker_that_left_does_not_bring_it_back() -> None:
    index = CacheIndex()
    index.apply(W2, [stored(CHAIN.links)])  # from a subscriber being closed after forget()
    index.reset(W2)
    assert index.matched_links(W2, CHAIN) == 0 and index.held(W2) == frozenset()


def test_events_only_matching_ignores_what_was_sent() -> None:
    index = CacheIndex(pending_s=10.0, clock=Clock())
    index._of(W1).source = EventSource("tcp://w1:1", None, "a")
    index.apply(W1, [stored(CHAIN.links[:5])])
    index.note_sent(W1, CHAIN)
    assert index.matched_links(W1, CHAIN) == len(CHAIN.links)
    assert index.matched_links(W1, CHAIN, events_only=True) == 5


def test_work_a_worker_was_given_is_read_from_its_events_and_fades() -> None:
    clock = Clock()
    index = CacheIndex(clock=clock, recent_half_s=5.0)
    index._of(W1).source = EventSource("tcp://w1:1", None, "a")
    index.apply(W1, [stored(CHAIN.links)])
    given = CHAIN.covered_bytes(len(CHAIN.links))
    assert index.recent_bytes(W1) == given
    index.apply(W1, [stored(CHAIN.links)])  # held already: no new work
    assert index.recent_bytes(W1) == given
    clock.now = 5.0
    assert index.recent_bytes(W1) == given / 2
    index.apply(W1, [AllBlocksCleared(), stored(CHAIN.links)])  # a snapshot: a picture, not new work
    assert index.recent_bytes(W1) == given / 2
    assert index.recent_bytes(W2) is None  # no events flow from it


async def test_a_worker_is_caught_up_once_its_event_history_has_been_read() -> None:
    """A worker with a replay socket: until its history is read, routing to it would be blind (``/health`` says
    so); a published batch (or an empty history's answer) ends it."""
    publisher = EventPublisher("tcp://127.0.0.1:0", "tcp://127.0.0.1:0")
    publisher.start()
    publisher.publish([stored((7,))])
    index = CacheIndex()
    try:
        assert not index.catching_up("http://w")  # not followed: nothing to wait for
        index.subscribe("http://w", EventSource(publisher.endpoint, publisher.replay_endpoint, "a"))
        assert await eventually_async(lambda: not index.catching_up("http://w"))
        assert index.publishes("http://w")
    finally:
        await index.aclose()
        await publisher.aclose()


async def test_a_replay_that_never_answers_is_waited_for_a_bounded_time() -> None:
    """A replay socket that takes the request and says nothing keeps the worker catching up for ``CATCH_UP_S``
    only; a worker without a replay socket has no history to wait for."""
    clock = Clock()
    context = zmq.asyncio.Context.instance()
    silent = context.socket(zmq.ROUTER)
    silent.bind("tcp://127.0.0.1:0")
    live = context.socket(zmq.PUB)
    live.bind("tcp://127.0.0.1:0")
    index = CacheIndex(clock=clock)
    try:
        endpoint = live.getsockopt_string(zmq.LAST_ENDPOINT)
        index.subscribe("http://silent", EventSource(endpoint, silent.getsockopt_string(zmq.LAST_ENDPOINT), "a"))
        index.subscribe("http://no-history", EventSource(endpoint, None, "a"))
        assert await silent.poll(60_000)  # the replay request arrived, and goes unanswered
        assert index.catching_up("http://silent")
        assert not index.catching_up("http://no-history")
        clock.now += CATCH_UP_S
        assert not index.catching_up("http://silent")
    finally:
        await index.aclose()
        silent.close(linger=0)
        live.close(linger=0)

"""The cache-aware router: the worker where a request costs least, by what each worker holds and has queued.

Real ``PoolMember`` objects with the fields the orchestrator maintains set by hand, and a real ``CacheIndex``
fed the events a worker would publish.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections import Counter
from collections.abc import Iterator

import openai
import orjson
import pytest

from frontend.kv_events import BlockStored
from orchestrator.cache_index import CacheIndex, EventSource
from orchestrator.client_body import parse_client_body
from orchestrator.member import PoolMember
from orchestrator.routers import CacheAwareRouter, RoutingKey, routing_key
from tests.cluster import MODEL, start_orchestrator, start_worker
from tests.orchestrator.members import idle_members

SYSTEM = "You are a careful assistant. " * 400  # ~11 KB


def chat(*messages: tuple[str, str], session: str | None = None) -> RoutingKey:
    body: dict[str, object] = {"messages": [{"role": role, "content": text} for role, text in messages]}
    return routing_key(body, 1024, with_chain=True, session=session)


@pytest.fixture
def pool() -> Iterator[list[PoolMember]]:
    with idle_members(4, 9200) as workers:
        yield workers


def holds(index: CacheIndex, worker: PoolMember, key: RoutingKey) -> None:
    """``worker`` holds ``key``'s prompt, as its events would say (the index knows it as a pool member)."""
    if not index.held(worker.url):
        index.subscribe(worker.url, None)
    index.apply(worker.url, [BlockStored(list(key.chain.links), None, [], 16, None, None, None)])


def publishes(index: CacheIndex, worker: PoolMember) -> None:
    """``worker`` announced KV events and they flow (no subscriber needed: the test applies them)."""
    index._of(worker.url).source = EventSource(f"tcp://{worker.url}", None, "a")


def test_the_worker_holding_the_prefix_takes_the_request(pool: list[PoolMember]) -> None:
    decisions: list[str] = []
    index = CacheIndex()
    router = CacheAwareRouter(index, 1.25, decisions.append)
    first = chat(("system", SYSTEM), ("user", "What is 2+2?"))
    holds(index, pool[2], first)
    for worker in pool:
        publishes(index, worker)
    follow_up = chat(("system", SYSTEM), ("user", "What is 2+2?"), ("assistant", "4"), ("user", "And 3+3?"))
    assert all(router.pick(pool, follow_up) is pool[2] for _ in range(5))
    assert decisions == ["cache_hit"] * 5
    # The request is expected to cost that worker only what it does not hold.
    assert follow_up.prefill_tokens[pool[2].url] < follow_up.prompt_tokens // 4


def test_a_queue_of_uncached_work_moves_the_request_elsewhere(pool: list[PoolMember]) -> None:
    decisions: list[str] = []
    index = CacheIndex()
    router = CacheAwareRouter(index, 1.25, decisions.append)
    key = chat(("system", SYSTEM), ("user", "hello"))
    holds(index, pool[0], key)
    pool[0].inflight = 1
    pool[0].inflight_prefill_tokens = 10 * key.prompt_tokens  # a long miss is being prefilled there
    chosen = router.pick(pool, key)
    assert chosen is not pool[0]
    assert decisions == ["spill"]


def test_the_load_bound_spills_a_hot_worker(pool: list[PoolMember]) -> None:
    index = CacheIndex()
    router = CacheAwareRouter(index, 1.25)
    key = chat(("system", SYSTEM), ("user", "hello"))
    holds(index, pool[0], key)
    pool[0].inflight = 5  # far above the mean of the others' 0, whatever its queue in tokens
    assert router.pick(pool, key) is not pool[0]


def test_cold_requests_spread_over_the_workers(pool: list[PoolMember]) -> None:
    decisions: list[str] = []
    router = CacheAwareRouter(CacheIndex(), 1.25, decisions.append)
    picks = Counter(router.pick(pool, chat(("user", f"question {i}"))).url for i in range(40))  # type: ignore[union-attr]
    assert len(picks) == 4 and min(picks.values()) >= 5
    assert set(decisions) == {"cold"}


def test_a_session_lands_on_the_same_worker_in_every_router(pool: list[PoolMember]) -> None:
    """Two routers (two orchestrator processes) that share nothing send a conversation's cold turns alike."""
    for session in ("alice", "bob", "carol", "dave"):
        picks = {CacheAwareRouter(CacheIndex(), 1.25).pick(pool, chat(("user", f"hi {i}"), session=session)).url  # type: ignore[union-attr]
                 for i in range(6)}
        assert len(picks) == 1


def test_a_session_gives_way_to_a_worker_that_holds_much_more(pool: list[PoolMember]) -> None:
    now = [0.0]
    index = CacheIndex(clock=lambda: now[0])
    router = CacheAwareRouter(index, 1.25, clock=lambda: now[0])
    key = chat(("system", SYSTEM), ("user", "hello"), session="alice")
    own = router.pick(pool, chat(("user", "x"), session="alice"))
    holder = next(w for w in pool if w is not own)
    holds(index, holder, key)
    for worker in pool:  # their events say the holder holds it (without them, a new conversation goes by its name)
        publishes(index, worker)
    now[0] = 60.0  # stored long ago: no longer work it was given lately
    assert router.pick(pool, key) is holder


def test_excluded_and_unhealthy_workers_are_never_picked(pool: list[PoolMember]) -> None:
    index = CacheIndex()
    router = CacheAwareRouter(index, 1.25)
    key = chat(("system", SYSTEM), ("user", "hello"))
    holds(index, pool[0], key)
    pool[1].healthy = False
    assert router.pick(pool, key, [pool[0]]) in (pool[2], pool[3])
    assert router.pick(pool, key, pool) is None


def test_the_chain_tells_roles_apart_and_reads_long_texts_as_the_client_sent_them() -> None:
    assert chat(("system", "abc" * 200)).chain != chat(("user", "abc" * 200)).chain
    long_text = "line one\nline two \"quoted\" " * 3000  # past client_body's MIN_LITERAL: kept as its JSON literal
    raw = orjson.dumps({"messages": [{"role": "user", "content": long_text}], "pad": "x" * 70_000})
    parsed = parse_client_body(raw)
    from_raw = routing_key(parsed, 1024, with_chain=True).chain
    from_text = routing_key({"messages": [{"role": "user", "content": long_text}]}, 1024, with_chain=True).chain
    assert type(parsed["messages"][0]["content"]).__name__ == "RawText"
    assert from_raw == from_text  # a turn parsed whole and a turn kept raw name the same text alike


def test_a_follow_up_turn_extends_the_earlier_turns_chain() -> None:
    first = chat(("system", SYSTEM), ("user", "What is 2+2?"))
    second = chat(("system", SYSTEM), ("user", "What is 2+2?"), ("assistant", "4"), ("user", "And 3+3?"))
    assert second.chain.links[: len(first.chain.links)] == first.chain.links


def test_the_session_header_keeps_a_conversation_on_one_worker_end_to_end() -> None:
    """Over real HTTP: cold requests of one ``x-session-id`` (workers that publish nothing) meet one CTX worker,
    and two sessions need not share it."""
    with contextlib.ExitStack() as stack:
        ctx = [start_worker(stack, "context") for _ in range(3)]
        gen = start_worker(stack, "generation")
        orchestrator = start_orchestrator(stack, [w.url for w in ctx], [gen.url])
        client = openai.OpenAI(base_url=f"{orchestrator.url}/v1", api_key="unused", max_retries=0)
        landed: dict[str, set[int]] = {}
        for session in ("alice", "bob", "carol", "dave", "erin", "frank", "grace", "heidi"):
            for i in range(4):
                before = [len(w.recorder.exchanges) for w in ctx]
                client.chat.completions.create(model=MODEL, max_tokens=2, extra_headers={"x-session-id": session},
                                               messages=[{"role": "user", "content": f"{session} asks {i}"}])
                landed.setdefault(session, set()).update(
                    n for n, w in enumerate(ctx) if len(w.recorder.exchanges) > before[n])
        client.close()
    assert all(len(workers) == 1 for workers in landed.values()), landed
    assert len(set.union(*landed.values())) > 1


def test_new_conversations_go_where_little_work_went_lately_and_follow_ups_stay(pool: list[PoolMember]) -> None:
    """Workers that publish events, queues all empty, every worker holding the system prompt: new conversations
    spread by the work each worker's events say it was given lately; a conversation's next turn goes where its
    history is, whatever went there."""
    index = CacheIndex()
    router = CacheAwareRouter(index, 1.25)
    system = chat(("system", SYSTEM), ("user", "hello"))
    for worker in pool:
        holds(index, worker, system)
        publishes(index, worker)
    firsts = [chat(("system", SYSTEM), ("user", f"conversation {i} starts " * 200)) for i in range(40)]
    counts: Counter[str] = Counter()
    for key in firsts:
        chosen = router.pick(pool, key)
        assert chosen is not None
        counts[chosen.url] += 1
        holds(index, chosen, key)  # its events: it stored the new conversation's first turn
    assert max(counts.values()) - min(counts.values()) <= 2, counts
    busy = pool[1]
    index.apply(busy.url, [BlockStored([n + (1 << 40) for n in range(2000)], None, [], 16, None, None, None)])
    assert all(router.pick(pool, key) is not busy for key in firsts[:8])
    turns = (("system", SYSTEM), ("user", "my own question " * 300), ("assistant", "yes"), ("user", "and?"))
    holds(index, busy, chat(*turns))
    assert router.pick(pool, chat(*turns, ("assistant", "so"), ("user", "next"))) is busy


def test_without_events_a_new_conversation_goes_where_its_opening_hashes_in_every_process(
        pool: list[PoolMember]) -> None:
    """Workers that publish nothing: each process knows only what it sent. A new conversation goes to the worker
    its name hashes to (so another process, which never saw it, finds its next turn there), unless a burst is
    queued there; a next turn this process never saw goes there too."""
    routers = [CacheAwareRouter(CacheIndex(), 1.25) for _ in range(2)]
    system = chat(("system", SYSTEM), ("user", "hello"))
    # Their models differ: each sent the system prompt to one worker, not the same one.
    routers[0].index.note_sent(pool[0].url, system.chain)
    routers[1].index.note_sent(pool[3].url, system.chain)
    opening = (("system", SYSTEM), ("user", "a question of my own " * 20))
    firsts = [chat(("system", SYSTEM), ("user", f"conversation {i} starts " * 200)) for i in range(40)]
    placed = [routers[0].pick(pool, key) for key in firsts]
    assert len(set(placed)) == 4  # hashing spreads them
    assert placed == [routers[1].pick(pool, key) for key in firsts]  # and places them alike in every process
    home = routers[0].pick(pool, chat(*opening))
    assert home is not None
    routers[0].index.note_sent(home.url, chat(*opening).chain)
    # Its next turn through the other process, which knows nothing of it: the same worker.
    assert routers[1].pick(pool, chat(*opening, ("assistant", "yes"), ("user", "and?"))) is home
    home.inflight, home.inflight_prefill_tokens = 1, 20 * system.prompt_tokens  # a burst queued there
    assert routers[1].pick(pool, chat(*opening)) is not home
    home.inflight, home.inflight_prefill_tokens = 0, 0


def test_a_follow_up_stays_with_its_history_through_a_short_queue(pool: list[PoolMember]) -> None:
    """Leaving re-prefills the history elsewhere and leaves two copies: only for a worker under half the cost."""
    index = CacheIndex()
    router = CacheAwareRouter(index, 1.25)
    turns = (("system", SYSTEM), ("user", "my own question " * 300), ("assistant", "yes"))
    for worker in pool:
        holds(index, worker, chat(*turns[:1], ("user", "hello")))
    holder = pool[3]
    holds(index, holder, chat(*turns))
    follow_up = chat(*turns, ("user", "next"))
    history = follow_up.prompt_tokens - (follow_up.prompt_tokens * 11_000 // follow_up.chain.total_bytes)
    holder.inflight, holder.inflight_prefill_tokens = 1, history * 3 // 2  # elsewhere is cheaper, not by half
    assert router.pick(pool, follow_up) is holder
    holder.inflight_prefill_tokens = 4 * history  # now elsewhere is well under half
    assert router.pick(pool, follow_up) is not holder


def test_the_opening_names_the_system_prompt_that_conversations_share() -> None:
    """Two conversations over one system prompt share its name, not their own; without system texts, none."""
    first = chat(("system", SYSTEM), ("user", "one question"))
    second = chat(("system", SYSTEM), ("user", "another question"), ("assistant", "yes"), ("user", "and?"))
    assert first.shared_opening is not None and first.shared_opening == second.shared_opening
    assert first.conversation != second.conversation
    assert chat(("system", "You are terse."), ("user", "one question")).shared_opening != first.shared_opening
    assert chat(("user", "one question")).shared_opening is None


def conversations(system: str, count: int, start: int = 0) -> list[RoutingKey]:
    return [chat(("system", system), ("user", f"conversation {start + i} asks " * 40)) for i in range(count)]


def known_at(index: CacheIndex, pool: list[PoolMember], capacity_tokens: int) -> CacheIndex:
    """``index`` models every worker of ``pool`` as keeping ``capacity_tokens`` (as their cards would say)."""
    for worker in pool:
        asyncio.run(index.describe(worker.url, {"engine_info": {"kv_capacity_tokens": capacity_tokens}}))
    return index


def test_without_events_conversations_over_one_system_prompt_gather_on_its_share_of_the_workers(
        pool: list[PoolMember]) -> None:
    """Workers that publish nothing, two ~11 KB system prompts sharing the work, caches where one prompt takes a
    good share of the room: once each process has seen enough of the work, each prompt's conversations live on
    half the workers, not all (a worker holds one prompt, not both), and two processes that each saw half the
    requests place new conversations alike."""
    other = "You answer in French, briefly. " * 400
    routers = [CacheAwareRouter(known_at(CacheIndex(), pool, 16_384), 1.25, clock=lambda: 0.0) for _ in range(2)]
    warm_up = [key for pair in zip(conversations(SYSTEM, 70), conversations(other, 70), strict=True)
               for key in pair]
    for number, key in enumerate(warm_up):  # each process sees half the requests, of both prompts
        routers[number // 2 % 2].pick(pool, key)
    fresh = [key for pair in zip(conversations(SYSTEM, 30, 100), conversations(other, 30, 100), strict=True)
             for key in pair]
    placed = [routers[0].pick(pool, key) for key in fresh]
    ours, theirs = set(placed[::2]), set(placed[1::2])
    assert len(ours) == len(theirs) == 2
    assert not ours & theirs
    assert placed == [routers[1].pick(pool, key) for key in fresh]


def test_without_events_caches_with_room_for_every_system_prompt_keep_conversations_spread(
        pool: list[PoolMember]) -> None:
    """The same work, caches where both prompts take little room: grouping would save little, so conversations
    spread over every worker by their names."""
    other = "You answer in French, briefly. " * 400
    router = CacheAwareRouter(known_at(CacheIndex(), pool, 1 << 20), 1.25, clock=lambda: 0.0)
    for pair in zip(conversations(SYSTEM, 70), conversations(other, 70), strict=True):
        for key in pair:
            router.pick(pool, key)
    assert len({router.pick(pool, key) for key in conversations(SYSTEM, 30, 100)}) == 4


def test_without_events_groups_that_whole_workers_would_load_unevenly_are_not_formed(
        pool: list[PoolMember]) -> None:
    """Three workers, two prompts sharing the work evenly: one prompt would get one worker for half the work, past
    the load bound, so conversations spread over every worker as by their names alone."""
    other = "You answer in French, briefly. " * 400
    three = pool[:3]
    router = CacheAwareRouter(known_at(CacheIndex(), three, 16_384), 1.25, clock=lambda: 0.0)
    for pair in zip(conversations(SYSTEM, 40), conversations(other, 40), strict=True):
        for key in pair:
            router.pick(three, key)
    assert len({router.pick(three, key) for key in conversations(SYSTEM, 30, 100)}) == 3

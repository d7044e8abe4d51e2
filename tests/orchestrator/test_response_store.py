"""The response store's bounds: entries and bytes (least recently used out first), and age, on an injected clock.

Every case runs on both implementations, this process's memory and a real Redis, since both promise the same."""

from __future__ import annotations

from collections.abc import AsyncIterator, Callable
from typing import Any

import pytest

from frontend.config import ResponseStoreConfig
from orchestrator.response_store import MemoryResponseStore, ResponseStore
from orchestrator.response_store_redis import RedisResponseStore


class FakeClock:
    """A clock the test moves by hand: expiry is tested without sleeping."""

    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


StoreFactory = Callable[..., ResponseStore]


@pytest.fixture(params=["memory", "redis"])
async def store_of(request: pytest.FixtureRequest) -> AsyncIterator[StoreFactory]:
    """Makes a store of the parametrized kind with these limits, on this clock (a fresh one if none)."""
    made: list[ResponseStore] = []

    def make(clock: FakeClock | None = None, **limits: Any) -> ResponseStore:
        clock = clock or FakeClock()
        store: ResponseStore
        if request.param == "memory":
            store = MemoryResponseStore(ResponseStoreConfig.model_validate(limits), clock)
        else:
            url = request.getfixturevalue("redis_url")
            config = ResponseStoreConfig.model_validate({**limits, "backend": "redis", "url": url})
            store = RedisResponseStore(config, clock=clock)
        made.append(store)
        return store

    yield make
    for store in made:
        await store.aclose()


async def test_a_stored_response_is_found_with_its_conversation(store_of: StoreFactory) -> None:
    store = store_of()
    assert await store.put("resp_1", b'{"id":"resp_1"}', b"[1]", "resp_0")
    entry = await store.get("resp_1")
    assert entry is not None and entry.response == b'{"id":"resp_1"}' and entry.conversation == b"[1]"
    assert (entry.response_id, entry.session, entry.stored_at) == ("resp_1", "resp_0", 1000.0)
    assert await store.get("resp_2") is None


async def test_an_entry_keeps_the_tenant_that_stored_it(store_of: StoreFactory) -> None:
    store = store_of()
    await store.put("a", b"{}", b"[]", "a", "tenant-1")
    await store.put("b", b"{}", b"[]")
    entry_a, entry_b = await store.get("a"), await store.get("b")
    assert entry_a is not None and entry_a.owner == "tenant-1"
    assert entry_b is not None and entry_b.owner == ""


async def test_a_first_turn_is_its_own_session(store_of: StoreFactory) -> None:
    store = store_of()
    await store.put("resp_1", b"{}", b"[]")
    entry = await store.get("resp_1")
    assert entry is not None and entry.session == "resp_1"


async def test_the_entry_bound_evicts_the_least_recently_used(store_of: StoreFactory) -> None:
    store = store_of(max_entries=2)
    await store.put("a", b"{}", b"[]")
    await store.put("b", b"{}", b"[]")
    assert await store.get("a") is not None  # a is now more recent than b
    await store.put("c", b"{}", b"[]")
    assert [rid for rid in "abc" if await store.get(rid) is not None] == ["a", "c"]
    assert store.entries == 2


async def test_the_byte_bound_evicts_until_the_new_entry_fits(store_of: StoreFactory) -> None:
    store = store_of(max_bytes=30)
    await store.put("a", b"x" * 10, b"")
    await store.put("b", b"x" * 10, b"")
    await store.put("c", b"x" * 15, b"")
    assert await store.get("a") is None and await store.get("b") is not None and await store.get("c") is not None
    assert store.size_bytes == 25


async def test_an_entry_larger_than_the_byte_bound_is_not_kept(store_of: StoreFactory) -> None:
    store = store_of(max_bytes=10)
    await store.put("a", b"x" * 5, b"")
    assert not await store.put("b", b"x" * 11, b"")
    assert await store.get("b") is None and await store.get("a") is not None


async def test_an_entry_expires_ttl_after_it_was_stored_however_recently_used(store_of: StoreFactory) -> None:
    clock = FakeClock()
    store = store_of(clock, ttl_s=60)
    await store.put("old", b"{}", b"[]")
    clock.now += 30
    await store.put("new", b"{}", b"[]")
    assert await store.get("old") is not None  # used, but use does not extend its life
    clock.now += 30
    assert await store.get("old") is None
    assert await store.get("new") is not None
    clock.now += 30
    assert await store.get("new") is None
    await store.put("newest", b"{}", b"[]")  # a write counts what is left after expiry
    assert (store.entries, store.size_bytes) == (1, 4)


async def test_storing_an_id_again_replaces_it_and_counts_its_bytes_once(store_of: StoreFactory) -> None:
    store = store_of()
    await store.put("a", b"x" * 10, b"")
    await store.put("a", b"x" * 4, b"")
    entry = await store.get("a")
    assert entry is not None and entry.response == b"x" * 4
    assert store.entries == 1 and store.size_bytes == 4


async def test_delete_says_whether_there_was_something_to_delete(store_of: StoreFactory) -> None:
    store = store_of()
    await store.put("a", b"{}", b"[]")
    assert await store.delete("a")
    assert not await store.delete("a")
    assert await store.get("a") is None and store.size_bytes == 0

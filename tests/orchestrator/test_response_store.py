"""The response store's bounds: entries and bytes (least recently used out first), and age, on an injected clock."""

from __future__ import annotations

from frontend.config import ResponseStoreConfig
from orchestrator.response_store import ResponseStore


class FakeClock:
    """A clock the test moves by hand: expiry is tested without sleeping."""

    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def store_of(clock: FakeClock | None = None, **limits: float) -> ResponseStore:
    return ResponseStore(ResponseStoreConfig.model_validate(limits), clock or FakeClock())


def test_a_stored_response_is_found_with_its_conversation() -> None:
    store = store_of()
    assert store.put("resp_1", b'{"id":"resp_1"}', b"[1]")
    entry = store.get("resp_1")
    assert entry is not None and entry.response == b'{"id":"resp_1"}' and entry.conversation == b"[1]"
    assert store.get("resp_2") is None


def test_the_entry_bound_evicts_the_least_recently_used() -> None:
    store = store_of(max_entries=2)
    store.put("a", b"{}", b"[]")
    store.put("b", b"{}", b"[]")
    assert store.get("a") is not None  # a is now more recent than b
    store.put("c", b"{}", b"[]")
    assert [rid for rid in "abc" if store.get(rid) is not None] == ["a", "c"]
    assert len(store) == 2


def test_the_byte_bound_evicts_until_the_new_entry_fits() -> None:
    store = store_of(max_bytes=30)
    store.put("a", b"x" * 10, b"")
    store.put("b", b"x" * 10, b"")
    store.put("c", b"x" * 15, b"")
    assert store.get("a") is None and store.get("b") is not None and store.get("c") is not None
    assert store.size_bytes == 25


def test_an_entry_larger_than_the_byte_bound_is_not_kept() -> None:
    store = store_of(max_bytes=10)
    store.put("a", b"x" * 5, b"")
    assert not store.put("b", b"x" * 11, b"")
    assert store.get("b") is None and store.get("a") is not None


def test_an_entry_expires_ttl_after_it_was_stored_however_recently_used() -> None:
    clock = FakeClock()
    store = store_of(clock, ttl_s=60)
    store.put("old", b"{}", b"[]")
    clock.now += 30
    store.put("new", b"{}", b"[]")
    assert store.get("old") is not None  # used, but use does not extend its life
    clock.now += 30
    assert store.get("old") is None
    assert store.get("new") is not None
    clock.now += 30
    assert store.get("new") is None
    assert len(store) == 0 and store.size_bytes == 0


def test_storing_an_id_again_replaces_it_and_counts_its_bytes_once() -> None:
    store = store_of()
    store.put("a", b"x" * 10, b"")
    store.put("a", b"x" * 4, b"")
    entry = store.get("a")
    assert entry is not None and entry.response == b"x" * 4
    assert len(store) == 1 and store.size_bytes == 4


def test_delete_says_whether_there_was_something_to_delete() -> None:
    store = store_of()
    store.put("a", b"{}", b"[]")
    assert store.delete("a")
    assert not store.delete("a")
    assert store.get("a") is None and store.size_bytes == 0

"""The CTX-side KV store's ledger: every entry parked leaves as taken, released or expired, and is counted once."""

from __future__ import annotations

import pytest

from workers.engines.reference.kv_store import KVStore, KVStoreFull, KVStoreMiss


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def test_each_way_out_of_the_store_is_counted_once() -> None:
    clock = Clock()
    store = KVStore(max_bytes=1_000, ttl_s=10.0, clock=clock)
    taken_key = store.put("taken", b"x" * 100)
    released_key = store.put("released", b"y" * 200)
    store.put("aborted", b"z" * 50)
    store.put("expires", b"w" * 10)
    assert store.take("taken", taken_key) == b"x" * 100
    assert store.discard_with_key("released", "not-the-key") is False  # a wrong key releases nothing
    assert store.discard_with_key("released", released_key) is True
    assert store.discard("aborted") is True
    assert store.discard("aborted") is False  # gone already: not counted twice
    clock.now += 3
    ledger = store.ledger()
    assert ledger["parked_now"] == [{"id": "expires", "age_s": 3.0, "bytes": 10, "expires_in_s": 7.0}]
    assert ledger["parked_bytes"] == 10
    clock.now += 7
    assert store.expire() == 1
    assert store.ledger() == {"parked_now": [], "parked_bytes": 0,
                              "totals": {"parked": 4, "taken": 1, "released": 2, "expired": 1}}


def test_a_refused_put_and_a_missed_take_leave_the_ledger_balanced() -> None:
    clock = Clock()
    store = KVStore(max_bytes=100, ttl_s=1.0, clock=clock)
    key = store.put("a", b"a" * 80)
    with pytest.raises(KVStoreFull):
        store.put("b", b"b" * 80)  # not parked, so not counted
    with pytest.raises(KVStoreMiss):
        store.take("a", "wrong")
    clock.now += 1
    with pytest.raises(KVStoreMiss):
        store.take("a", key)  # expired on the way
    assert store.ledger()["totals"] == {"parked": 1, "taken": 0, "released": 0, "expired": 1}
    notified: list[tuple[int, int]] = []
    store.on_change = lambda entries, size: notified.append((entries, size))
    store.put("c", b"c")
    assert notified == [(1, 1)]

"""workers/prefix_holdings.py: an LRU of prefix-chain links bounded by the engine's capacity, prefix-closed (a
chain's tail goes before its head), and the one batch each record publishes, decoded from the real wire."""

from __future__ import annotations

import itertools
import random
from typing import Any

import pytest

from frontend.kv_events import AllBlocksCleared, BlockRemoved, BlockStored, KVCacheEvent, decode_batch, encode_batch
from frontend.prefix_chain import PrefixChain, chain_of
from workers.prefix_holdings import PrefixHoldings, link_runs


def prompt(seed: int, size: int) -> bytes:
    return random.Random(seed).randbytes(size)


class Wire:
    """Stands where the ``EventPublisher`` stands; keeps each batch as the real encoding decodes it."""

    def __init__(self) -> None:
        self.batches: list[list[KVCacheEvent]] = []

    def publish(self, events: Any) -> None:
        self.batches.append(decode_batch(encode_batch(events)).events)


def holdings(capacity: int) -> tuple[PrefixHoldings, Wire]:
    wire = Wire()
    return PrefixHoldings(capacity, wire), wire  # type: ignore[arg-type]


def share(chain: PrefixChain, prompt_tokens: int, index: int) -> int:
    """Link ``index``'s tokens, as the worker's record counts them (the one formula, link by link)."""
    return max(1, round(prompt_tokens * chain.link_bytes(index) / chain.total_bytes))


def expected_stored(chain: PrefixChain, prompt_tokens: int, start: int, end: int) -> list[BlockStored]:
    """Links ``start..end`` as BlockStored events: one per run of links of equal tokens, each parented on the
    link before it."""
    events: list[BlockStored] = []
    for index in range(start, end):
        size = share(chain, prompt_tokens, index)
        if events and events[-1].block_size == size:
            events[-1].block_hashes.append(chain.links[index])
        else:
            events.append(BlockStored(block_hashes=[chain.links[index]],
                                      parent_block_hash=chain.links[index - 1] if index else None, token_ids=[],
                                      block_size=size, lora_id=None, medium=None, lora_name=None))
    return events


def test_each_link_stands_for_its_share_of_the_prompt_tokens() -> None:
    chain = chain_of([prompt(1, 20_000)])  # links of more than one size
    runs = link_runs(chain, 5_000)
    assert len(runs) > 1 and runs[0][0] == 0 and runs[-1][1] == len(chain.links)
    assert all(a[1] == b[0] for a, b in itertools.pairwise(runs))
    assert [size for first, end, size in runs for _ in range(first, end)] == [
        share(chain, 5_000, i) for i in range(len(chain.links))]
    assert link_runs(PrefixChain((1, 2), 10_000_000), 3) == [(0, 2, 1)]  # never less than one token


def test_a_record_holds_every_link_and_publishes_them_in_chain_order() -> None:
    chain = chain_of([prompt(1, 20_000)])
    held, wire = holdings(1_000_000)
    held.record(chain, 5_000)
    assert held.links == len(chain.links)
    assert held.tokens == sum(share(chain, 5_000, i) for i in range(len(chain.links)))
    [batch] = wire.batches
    assert batch == expected_stored(chain, 5_000, 0, len(chain.links))
    assert len(batch) > 1  # one event per size of link
    assert [h for event in batch for h in event.block_hashes] == list(chain.links)  # type: ignore[union-attr]


def test_a_follow_up_publishes_only_its_new_links_parented_on_the_shared_head() -> None:
    first = prompt(2, 3_000)
    held, wire = holdings(1_000_000)
    earlier = chain_of([first])
    held.record(earlier, 750)
    follow_up = chain_of([first, prompt(3, 2_000)])
    held.record(follow_up, 1_250)
    known = len(earlier.links)
    assert wire.batches[-1] == expected_stored(follow_up, 1_250, known, len(follow_up.links))
    assert wire.batches[-1][0].parent_block_hash == follow_up.links[known - 1]  # type: ignore[union-attr]
    held.record(follow_up, 1_250)  # all held: nothing new, nothing published
    assert len(wire.batches) == 2


def test_eviction_takes_the_least_recent_chain_and_its_tail_before_its_head() -> None:
    a, b, c = (chain_of([prompt(seed, 2_560)]) for seed in (10, 11, 12))  # links of one size, one token count
    n, size = len(a.links), share(a, 640, 0)
    keep = n // 2
    held, wire = holdings((2 * n + keep) * size)
    held.record(a, 640)
    held.record(b, 640)
    held.record(a, 640)  # a is touched: b is the least recent now
    held.record(c, 640)  # room for two chains and a half: b's tail goes, last link first
    assert wire.batches[-1][-1] == BlockRemoved(block_hashes=list(reversed(b.links[keep:])), medium=None)
    assert all(link in held for link in (*a.links, *c.links, *b.links[:keep]))
    assert not any(link in held for link in b.links[keep:])
    assert held.tokens == (2 * n + keep) * size and held.links == 2 * n + keep


def test_what_is_held_stays_prefix_closed_under_any_mix_of_records() -> None:
    rng = random.Random(5)
    bases = [prompt(seed, 6_000) for seed in range(4)]
    held, wire = holdings(3_000)
    seen: dict[int, PrefixChain] = {}
    for _ in range(300):
        base = rng.choice(bases)
        chain = chain_of([base[: rng.randrange(256, 6_000)]])
        held.record(chain, chain.total_bytes // 4)
        seen.setdefault(id(chain), chain)
        for known in seen.values():
            flags = [link in held for link in known.links]
            assert flags == sorted(flags, reverse=True)  # held links are always a head of every chain
        assert held.tokens <= 3_000
    replayed: set[int] = set()  # the published batches, applied in order, give what is held
    for batch in wire.batches:
        for event in batch:
            if isinstance(event, BlockStored):
                replayed.update(event.block_hashes)  # type: ignore[arg-type]
            elif isinstance(event, BlockRemoved):
                replayed.difference_update(event.block_hashes)
    assert replayed == set(held.held())


def test_a_chain_longer_than_the_capacity_holds_the_head_that_fits() -> None:
    chain = chain_of([prompt(6, 20_000)])
    sizes = [share(chain, 5_000, i) for i in range(len(chain.links))]
    fits = len(chain.links) - 3
    held, wire = holdings(sum(sizes[:fits]) + sizes[fits] - 1)  # one token short of one more link
    held.record(chain, 5_000)
    assert held.links == fits and held.tokens == sum(sizes[:fits])
    assert [link in held for link in chain.links] == [True] * fits + [False] * 3
    assert wire.batches == [expected_stored(chain, 5_000, 0, fits)]
    tiny, tiny_wire = holdings(sizes[0] - 1)
    tiny.record(chain, 5_000)  # not even the first link fits
    assert tiny.links == 0 and tiny_wire.batches == []


def test_clear_publishes_all_blocks_cleared() -> None:
    held, wire = holdings(1_000)
    held.record(chain_of([prompt(7, 1_000)]), 250)
    held.clear()
    assert (held.links, held.tokens) == (0, 0)
    assert wire.batches[-1] == [AllBlocksCleared()]


def test_an_empty_chain_or_prompt_records_nothing() -> None:
    held, wire = holdings(1_000)
    held.record(PrefixChain((), 100), 25)
    held.record(chain_of([prompt(8, 1_000)]), 0)
    assert held.links == 0 and wire.batches == []


def test_without_a_publisher_it_still_keeps_the_record() -> None:
    held = PrefixHoldings(1_000, None)
    chain = chain_of([prompt(9, 1_000)])
    held.record(chain, 250)
    assert held.links == len(chain.links) > 0


def test_a_capacity_must_be_positive() -> None:
    with pytest.raises(ValueError):
        PrefixHoldings(0, None)

"""What this worker's engine holds, named by prefix-chain links, and published on vLLM's KV-event wire.

The engine keys its KV on token ids and routing speaks of text, so the worker records each request's chain once the
engine holds its KV, in an LRU sized to the engine's prefix cache. Links are touched last first, so a parent is
always newer than its children: eviction takes a chain's tail before its head, and subscribers read whole prefixes.
Each ``record`` publishes at most one batch, with no Python loop per link or per token."""

from __future__ import annotations

import bisect
import collections
import itertools
from collections.abc import Sequence
from typing import cast

from frontend.kv_events import AllBlocksCleared, BlockRemoved, BlockStored, EventPublisher, KVCacheEvent
from frontend.prefix_chain import LINK_ENDS, PrefixChain


def _runs() -> tuple[tuple[int, int, int], ...]:
    """(first link, end link, link bytes) of each run of links of one size: the chain's schedule, by index."""
    runs: list[tuple[int, int, int]] = []
    previous = 0
    for index, end in enumerate(LINK_ENDS):
        size = end - previous
        if runs and runs[-1][2] == size:
            runs[-1] = (runs[-1][0], index + 1, size)
        else:
            runs.append((index, index + 1, size))
        previous = end
    return tuple(runs)


_SNAPSHOT_EVENT_LINKS = 65_536  # names per BlockStored of a snapshot (block_size 0: the sizes vary)
_RUNS = _runs()  # one run per link size of frontend.prefix_chain's schedule


def link_runs(chain: PrefixChain, prompt_tokens: int) -> list[tuple[int, int, int]]:
    """The chain's links as runs ``(first, end, tokens of each link)``, where link i stands for
    ``max(1, round(prompt_tokens * link_bytes(i) / total_bytes))`` tokens: links of one size stand for the same
    number, so this is a handful of roundings, never one per link."""
    n = len(chain.links)
    total = chain.total_bytes
    if n == 0 or total <= 0:
        return []
    return [(first, min(end, n), max(1, round(prompt_tokens * size / total)))
            for first, end, size in _RUNS if first < n]


class PrefixHoldings:
    """An LRU of link name -> the tokens that link stands for, bounded by ``capacity_tokens``."""

    def __init__(self, capacity_tokens: int, publisher: EventPublisher | None) -> None:
        if capacity_tokens <= 0:
            raise ValueError(f"capacity_tokens must be > 0, got {capacity_tokens}")
        self.capacity_tokens = capacity_tokens
        self.publisher = publisher
        self._held: collections.OrderedDict[int, int] = collections.OrderedDict()  # least recent first
        self._tokens = 0

    @property
    def tokens(self) -> int:
        return self._tokens

    @property
    def links(self) -> int:
        return len(self._held)

    def __contains__(self, name: int) -> bool:
        return name in self._held

    def held(self) -> list[int]:
        """The held link names, least recent first."""
        return list(self._held)

    def record(self, chain: PrefixChain, prompt_tokens: int) -> None:
        """The engine now holds this prompt's KV: hold its links (what fits) and publish what changed."""
        links = chain.links
        if not links or prompt_tokens <= 0:
            return
        held = self._held
        runs = _fitting(link_runs(chain, prompt_tokens), self.capacity_tokens)
        fits = runs[-1][1] if runs else 0  # a chain longer than the capacity keeps the head that fits
        # Held now: a head of the chain (the record is prefix-closed), found by bisection.
        known = bisect.bisect_left(range(fits), True, key=lambda i: links[i] not in held)
        new_runs = [(max(first, known), end, size) for first, end, size in runs if end > known]
        if new_runs:
            new = links[known:fits]
            new_tokens: list[int] = []
            for first, end, size in new_runs:
                new_tokens += [size] * (end - first)
            # Last link first, so each link ends up more recent than the ones after it.
            held.update(zip(reversed(new), reversed(new_tokens), strict=True))
            self._tokens += sum((end - first) * size for first, end, size in new_runs)
        collections.deque(map(held.move_to_end, reversed(links[:known])), maxlen=0)  # touch the known head
        removed: list[int] = []
        excess = self._tokens - self.capacity_tokens
        if excess > 0:  # the least recent links that free at least ``excess`` tokens, counted at C speed
            short = len(list(itertools.takewhile(excess.__gt__, itertools.accumulate(held.values()))))
            removed = list(itertools.islice(held, short + 1))
            self._tokens -= sum(map(held.pop, removed))
        # Stored first, then removed: applied in order, the subscriber's picture ends as this record does.
        events: list[KVCacheEvent] = [_stored(links, first, end, size) for first, end, size in new_runs]
        if removed:
            events.append(BlockRemoved(block_hashes=cast("list[int | bytes]", removed), medium=None))
        self._publish(events)

    def snapshot(self) -> list[KVCacheEvent]:
        """Everything held, as events that rebuild a subscriber's picture from nothing (for one that asks for
        batches the publisher no longer keeps: frontend.kv_events)."""
        names = cast("list[int | bytes]", list(self._held))
        events: list[KVCacheEvent] = [AllBlocksCleared()]
        for start in range(0, len(names), _SNAPSHOT_EVENT_LINKS):
            events.append(BlockStored(block_hashes=names[start:start + _SNAPSHOT_EVENT_LINKS],
                                      parent_block_hash=None, token_ids=[], block_size=0, lora_id=None,
                                      medium=None, lora_name=None))
        return events

    def clear(self) -> None:
        """The engine dropped its whole cache (or this record can no longer be trusted)."""
        self._held.clear()
        self._tokens = 0
        self._publish([AllBlocksCleared()])

    def _publish(self, events: Sequence[KVCacheEvent]) -> None:
        if events and self.publisher is not None:
            self.publisher.publish(events)


def _fitting(runs: list[tuple[int, int, int]], capacity: int) -> list[tuple[int, int, int]]:
    """The runs cut to the longest head of the chain whose tokens fit ``capacity``."""
    kept: list[tuple[int, int, int]] = []
    for first, end, size in runs:
        count = min(end - first, capacity // size)
        if count:
            kept.append((first, first + count, size))
        capacity -= count * size
        if count < end - first:
            break
    return kept


def _stored(links: Sequence[int], first: int, end: int, size: int) -> BlockStored:
    """Links ``first..end`` (each standing for ``size`` tokens), parented on the link before them."""
    hashes: list[int | bytes] = list(links[first:end])
    return BlockStored(block_hashes=hashes, parent_block_hash=links[first - 1] if first else None, token_ids=[],
                       block_size=size, lora_id=None, medium=None, lora_name=None)

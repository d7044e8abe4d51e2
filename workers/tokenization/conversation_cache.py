"""The ids of recent prompts, by their text: a follow-up turn encodes only what it adds to its conversation.

An entry holds a prompt's text, its ids up to its last exact cut (``cut_rules``) and every exact cut inside it; a
new prompt reuses the entry that agrees with it longest, up to the last cut where they agree, whatever follows.
Entries are sorted by text, so the best one is beside the prompt's place (a binary search, no hash of the whole
prompt); a prompt that extends an entry replaces it. Bounded in bytes, least recently used out first."""

from __future__ import annotations

import bisect
import sys
import threading
from collections import OrderedDict
from dataclasses import dataclass, field

import numpy as np
import numpy.typing as npt

from frontend.token_codec import TokenArray

Cuts = npt.NDArray[np.int64]

_ENTRY_OVERHEAD_BYTES = 256  # the entry object, its arrays' headers, the list slots and the LRU's node


@dataclass(frozen=True, slots=True)
class CachedPrompt:
    text: str  # a prompt as it was rendered (what follows its last cut, e.g. "assistant\n", is compared, not used)
    ids: TokenArray  # its ids up to its last cut (read-only)
    char_cuts: Cuts  # increasing offsets in ``text`` where a cut is exact
    token_cuts: Cuts  # ids before each of them
    held_ids_bytes: int = 0  # what ``ids`` keeps alive, if more than itself (a view of a longer array)
    # Counted once, when made: a str's size can grow later (its UTF-8 form, once asked for, is kept with it), and
    # what is taken off at removal must be what was added.
    nbytes: int = field(init=False)

    def __post_init__(self) -> None:
        size = (sys.getsizeof(self.text) + max(self.ids.nbytes, self.held_ids_bytes) + self.char_cuts.nbytes
                + self.token_cuts.nbytes + _ENTRY_OVERHEAD_BYTES)
        object.__setattr__(self, "nbytes", size)

    def agreement(self, text: str) -> tuple[int, bool]:
        """How many of this entry's cuts ``text`` agrees with it up to (0: none), and whether ``text`` starts with
        all of this entry's text."""
        if text.startswith(self.text):
            return len(self.char_cuts), True
        cuts = self.char_cuts
        # Galloping from the start, then halving: each step compares (and copies) only the stretch not yet known
        # to agree, so another conversation that shares a system prompt costs about that prompt, not this text.
        agreed, disagreed, agreed_chars, step = 0, len(cuts) + 1, 0, 1  # agreed cuts hold; cut `disagreed` not
        while disagreed - agreed > 1:
            middle = min(agreed + step, disagreed - 1) if step else (agreed + disagreed) // 2
            end = int(cuts[middle - 1])
            if text.startswith(self.text[agreed_chars:end], agreed_chars):
                agreed, agreed_chars = middle, end
                step *= 2
            else:
                disagreed, step = middle, 0
        return agreed, False


@dataclass(frozen=True, slots=True)
class Reuse:
    """What a prompt takes from the cache: its first ``chars`` characters are ``ids`` (with the cuts inside)."""

    chars: int
    ids: TokenArray
    char_cuts: Cuts
    token_cuts: Cuts
    entry: CachedPrompt  # where it came from (the ids stay valid if the entry is evicted meanwhile: they are its own)
    extends: bool  # the prompt starts with all of the entry's text (a follow-up of it): its entry replaces this one


@dataclass(frozen=True, slots=True)
class CacheStats:
    lookups: int
    hits: int
    reused_tokens: int  # ids taken from the cache instead of being encoded again
    entries: int
    bytes: int
    max_bytes: int
    evictions: int


class ConversationCache:
    """Thread-safe: the worker encodes long prompts in threads, several at once."""

    def __init__(self, max_bytes: int) -> None:
        if max_bytes <= 0:
            raise ValueError("a conversation cache needs a positive size")
        self._max_bytes = max_bytes
        self._lock = threading.Lock()
        self._texts: list[str] = []  # sorted; self._entries[i].text is self._texts[i]
        self._entries: list[CachedPrompt] = []
        self._lru: OrderedDict[int, CachedPrompt] = OrderedDict()  # id(entry) -> entry, least recent first
        self._by_text: dict[int, CachedPrompt] = {}  # id(entry.text) -> entry
        self._bytes = 0
        self._lookups = self._hits = self._reused = self._evictions = 0

    def find(self, text: str, extends: str | None = None) -> Reuse | None:
        """The longest exact start of ``text`` whose ids are cached; None when nothing agrees. Counts nothing: the
        prompt that takes it says so with ``taken``. ``extends``: a text ``text`` is known to start with (built on
        it): its entry, if held, is taken without comparing texts (a longer branch held elsewhere is not sought)."""
        with self._lock:
            held = self._by_text.get(id(extends)) if extends is not None else None
            if held is not None and held.text is extends:
                best: tuple[int, bool, CachedPrompt] | None = (len(held.char_cuts), True, held)
            else:
                best = self._best(text)
        if best is None:
            return None
        agreed, whole, entry = best
        tokens = int(entry.token_cuts[agreed - 1])
        return Reuse(int(entry.char_cuts[agreed - 1]), entry.ids[:tokens], entry.char_cuts[:agreed],
                     entry.token_cuts[:agreed], entry, whole)

    def taken(self, reuse: Reuse | None) -> None:
        """Count one look-up, and ``reuse`` (if any) as used: a hit, its tokens, its entry the most recent."""
        with self._lock:
            self._lookups += 1
            if reuse is None:
                return
            self._hits += 1
            self._reused += int(reuse.ids.size)
            if id(reuse.entry) in self._lru:
                self._lru.move_to_end(id(reuse.entry))

    def store(self, entry: CachedPrompt, extended: CachedPrompt | None = None) -> None:
        """Keep ``entry``; an entry it extends (the same conversation, a turn earlier) goes. ``extended``: such an
        entry, already known (``Reuse.extends``), whose place the new one takes without comparing texts again."""
        size = entry.nbytes
        if size > self._max_bytes or not entry.text:
            return
        with self._lock:
            if extended is not None and id(extended) in self._lru and self._replace(extended, entry):
                self._evict()
                return
            place = bisect.bisect_left(self._texts, entry.text)
            if place < len(self._texts) and self._texts[place] == entry.text:
                self._lru.move_to_end(id(self._entries[place]))
                return
            if place > 0 and entry.text.startswith(self._texts[place - 1]):
                self._remove(place - 1)
                place -= 1
            self._insert(place, entry)
            self._evict()

    def _replace(self, extended: CachedPrompt, entry: CachedPrompt) -> bool:
        """Put ``entry``, whose text starts with ``extended``'s, in its place if nothing sorts between them (any
        text that does starts with ``extended``'s too: another branch of the conversation). The caller holds the
        lock; False: nothing changed."""
        place = self._index_of(extended)  # its own text compares to itself at no cost
        if len(entry.text) == len(extended.text):  # the same prompt again
            self._lru.move_to_end(id(extended))
            return True
        if place + 1 < len(self._texts) and not entry.text < self._texts[place + 1]:
            return False
        self._remove(place)
        self._insert(place, entry)
        return True

    def _insert(self, place: int, entry: CachedPrompt) -> None:
        self._texts.insert(place, entry.text)
        self._entries.insert(place, entry)
        self._lru[id(entry)] = entry
        self._by_text[id(entry.text)] = entry
        self._bytes += entry.nbytes

    def _evict(self) -> None:
        while self._bytes > self._max_bytes:
            oldest = next(iter(self._lru.values()))
            self._remove(self._index_of(oldest))
            self._evictions += 1

    def _best(self, text: str) -> tuple[int, bool, CachedPrompt] | None:
        """(cuts agreed, whether ``text`` extends it, entry) of the entry that agrees with ``text`` the longest;
        the caller holds the lock."""
        place = bisect.bisect_right(self._texts, text)
        best: tuple[int, bool, CachedPrompt] | None = None
        for entry in self._entries[max(place - 1, 0): place + 1]:
            agreed, extends = entry.agreement(text)
            if agreed and (best is None or agreed > best[0]):
                best = (agreed, extends, entry)
        return best

    def stats(self) -> CacheStats:
        with self._lock:
            return CacheStats(self._lookups, self._hits, self._reused, len(self._entries), self._bytes,
                              self._max_bytes, self._evictions)

    def _index_of(self, entry: CachedPrompt) -> int:
        place = bisect.bisect_left(self._texts, entry.text)
        while self._entries[place] is not entry:
            place += 1
        return place

    def _remove(self, place: int) -> None:
        entry = self._entries.pop(place)
        del self._texts[place]
        del self._lru[id(entry)]
        del self._by_text[id(entry.text)]
        self._bytes -= entry.nbytes

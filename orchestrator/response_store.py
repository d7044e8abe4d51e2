"""The store of Responses answers behind ``previous_response_id`` and ``GET``/``DELETE /v1/responses/{id}``: its
interface, and the bounded in-memory implementation (the default, one process's own).

Each entry holds its whole conversation, so eviction or expiry can make a follow-up a 404 but never shorten its
conversation. The clock is injectable, so expiry is tested without sleeping."""

from __future__ import annotations

import time
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass
from typing import Protocol

from frontend.config import ResponseStoreConfig

Clock = Callable[[], float]


@dataclass(frozen=True, slots=True)
class StoredResponse:
    response_id: str
    response: bytes  # the response object's JSON, as GET /v1/responses/{id} answers it
    conversation: bytes  # a JSON list of input items: what a follow-up's input continues
    stored_at: float
    session: str = ""  # the conversation's key for routing: the id of its first response
    owner: str = ""  # the tenant that stored it ("" for none): only its own key reads or continues it

    @property
    def size(self) -> int:
        return len(self.response) + len(self.conversation)


class ResponseStore(Protocol):
    """Where answers are kept. Each call is whole or nothing: a response is stored with its conversation, or not
    at all. A store that cannot answer raises ``ResponseStoreUnavailableError`` (a 503)."""

    limits: ResponseStoreConfig

    async def put(self, response_id: str, response: bytes, conversation: bytes, session: str = "",
                  owner: str = "") -> bool:
        """Keep the response (replacing one of the same id); False when it alone exceeds the byte bound."""
        ...

    async def get(self, response_id: str) -> StoredResponse | None:
        """The stored response, now the most recently used; None if unknown, evicted or expired."""
        ...

    async def delete(self, response_id: str) -> bool:
        """Whether there was such a response (now deleted)."""
        ...

    @property
    def entries(self) -> int:
        """How many responses are stored (for a shared store: as this process last saw)."""
        ...

    @property
    def size_bytes(self) -> int:
        ...

    async def start(self) -> None:
        """Called once the orchestrator starts (a shared store checks it can be reached)."""
        ...

    async def aclose(self) -> None:
        ...


class MemoryResponseStore:
    """This process's own store: an LRU in a dict. Its calls never wait."""

    def __init__(self, limits: ResponseStoreConfig, clock: Clock = time.monotonic) -> None:
        self.limits = limits
        self._clock = clock
        self._entries: OrderedDict[str, StoredResponse] = OrderedDict()  # least recently used first
        self._by_age: OrderedDict[str, float] = OrderedDict()  # oldest first: expiry pops from the front
        self._bytes = 0

    @property
    def entries(self) -> int:
        return len(self._entries)

    @property
    def size_bytes(self) -> int:
        return self._bytes

    async def put(self, response_id: str, response: bytes, conversation: bytes, session: str = "",
                  owner: str = "") -> bool:
        self._delete(response_id)
        entry = StoredResponse(response_id, response, conversation, self._clock(), session or response_id, owner)
        if entry.size > self.limits.max_bytes:
            return False
        self._expire()
        self._entries[response_id] = entry
        self._by_age[response_id] = entry.stored_at
        self._bytes += entry.size
        while len(self._entries) > self.limits.max_entries or self._bytes > self.limits.max_bytes:
            self._delete(next(iter(self._entries)))
        return True

    async def get(self, response_id: str) -> StoredResponse | None:
        self._expire()
        entry = self._entries.get(response_id)
        if entry is not None:
            self._entries.move_to_end(response_id)
        return entry

    async def delete(self, response_id: str) -> bool:
        return self._delete(response_id)

    async def start(self) -> None:
        return None

    async def aclose(self) -> None:
        return None

    def _delete(self, response_id: str) -> bool:
        entry = self._entries.pop(response_id, None)
        if entry is None:
            return False
        del self._by_age[response_id]
        self._bytes -= entry.size
        return True

    def _expire(self) -> None:
        deadline = self._clock() - self.limits.ttl_s
        while self._by_age:
            oldest, stored_at = next(iter(self._by_age.items()))
            if stored_at > deadline:
                return
            self._delete(oldest)

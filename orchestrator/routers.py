"""Routers: which worker of a pool takes a request. Chosen by name in exactly one place, ``make_router``.

- ``round_robin``: cycle over healthy workers.
- ``least_loaded``: fewest in-flight requests, or in-flight prompt tokens (``load_metric``), as the
  orchestrator itself counts them (no polling: the orchestrator sees every request start and end).
- ``prefix_affinity``: consistent hashing of the prompt's leading characters with bounded load, so requests
  that share a prefix meet the worker whose cache holds it, without piling onto one worker.
"""

from __future__ import annotations

import bisect
import hashlib
import itertools
import math
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Protocol

from frontend.config import RouterConfig
from orchestrator.client_body import RawText
from orchestrator.member import PoolMember

_VIRTUAL_NODES = 64


@dataclass(frozen=True, slots=True)
class RoutingKey:
    """What a router may know of a request, computed without tokenizing."""

    prompt_prefix: str = ""
    prompt_tokens: int = 0  # exact when known (after CTX), else an estimate


class Router(Protocol):
    def pick(self, workers: Sequence[PoolMember], key: RoutingKey, exclude: Iterable[PoolMember] = ()
             ) -> PoolMember | None: ...


def _candidates(workers: Sequence[PoolMember], exclude: Iterable[PoolMember]) -> list[PoolMember]:
    excluded = {id(w) for w in exclude}
    return [w for w in workers if w.healthy and id(w) not in excluded]


class RoundRobinRouter:
    def __init__(self) -> None:
        self._counter = itertools.count()

    def pick(self, workers: Sequence[PoolMember], key: RoutingKey, exclude: Iterable[PoolMember] = ()
             ) -> PoolMember | None:
        candidates = _candidates(workers, exclude)
        return candidates[next(self._counter) % len(candidates)] if candidates else None


class LeastLoadedRouter:
    def __init__(self, by_prompt_tokens: bool) -> None:
        self.by_prompt_tokens = by_prompt_tokens
        self._counter = itertools.count()

    def pick(self, workers: Sequence[PoolMember], key: RoutingKey, exclude: Iterable[PoolMember] = ()
             ) -> PoolMember | None:
        candidates = _candidates(workers, exclude)
        if not candidates:
            return None
        # Rotate the start so that ties spread instead of always landing on the first worker.
        start = next(self._counter) % len(candidates)
        rotated = candidates[start:] + candidates[:start]
        if self.by_prompt_tokens:
            return min(rotated, key=lambda w: (w.inflight_prompt_tokens, w.inflight))
        return min(rotated, key=lambda w: (w.inflight, w.inflight_prompt_tokens))


class PrefixAffinityRouter:
    def __init__(self, prefix_chars: int, load_factor: float) -> None:
        self.prefix_chars = prefix_chars
        self.load_factor = load_factor
        self._rings: dict[tuple[str, ...], tuple[list[int], list[int]]] = {}  # urls -> (points, owner index)

    @staticmethod
    def _hash(text: str) -> int:
        return int.from_bytes(hashlib.blake2b(text.encode("utf-8", "surrogatepass"), digest_size=8).digest(), "big")

    def _ring(self, workers: Sequence[PoolMember]) -> tuple[list[int], list[PoolMember]]:
        # Built once per set of healthy workers (64 hashes and a sort per worker), not once per request.
        urls = tuple(w.url for w in workers)
        ring = self._rings.get(urls)
        if ring is None:
            if len(self._rings) > 64:  # membership churn: keep the cache small
                self._rings.clear()
            points = sorted((self._hash(f"{url}#{i}"), index) for index, url in enumerate(urls)
                            for i in range(_VIRTUAL_NODES))
            ring = self._rings[urls] = ([p for p, _ in points], [i for _, i in points])
        return ring[0], [workers[i] for i in ring[1]]

    def pick(self, workers: Sequence[PoolMember], key: RoutingKey, exclude: Iterable[PoolMember] = ()
             ) -> PoolMember | None:
        candidates = _candidates(workers, exclude)
        if not candidates:
            return None
        hashes, owners = self._ring(candidates)
        total = sum(w.inflight for w in candidates)
        # Bounded load: no worker takes more than load_factor x the mean (counting this request).
        limit = max(1, math.ceil(self.load_factor * (total + 1) / len(candidates)))
        start = bisect.bisect(hashes, self._hash(key.prompt_prefix[: self.prefix_chars]))
        for step in range(len(owners)):
            worker = owners[(start + step) % len(owners)]
            if worker.inflight + 1 <= limit:
                return worker
        return min(candidates, key=lambda w: w.inflight)


def make_router(config: RouterConfig, default: str = "round_robin") -> Router:
    kind = config.type or default
    if kind == "least_loaded":
        return LeastLoadedRouter(by_prompt_tokens=config.load_metric == "prompt_tokens")
    if kind == "prefix_affinity":
        return PrefixAffinityRouter(config.prefix_chars, config.load_factor)
    return RoundRobinRouter()


def routing_key(body: dict[str, object], prefix_chars: int) -> RoutingKey:
    """The prompt's first characters and a token estimate (~4 characters a token), read from the raw body. A
    long text the orchestrator kept as its JSON literal (``RawText``) counts its bytes, and only its first
    characters are decoded."""
    pieces: list[str] = []
    chars = 0
    for text in _prompt_texts(body):
        if chars < prefix_chars:
            wanted = prefix_chars - chars
            pieces.append(text[:wanted] if isinstance(text, str) else text.prefix(wanted))
        chars += len(text) if isinstance(text, str) else text.size
    explicit = body.get("prompt_token_ids")
    estimate = len(explicit) if isinstance(explicit, list) else chars // 4 + 1
    return RoutingKey("".join(pieces), estimate)


def _prompt_texts(body: dict[str, object]) -> Iterable[str | RawText]:
    for name in ("instructions", "prompt", "input", "messages"):
        value = body.get(name)
        if isinstance(value, str | RawText):
            yield value
        elif isinstance(value, list):
            for item in value:
                if isinstance(item, str):
                    yield item
                elif isinstance(item, dict):
                    content = item.get("content")
                    if isinstance(content, str | RawText):
                        yield content
                    elif isinstance(content, list):
                        yield from (p["text"] for p in content
                                    if isinstance(p, dict) and isinstance(p.get("text"), str | RawText))

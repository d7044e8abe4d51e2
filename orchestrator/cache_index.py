"""What each worker of a pool holds in its prefix cache, by prefix-chain link (``frontend.prefix_chain``).

Two sources: the workers' KV events (``frontend.kv_events``), which give every orchestrator process the same
picture without a mesh, and what this process sent where: for the gap until a worker's events say so, and for a
worker that publishes nothing, a model of its cache aged as its engine ages it and corrected by its answers
(``orchestrator.sent_cache``). What a worker holds is prefix-closed (``workers.prefix_holdings``), so the longest
held prefix is a binary search over the chain. See docs/routing.md."""

from __future__ import annotations

import asyncio
import collections
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass

from frontend.internal_secret import InternalSecret
from frontend.kv_events import AllBlocksCleared, BlockRemoved, BlockStored, EventSubscriber, KVCacheEvent
from frontend.prefix_chain import PrefixChain
from orchestrator.sent_cache import SentCacheModel, card_capacity_tokens, link_bytes, vllm_capacity_tokens
from orchestrator.upstream.base import Transport

logger = logging.getLogger(__name__)

SENT_LINKS_PER_WORKER = 65_536  # what-was-sent-where awaiting a worker's events: ~1 GiB of prompt text at most
# The prompt KV a worker that publishes nothing is assumed to keep, where neither its card nor the pool's
# ``kv_capacity_tokens`` says: an 8B model's KV (128 KiB a token) in 32 GiB of an 80 GB accelerator.
DEFAULT_KV_CAPACITY_TOKENS = 262_144
MAX_HELD_LINKS = 4 * 1024 * 1024  # links one worker's events may name (~128 MiB of sets): past that, a bad worker
# How long a newly followed worker's replay may keep the orchestrator from calling itself ready: a replay answer
# takes milliseconds; one that has not come by then is not waited for (routing goes on from what was sent).
CATCH_UP_S = 5.0


@dataclass(frozen=True, slots=True)
class EventSource:
    """Where a worker publishes its KV events, from its card; a new ``incarnation`` is a restarted worker."""

    endpoint: str
    replay_endpoint: str | None
    incarnation: str
    capacity_tokens: int = 0  # prompt KV the worker's engine keeps for reuse; 0: not said


class _WorkerHoldings:
    __slots__ = ("card_capacity", "followed_at", "held", "held_bytes", "model", "recent_at", "recent_bytes", "sent",
                 "source", "subscriber")

    def __init__(self, capacity_tokens: int) -> None:
        self.held: set[int] = set()  # from the worker's events
        self.held_bytes = 0  # of prompt text those links cover (a link's size is in its name: its position)
        # Prompt bytes newly stored lately (decayed), by its events: the uncached work it was given, as every
        # process sees it alike.
        self.recent_bytes = 0.0
        self.recent_at = 0.0
        self.sent: collections.OrderedDict[int, float] = collections.OrderedDict()  # link -> when sent here
        self.source: EventSource | None = None
        self.subscriber: EventSubscriber | None = None
        self.followed_at = 0.0  # when the current source was first followed
        # For a worker whose events do not flow: its cache as this process's sends and its answers say.
        self.model = SentCacheModel(capacity_tokens)
        self.card_capacity: int | None = None  # the capacity its card says, if it says one

    @property
    def live(self) -> bool:
        """Its events flow: announced, and (once followed) something came."""
        return self.source is not None and (self.subscriber is None or self.subscriber.delivered)


class CacheIndex:
    def __init__(self, pending_s: float = 10.0, clock: Callable[[], float] = time.monotonic,
                 recent_half_s: float = 5.0, secret: InternalSecret | None = None,
                 kv_capacity_tokens: int = DEFAULT_KV_CAPACITY_TOKENS) -> None:
        self.pending_s = pending_s
        self.kv_capacity_tokens = kv_capacity_tokens  # a worker's whose card says none
        self.recent_half_s = recent_half_s
        self._clock = clock
        self._workers: dict[str, _WorkerHoldings] = {}
        # The deployment secret: the CURVE keys its workers' sockets require (frontend.kv_events).
        self.secret = secret

    def _of(self, url: str) -> _WorkerHoldings:
        holdings = self._workers.get(url)
        if holdings is None:
            holdings = self._workers[url] = _WorkerHoldings(self.kv_capacity_tokens)
        return holdings

    # -- the workers' events ----------------------------------------------------------------------------------
    def subscribe(self, url: str, source: EventSource | None) -> None:
        """Follow ``url``'s events from ``source`` (None: it publishes none). A source already followed is left
        alone; a new one (a restarted worker) starts from an empty picture."""
        holdings = self._of(url)
        if holdings.source == source:
            return
        self._stop(holdings)
        holdings.held.clear()
        holdings.held_bytes = 0
        holdings.model.clear()  # a restarted worker, or one whose events now flow
        holdings.source = source
        holdings.followed_at = self._clock()
        if source is not None:
            holdings.subscriber = EventSubscriber(source.endpoint, source.replay_endpoint,
                                                  lambda events: self.apply(url, events),
                                                  lambda: self.reset(url), secret=self.secret)
            holdings.subscriber.start()
            logger.info("following the KV events of %s at %s", url, source.endpoint)

    async def describe(self, url: str, card: object, transport: Transport | None = None,
                       timeout_s: float = 5.0) -> None:
        """``url``'s ``/v1/models`` card: the prompt KV its engine keeps, which bounds the model of its cache
        where its events do not flow. A vLLM server's card says none: its ``/metrics`` cache config does, read
        with ``transport``. Else this index's ``kv_capacity_tokens``."""
        capacity = card_capacity_tokens(card)
        if capacity is None and transport is not None and _owned_by(card) == "vllm":
            try:
                reply = await transport.get("/metrics", timeout_s)
                if reply.status_code == 200:
                    capacity = vllm_capacity_tokens(reply.content.decode("utf-8", "replace"))
            except Exception as exc:  # a capacity is a refinement: routing goes on with the configured one
                logger.info("could not read %s/metrics for its KV capacity: %s", url, exc)
        holdings = self._of(url)
        holdings.card_capacity = capacity
        holdings.model.resize(capacity or self.kv_capacity_tokens)

    def publishes(self, url: str) -> bool:
        """``url`` announced events and they flow."""
        holdings = self._workers.get(url)
        return holdings is not None and holdings.live

    def catching_up(self, url: str) -> bool:
        """``url`` keeps a history of its events (a replay socket) that this process has not read yet, and has
        not been waited for ``CATCH_UP_S``: routing to it now would be blind to what it already holds."""
        holdings = self._workers.get(url)
        if holdings is None or holdings.source is None or holdings.source.replay_endpoint is None:
            return False
        subscriber = holdings.subscriber
        return (subscriber is not None and not subscriber.delivered
                and self._clock() - holdings.followed_at < CATCH_UP_S)

    def apply(self, url: str, events: list[KVCacheEvent]) -> None:
        """A batch of ``url``'s events. A link they name is no longer a guess from what was sent: stored, it is
        held; removed, it is gone, however recently this process sent it there."""
        holdings = self._workers.get(url)
        if holdings is None:  # a batch from a subscriber being closed: the worker left the pool
            return
        held, sent = holdings.held, holdings.sent
        if len(held) > MAX_HELD_LINKS:  # a worker publishing without bound: its picture is not trusted
            logger.warning("%s says it holds more than %d links: its picture is dropped", url, MAX_HELD_LINKS)
            held.clear()
            holdings.held_bytes = 0
        stored, rebuilt = 0, False
        for event in events:
            if isinstance(event, BlockStored):
                for name in event.block_hashes:
                    if isinstance(name, int):
                        if name not in held:
                            held.add(name)
                            size = link_bytes(name)
                            holdings.held_bytes += size
                            stored += size
                        sent.pop(name, None)
            elif isinstance(event, BlockRemoved):
                for name in event.block_hashes:
                    if isinstance(name, int):
                        if name in held:
                            held.discard(name)
                            holdings.held_bytes -= link_bytes(name)
                        sent.pop(name, None)
            elif isinstance(event, AllBlocksCleared):
                held.clear()
                holdings.held_bytes = 0
                sent.clear()
                rebuilt = True
        if stored and not rebuilt:  # a picture rebuilt (a snapshot) is what it holds, not work it was just given
            holdings.recent_bytes = self._recent(holdings) + stored
            holdings.recent_at = self._clock()

    def recent_bytes(self, url: str) -> float | None:
        """Prompt bytes ``url``'s events said it newly stored lately, each weighing half as much every
        ``recent_half_s``; None for a worker whose events do not flow."""
        holdings = self._workers.get(url)
        return self._recent(holdings) if holdings is not None and holdings.live else None

    def _recent(self, holdings: _WorkerHoldings) -> float:
        age = self._clock() - holdings.recent_at
        return holdings.recent_bytes * 0.5 ** (age / self.recent_half_s) if holdings.recent_bytes else 0.0

    def fill(self, url: str) -> tuple[int, int] | None:
        """(bytes of prompt text ``url`` holds, the tokens its engine keeps for reuse), by its events; None if
        it publishes none or said no capacity."""
        holdings = self._workers.get(url)
        if holdings is None or holdings.source is None or not holdings.source.capacity_tokens:
            return None
        return holdings.held_bytes, holdings.source.capacity_tokens

    def modelled_fill(self, url: str) -> tuple[int, float] | None:
        """(bytes of prompt text the model of ``url``'s cache holds, the bytes it keeps) for a worker whose events
        do not flow; None for one whose do."""
        holdings = self._workers.get(url)
        if holdings is None or holdings.live:
            return None
        return holdings.model.held_bytes, holdings.model.capacity_bytes

    def learn(self, url: str, chain: PrefixChain, predicted_links: int, prompt_tokens: int | None,
              cached_tokens: int | None) -> None:
        """``url`` answered a request for ``chain``'s prompt: its length in tokens and the tokens its engine
        found cached, against the ``predicted_links`` it was believed to hold. Corrects the model of a worker
        whose events do not flow (its events are the truth for one whose do)."""
        holdings = self._workers.get(url)
        if holdings is not None and not holdings.live:
            holdings.model.learn(chain, prompt_tokens, predicted_links, cached_tokens)

    def held(self, url: str) -> frozenset[int]:
        """The links ``url``'s events say it holds (a copy)."""
        holdings = self._workers.get(url)
        return frozenset(holdings.held) if holdings is not None else frozenset()

    def reset(self, url: str) -> None:
        holdings = self._workers.get(url)
        if holdings is not None:
            holdings.held.clear()
            holdings.held_bytes = 0

    def forget(self, url: str) -> None:
        """``url`` left the pool."""
        holdings = self._workers.pop(url, None)
        if holdings is not None:
            self._stop(holdings)

    @staticmethod
    def _stop(holdings: _WorkerHoldings) -> None:
        if holdings.subscriber is not None:
            subscriber, holdings.subscriber = holdings.subscriber, None
            task = asyncio.get_running_loop().create_task(subscriber.aclose())
            _closing.add(task)
            task.add_done_callback(_closing.discard)

    async def aclose(self) -> None:
        for holdings in self._workers.values():
            if holdings.subscriber is not None:
                await holdings.subscriber.aclose()
                holdings.subscriber = None
        await asyncio.gather(*_closing, return_exceptions=True)

    # -- what this process sent ---------------------------------------------------------------------------------
    def note_sent(self, url: str, chain: PrefixChain) -> None:
        if not chain.links:
            return
        holdings = self._of(url)
        if not holdings.live:
            holdings.model.note(chain)
            if holdings.source is None:  # no events will ever name it: the model is the whole record
                return
        sent = holdings.sent
        now = self._clock()
        for link in reversed(chain.links):  # the head most recent: it outlives the tail, as on the worker
            sent[link] = now
            sent.move_to_end(link)
        while len(sent) > SENT_LINKS_PER_WORKER:
            sent.popitem(last=False)
        # The events will say it soon: what is older than that is dropped.
        horizon = now - self.pending_s
        while sent:
            link, when = next(iter(sent.items()))
            if when >= horizon:
                break
            del sent[link]

    # -- matching -----------------------------------------------------------------------------------------------
    def matched_links(self, url: str, chain: PrefixChain, events_only: bool = False) -> int:
        """How many of ``chain``'s leading links ``url`` holds; ``events_only``: by its events alone, never by
        what was sent there."""
        holdings = self._workers.get(url)
        links = chain.links
        if holdings is None or not links:
            return 0
        held = holdings.held
        if not holdings.live:
            # Events never came (none announced, or announced and never delivered): the model of its cache
            # from what was sent is all there is.
            modelled = _NOTHING_SENT if events_only else holdings.model.links
            if not held and not modelled:
                return 0

            def holds(link: int) -> bool:
                return link in held or link in modelled
        else:
            sent = _NOTHING_SENT if events_only else holdings.sent
            if not held and not sent:
                return 0
            # What was sent to a worker whose events flow counts until they should have named it.
            horizon = self._clock() - self.pending_s

            def holds(link: int) -> bool:
                if link in held:
                    return True
                when = sent.get(link)
                return when is not None and when >= horizon

        if holds(links[-1]):
            return len(links)
        low, high = 0, len(links) - 1  # the answer is in [low, high]: links[:low] is held, links[:high + 1] is not
        while low < high:
            middle = (low + high + 1) // 2
            if holds(links[middle - 1]):
                low = middle
            else:
                high = middle - 1
        return low


_NOTHING_SENT: collections.OrderedDict[int, float] = collections.OrderedDict()


def _owned_by(card: object) -> object:
    return card.get("owned_by") if isinstance(card, dict) else None


_closing: set[asyncio.Task[None]] = set()  # subscribers being closed, kept alive until they are

"""Routers: which worker of a pool takes a request, chosen by name in one place (``make_router``).

``round_robin``, ``least_loaded``, ``prefix_affinity``, and ``cache_aware`` (the CTX default: the worker where the
request costs least, counting the prompt it does not hold). docs/routing.md says how each chooses and what it needs."""

from __future__ import annotations

import bisect
import hashlib
import itertools
import math
import time
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

import orjson

from frontend.config import RouterConfig
from frontend.prefix_chain import LINK_ENDS, ChainBuilder, PrefixChain
from orchestrator.cache_index import CacheIndex
from orchestrator.client_body import RawText
from orchestrator.member import PoolMember
from orchestrator.sent_cache import answer_cached_tokens

_VIRTUAL_NODES = 64


_NO_CHAIN = PrefixChain()
# cache_aware: a conversation's own worker (rendezvous hashing of its key) is taken while its cost is within this
# factor of the cheapest worker's, so that near-ties do not scatter a conversation; a real saving wins.
_SESSION_SLACK = 1.5
ROUTING_DECISIONS = ("cache_hit", "spill", "cold", "session")
_OPENINGS_KEPT = 256  # cache_aware without events: the system prompts whose share of the requests is kept
# Requests lately before the shares of their system prompts size groups: shares from a few are noise, and another
# process, seeing other requests, would size the groups otherwise (and place the conversations elsewhere).
_OPENING_SAMPLE = 64.0
# Groups only where holding one system prompt instead of every one frees at least this share of a worker's cache:
# with room to spare, the coarser balance of whole-worker groups and their moves cost more than they save.
_GROUP_ROOM = 0.125
_SPILL_MARGIN = 2.0  # cache_aware: a follow-up leaves its history's worker only for one under half its cost
_CHAINED_TOKEN_IDS = 16_384  # of a prompt_token_ids list, the ids the chain names (~100 KB of JSON)


@dataclass(frozen=True, slots=True)
class RoutingKey:
    """What a router may know of a request, computed without tokenizing."""

    prompt_prefix: str = ""
    prompt_tokens: int = 0  # exact when known (after CTX), else an estimate
    chain: PrefixChain = _NO_CHAIN  # the prompt's prefix chain; empty unless a cache-aware pool needs it
    session: str | None = None  # a conversation's key, the same in every process
    # The one worker the request may go to (conditional disaggregation: the GEN worker holding its prompt); if
    # it cannot take it, no other does (the flow goes through CTX instead).
    only: str | None = None
    # Whether the prompt continues a conversation (it holds an earlier answer: an assistant message or item);
    # None: it cannot tell (a completion's prompt).
    follow_up: bool | None = None
    # The uncached tokens a cache-aware router expects the request to cost each worker it picked: what that
    # worker's queue counts while the request is there (PoolMember.inflight_prefill_tokens).
    prefill_tokens: dict[str, int] = field(default_factory=dict, hash=False, compare=False)
    # What routing computes alike in every process to keep a conversation together where the workers say
    # nothing of what they hold: a name for the prompt's opening (its system texts and its first other text);
    # None for a completion's prompt.
    conversation: str | None = None
    opening_links: int = 0  # the chain's links that lie within that opening
    # A name for the system texts the opening starts with (what many conversations share: a system prompt);
    # None without any.
    shared_opening: str | None = None
    shared_links: int = 0  # the chain's links that lie within those system texts
    # The leading links of the chain each worker it picked was believed to hold, to check against the tokens the
    # worker's answer says it found cached (CacheIndex.learn).
    held_links: dict[str, int] = field(default_factory=dict, hash=False, compare=False)

    def prefill_at(self, url: str) -> int:
        return self.prefill_tokens.get(url, self.prompt_tokens)


class Router(Protocol):
    def pick(self, workers: Sequence[PoolMember], key: RoutingKey, exclude: Iterable[PoolMember] = ()
             ) -> PoolMember | None: ...


def _candidates(workers: Sequence[PoolMember], exclude: Iterable[PoolMember]) -> list[PoolMember]:
    excluded = {id(w) for w in exclude}
    return [w for w in workers if w.routable and id(w) not in excluded]


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


class CacheAwareRouter:
    def __init__(self, index: CacheIndex, load_factor: float,
                 on_decision: Callable[[str], None] | None = None,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.index = index
        self.load_factor = load_factor
        self.on_decision = on_decision
        self._clock = clock
        # url -> (uncached tokens sent lately, as of when): for workers whose events do not flow
        self._recent: dict[str, tuple[float, float]] = {}
        # The system texts conversations' requests opened with lately (None: none), each with how many, as of
        # when: where workers publish nothing.
        self._openings: dict[str | None, tuple[float, float, int]] = {}  # (..., the system texts' bytes)

    def pick(self, workers: Sequence[PoolMember], key: RoutingKey, exclude: Iterable[PoolMember] = ()
             ) -> PoolMember | None:
        candidates = _candidates(workers, exclude)
        if not candidates:
            return None
        # A bound on requests in flight, as prefix_affinity's, one request looser: the cost already weighs the
        # queue in tokens, the bound only stops estimates from piling requests onto one worker.
        limit = math.ceil(self.load_factor * (sum(w.inflight for w in candidates) + 1) / len(candidates)) + 1
        matched_links = {w.url: self.index.matched_links(w.url, key.chain) if key.chain.links else 0
                         for w in candidates}
        matched = {url: _tokens_covered(key, links) for url, links in matched_links.items()}
        longest = max(matched.values())
        eligible = [w for w in candidates if w.inflight + 1 <= limit] or candidates
        # Ties (equal cost) are broken by rendezvous hashing of what sets this request apart: its conversation
        # key, else the first link of its prompt that no worker holds (a new conversation's own first words).
        # Never by a counter or anything else of this process's: every process breaks them alike.
        # Where workers publish nothing, this process knows only its own share of what went where: a
        # conversation is kept together by what every process computes alike, its opening's name.
        session = key.session
        blind = any(not self.index.publishes(w.url) for w in candidates)
        if session is None and blind:
            session = key.conversation
            if session is not None:
                self._note_opening(key.shared_opening, self._clock(), key.chain.covered_bytes(key.shared_links))
        tie = session if session is not None else _first_unheld(key, max(matched_links.values()))

        def cost(worker: PoolMember) -> int:
            uncached = max(1, key.prompt_tokens - matched[worker.url])
            return uncached + worker.inflight_prefill_tokens + self._evicted(worker, key, uncached)

        now = self._clock()
        # A conversation's next turn (its prompt holds an earlier answer) goes where its history is; a new one
        # is placed. A completion's prompt says neither: what most workers hold (a shared system prompt, once it
        # has spread) says nothing of where a conversation lives, what only some hold beyond it is a history.
        follow_up = key.follow_up
        if follow_up is None:
            follow_up = longest > sorted(matched.values(), reverse=True)[len(candidates) // 2]
        if follow_up:
            # A conversation's next turn: where its history is, unless that worker's queue costs more than
            # prefilling the history elsewhere.
            def rank(worker: PoolMember) -> tuple[float, int]:
                return cost(worker), -_rendezvous(tie, worker.url)
        else:
            # A new conversation (or an unrelated prompt), which will bring its next turns to the worker
            # chosen now. Chosen for the work sent there lately too, not only the queue of this instant: at a
            # few requests in flight the queues are mostly empty, and each new conversation would go to
            # whichever worker is idle at that instant, however many conversations already live there.
            def rank(worker: PoolMember) -> tuple[float, int]:
                return cost(worker) + self._recent_work(worker.url, now, key), -_rendezvous(tie, worker.url)

        best = min(eligible, key=rank)
        if follow_up and matched[best.url] < longest:
            # Spilling a conversation re-prefills its history elsewhere and leaves two copies: only for a clear
            # saving, not a near-tie (a queue of a request or two at the worker that holds it).
            holder = min((w for w in eligible if matched[w.url] == longest), key=rank, default=None)
            if holder is not None and cost(holder) <= _SPILL_MARGIN * cost(best):
                best = holder
        decision = "cache_hit" if longest and matched[best.url] == longest else "spill" if longest else "cold"
        # A next turn of which this process sent no later turn than the first: no worker holds more than its
        # opening by this process's model (links are coarse: one that names the first words may name only words
        # every conversation over that system prompt starts with).
        unseen = follow_up and max(matched_links.values()) <= key.opening_links
        group = self._opening_group(candidates, key.shared_opening, now) if blind and key.session is None else None
        if unseen and group is not None and max(matched_links.values()) >= key.shared_links + 2:
            # Its system prompt's group may have moved since its first turn (the shares shifted, or there were no
            # groups yet): where this process sent that turn, its model holds the conversation's own first words
            # (a link wholly past the system texts), and the cost finds it there.
            unseen = False
        if session is not None and blind and (not follow_up or unseen):
            # Workers that publish nothing, and a new conversation, or a next turn of one this process never saw
            # (each process sees only its share of the turns, and its model holds only what it sent). Another
            # process will look for the next turns knowing nothing of where this one sent what, so the worker is
            # one every process picks alike: the first, in the order the conversation's name hashes to, whose
            # queue is within one prefill of the opening of the least queued (bounded-load hashing). Not by this
            # process's model of what each worker holds, which another process's model need not match, nor by
            # the work it alone sent each lately: hashing spreads conversations evenly, and a shared system
            # prompt costs each worker one prefill.
            opening = min(key.opening_links, len(key.chain.links)) or len(key.chain.links)
            opening_tokens = key.prompt_tokens if opening >= len(key.chain.links) else _tokens_covered(key, opening)
            bound = min(w.inflight_prefill_tokens for w in eligible) + opening_tokens
            queued = [w for w in eligible if w.inflight_prefill_tokens <= bound]
            within = [w for w in queued if group is not None and w.url in group] or queued
            best = min(within, key=lambda w: -_rendezvous(tie, w.url))
            decision = "cache_hit" if longest and matched[best.url] == longest else "spill" if longest else "cold"
            if not longest and key.session is not None:
                decision = "session"
        elif session is not None:
            own = max(eligible, key=lambda w: _rendezvous(tie, w.url))
            if own is not best and cost(own) <= _SESSION_SLACK * cost(best):
                best = own
                named = "session" if key.session is not None else decision  # a conversation its client named
                decision = named if not longest else decision if matched[own.url] == longest else "spill"
            elif own is best and not longest and key.session is not None:
                decision = "session"
        # What the flow already set stands (GEN computes none of a handed-off prompt).
        uncached = key.prefill_tokens.setdefault(best.url, max(1, key.prompt_tokens - matched[best.url]))
        key.held_links[best.url] = matched_links[best.url]
        self._recent[best.url] = (self._recent_work(best.url, now) + uncached, now)
        if self.on_decision is not None:
            self.on_decision(decision)
        return best

    def _note_opening(self, shared: str | None, now: float, size: int) -> None:
        openings = self._openings
        count, when, _ = openings.get(shared, (0.0, now, size))
        openings[shared] = (count * 0.5 ** ((now - when) / self.index.recent_half_s) + 1.0, now, size)
        if len(openings) > _OPENINGS_KEPT:  # many one-off openings: keep the most frequent
            for name, _ in sorted(openings.items(), key=lambda item: item[1][0])[:len(openings) // 2]:
                del openings[name]

    def _opening_group(self, workers: Sequence[PoolMember], shared: str | None, now: float) -> set[str] | None:
        """The workers a conversation opening with the system texts ``shared`` names lives on, where workers
        publish nothing: each set of system texts that opened at least half a worker's share of the requests
        lately gets its share of the N workers, rounded, the first in the rendezvous order of its name not taken
        by a set named before it. Conversations over one system prompt gather on as many workers as their share
        of the work needs, and a worker holds one system prompt instead of every one: under cache pressure, room
        for more histories. Every process computes it alike from what every process sees alike (the workers; the
        shares of the requests it gets, which are the fleet's); None: no group (no system texts, too rare a set,
        too few requests lately to tell, or groups that whole workers would fit badly: spread over every
        worker)."""
        if shared is None or len(workers) < 2:
            return None
        decay = self.index.recent_half_s
        counts = {name: count * 0.5 ** ((now - when) / decay) for name, (count, when, _) in self._openings.items()}
        total = sum(counts.values())
        if total < _OPENING_SAMPLE:
            return None
        wanted = {name: len(workers) * count / total for name, count in counts.items() if name is not None}
        sizes = {name: math.floor(want + 0.5) for name, want in wanted.items()}
        grouped = sorted(name for name, size in sizes.items() if size >= 1)
        if shared not in grouped:
            return None
        prompts = [self._openings[name][2] for name in grouped]
        fills = [self.index.modelled_fill(w.url) for w in workers]
        room = min((fill[1] for fill in fills if fill is not None), default=0.0)
        if sum(prompts) - max(prompts) < _GROUP_ROOM * room:
            return None
        taken: set[str] = set()
        groups: dict[str, list[str]] = {}
        for name in grouped:
            order = sorted((w.url for w in workers if w.url not in taken), key=lambda url: -_rendezvous(name, url))
            groups[name] = order[:sizes[name]]
            taken.update(groups[name])
            # Groups are whole workers: where one's would take more than load_factor times their part (few
            # workers, shares that split them unevenly), that costs more than the system prompts saved.
            if wanted[name] > self.load_factor * len(groups[name]):
                return None
        return set(groups[shared])

    def _recent_work(self, url: str, now: float, key: RoutingKey | None = None) -> float:
        """Uncached tokens given to ``url`` lately, each weighing less as it ages: by the worker's own events
        (what it newly stored, the same for every process), at this prompt's bytes per token; for a worker
        whose events do not flow, what this process sent it."""
        stored = self.index.recent_bytes(url)
        if stored is not None and key is not None and key.chain.total_bytes:
            return stored * key.prompt_tokens / key.chain.total_bytes
        work, when = self._recent.get(url, (0.0, now))
        return float(work * 0.5 ** ((now - when) / self.index.recent_half_s))

    def _evicted(self, worker: PoolMember, key: RoutingKey, uncached: int) -> int:
        """The cached tokens ``worker`` would have to evict to hold this request's uncached ones: a full
        worker pays for a new conversation with other conversations' histories, which cost a prefill again
        when they come back; a worker with room pays nothing. (Once every worker is full, every worker pays
        about the same, and the rest of the cost decides.)"""
        if not key.chain.total_bytes:
            return 0
        fill = self.index.fill(worker.url)
        if fill is not None:
            held_bytes, capacity = fill
            held = held_bytes * key.prompt_tokens // key.chain.total_bytes  # at this prompt's bytes per token
            return max(0, held + uncached - capacity)
        modelled = self.index.modelled_fill(worker.url)
        if modelled is None:
            return 0
        # What this process's model of the worker holds and keeps, in bytes of prompt text: the excess, in this
        # prompt's tokens.
        held_bytes, capacity_bytes = modelled
        uncached_bytes = uncached * key.chain.total_bytes / max(key.prompt_tokens, 1)
        excess = held_bytes + uncached_bytes - capacity_bytes
        return int(excess * key.prompt_tokens / key.chain.total_bytes) if excess > 0 else 0


def _tokens_covered(key: RoutingKey, links: int) -> int:
    chain = key.chain
    return key.prompt_tokens * chain.covered_bytes(links) // chain.total_bytes if links and chain.total_bytes else 0


def _first_unheld(key: RoutingKey, longest: int) -> str:
    links = key.chain.links
    if links:
        return str(links[min(longest, len(links) - 1)])
    return key.prompt_prefix


def matched_tokens(index: CacheIndex, worker: PoolMember, key: RoutingKey, events_only: bool = False) -> int:
    """The prompt tokens ``worker`` holds, estimated from the share of the prompt's bytes its held links cover
    (``events_only``: by its events alone)."""
    links = index.matched_links(worker.url, key.chain, events_only) if key.chain.links else 0
    return _tokens_covered(key, links)


def _rendezvous(session: str, url: str) -> int:
    """Highest-random-weight hashing: every process ranks the workers for a session alike."""
    return int.from_bytes(hashlib.blake2b(f"{session}\x00{url}".encode("utf-8", "surrogatepass"),
                                          digest_size=8).digest(), "big")


def make_router(config: RouterConfig, default: str = "round_robin", index: CacheIndex | None = None,
                on_decision: Callable[[str], None] | None = None) -> Router:
    kind = config.type or default
    if kind == "cache_aware":
        index = index if index is not None else CacheIndex(config.pending_s, recent_half_s=config.recent_half_s)
        return CacheAwareRouter(index, config.load_factor, on_decision)
    if kind == "least_loaded":
        return LeastLoadedRouter(by_prompt_tokens=config.load_metric == "prompt_tokens")
    if kind == "prefix_affinity":
        return PrefixAffinityRouter(config.prefix_chars, config.load_factor)
    return RoundRobinRouter()


def routing_key(body: dict[str, object], prefix_chars: int, with_chain: bool = False,
                session: str | None = None, exact: bool = False) -> RoutingKey:
    """The prompt's first characters and a token estimate (~4 characters a token), read from the raw body. A
    long text the orchestrator kept as its JSON literal (``RawText``) counts its bytes, and only its first
    characters are decoded. ``with_chain``: also the prompt's prefix chain, over each text's JSON literal (the
    bytes a ``RawText`` holds; a short text encoded back, as orjson writes it), each after its role."""
    pieces: list[str] = []
    chars = 0
    builder = ChainBuilder(sampled=not exact) if with_chain else None
    opening = hashlib.blake2b(digest_size=8) if with_chain else None
    conversation: str | None = None
    shared: str | None = None
    fed = opening_bytes = shared_bytes = 0
    for role, text in _prompt_texts(body):
        if chars < prefix_chars:
            wanted = prefix_chars - chars
            pieces.append(text[:wanted] if isinstance(text, str) else text.prefix(wanted))
        chars += len(text) if isinstance(text, str) else text.size
        if builder is not None:
            literal = orjson.dumps(text) if isinstance(text, str) else text.literal
            builder.feed(role)
            builder.feed(literal)
            fed += len(role) + len(literal)
            if opening is not None:
                if role not in _SYSTEM_ROLES:  # a conversation's own first words: every later turn repeats them
                    if fed > len(role) + len(literal):  # system texts before them
                        shared, shared_bytes = opening.hexdigest(), fed - len(role) - len(literal)
                    opening.update(_opening_piece(role, literal))
                    conversation = opening.hexdigest() if role != _ROLES["prompt"] else None
                    opening, opening_bytes = None, fed
                else:
                    opening.update(_opening_piece(role, literal))
    explicit = body.get("prompt_token_ids")
    estimate = len(explicit) if isinstance(explicit, list) else chars // 4 + 1
    if builder is not None and isinstance(explicit, list):
        builder.feed(b"prompt_token_ids:")
        # Without the closing bracket, so a longer list extends it; its first ids only (131k ids would cost
        # ~1.3 ms to encode): a routing name, so a bounded prefix of the prompt is enough.
        builder.feed(orjson.dumps(explicit[:_CHAINED_TOKEN_IDS])[:-1])
    chain = builder.chain() if builder is not None else _NO_CHAIN
    return RoutingKey("".join(pieces), estimate, chain, session, follow_up=_continues(body),
                      conversation=conversation, shared_opening=shared if conversation is not None else None,
                      opening_links=min(bisect.bisect_right(LINK_ENDS, opening_bytes), len(chain.links)),
                      shared_links=min(bisect.bisect_right(LINK_ENDS, shared_bytes), len(chain.links)))


def _opening_piece(role: bytes, literal: bytes | memoryview) -> bytes:
    """What names one text of a prompt's opening: its role, its size and its first and last KiB (a long system
    prompt is not hashed whole a second time; texts that differ only within are rare and cost only a guess)."""
    size = len(literal)
    return b"".join((role, size.to_bytes(8, "big"), bytes(literal[:1024]),
                     bytes(literal[-1024:]) if size > 1024 else b""))


def _prompt_texts(body: dict[str, object]) -> Iterator[tuple[bytes, str | RawText]]:
    """Each text of the prompt, in order, after the role it is spoken in (the chain tells "user: a" from
    "system: a")."""
    for name in ("instructions", "prompt", "input", "messages"):
        value = body.get(name)
        if isinstance(value, str | RawText):
            yield _ROLES.get(name, b"\x00"), value
        elif isinstance(value, list):
            for item in value:
                if isinstance(item, str):
                    yield _ROLES.get(name, b"\x00"), item
                elif isinstance(item, dict):
                    role = _role(item.get("role"))
                    content = item.get("content")
                    if isinstance(content, str | RawText):
                        yield role, content
                    elif isinstance(content, list):
                        for part in content:
                            if isinstance(part, dict) and isinstance(part.get("text"), str | RawText):
                                yield role, part["text"]


# A Responses ``input`` string is the user's message: a follow-up (response_memory) spells it as a user item.
_ROLES = {"instructions": b"\x00instructions\x00", "prompt": b"\x00prompt\x00", "input": b"\x00user\x00",
          "messages": b"\x00messages\x00"}
_ROLE_CACHE: dict[str, bytes] = {}
_SYSTEM_ROLES = frozenset((b"\x00system\x00", b"\x00developer\x00", _ROLES["instructions"]))
_ANSWERS = ("assistant", "tool", "function_call", "function_call_output")  # roles and Responses item types


def _continues(body: dict[str, object]) -> bool | None:
    """Whether the prompt holds an earlier answer (an assistant message, a tool call or its output): a
    conversation's later turn. None for a completion's prompt, which cannot say."""
    for name in ("messages", "input"):
        items = body.get(name)
        if isinstance(items, list):
            return any(isinstance(item, dict) and (item.get("role") in _ANSWERS or item.get("type") in _ANSWERS)
                       for item in items)
    return None if "prompt" in body else False


def _role(role: object) -> bytes:
    if not isinstance(role, str):
        return b"\x00?\x00"
    marker = _ROLE_CACHE.get(role)
    if marker is None:
        marker = f"\x00{role}\x00".encode("utf-8", "surrogatepass")
        if len(_ROLE_CACHE) < 64:  # roles are a handful of names; a client inventing more is not cached
            _ROLE_CACHE[role] = marker
    return marker


def learn_from_answer(index: CacheIndex, url: str, key: RoutingKey, response: Mapping[str, Any],
                      handoff: Mapping[str, Any], prompt_tokens: int | None) -> None:
    """A worker's answer to a request routed by ``key``: what its engine found cached, against what it was
    believed to hold when it was picked, corrects the model of a worker that publishes nothing
    (``CacheIndex.learn``)."""
    if key.chain.links:
        index.learn(url, key.chain, key.held_links.get(url, 0), prompt_tokens,
                    answer_cached_tokens(response, handoff))

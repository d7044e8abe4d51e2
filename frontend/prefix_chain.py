"""A prompt's prefix chain: names for its leading pieces of text, the vocabulary routing shares with the workers.

Engines key their KV blocks on token ids, and the orchestrator never tokenizes (at 131k tokens that alone would
cost more than the orchestrator's whole request). So routing speaks of text: the prompt's bytes, as the client's
JSON spelled them, are cut into *links* at fixed offsets, and link i is named by a keyed hash of everything up to
its end, so one name stands for a whole prefix, and two prompts share link i exactly when they share its bytes (a
32-bit collision aside: routing then guesses wrong, it never answers wrong).

**Keyed names.** A name is BLAKE2b keyed with ``InternalSecret.derive("prefix-chain")`` (frontend/internal_secret.py),
cut to 32 bits, under the link's index: equal prefixes get equal names in every process that holds the deployment
secret, and to anyone without it a name says nothing about the prompt (an unkeyed checksum let whoever read the
KV events, or a worker's chain headers, test which of several guessed documents another user sent). Without a
secret the names are keyed all the same, with a fixed public key: one code path whatever the configuration, the
same cost, and names that change only in value (never in shape) when an operator adds the secret; they then
protect nothing, as nothing else is protected without it. Every name of a deployment is computed by its
orchestrators (``orchestrator.routers.routing_key``); workers only echo the names they were sent, so the key
matters where chains are built, and every orchestrator process reads the same ``DISAGG_INTERNAL_TOKEN``.

The offsets depend on the position alone, never on the prompt's length, so a follow-up turn, which extends the
earlier prompt, shares all the earlier prompt's links. They are fine near the start (short prompts need to be
told apart) and coarser further on (a long prompt costs few links): 512 B links to 8 KiB, 2 KiB links to 64 KiB,
8 KiB links to 512 KiB, 32 KiB links after that, at most ``MAX_LINKS``. A tail shorter than its link is not named.

**Sampled far links.** Past ``FULL_BYTES`` a link's name covers only its last ``SAMPLE_BYTES`` (and, chained,
the names before it), not every byte: hashing all of a 131k-token prompt cost the orchestrator ~0.29 ms a
request, a sixth of its whole cost there. What it gives up: two prompts that differ only inside a far link's
unsampled part get the same name for that link. Where they diverge for good (two conversations), the next link's
sample already differs, so a match is overestimated by at most one link (8 or 32 KiB of a prompt of hundreds);
only an edit that leaves the rest identical (one changed word in a long document) can hide beyond that. Routing
then guesses wrong, never answers wrong: the engine's own cache decides what it reuses.

Cost at 131k tokens (524 KB, 100 links), timeit's best here: keyed BLAKE2b over ~120 KB and a digest per link,
0.16 ms (the unkeyed CRC-32 it replaced: 0.07 ms); a whole-byte chain (``sampled=False``) hashes all 524 KB, 0.47
ms (0.16 ms). SHA-256 under a key prefix was no cheaper where it counts (0.15 ms sampled) and is no MAC by design.

The orchestrator sends a request's chain to the worker in ``CHAIN_HEADER``, with the deployment's
``INTERNAL_TOKEN_HEADER``; the worker records what its engine holds under those names and publishes it
(``frontend.kv_events``), so every orchestrator process learns what every worker holds, whoever routed there. A
worker takes a chain only from a caller that proved it is the orchestrator (``trusted_chain_header``): anyone else's
chain would be published as if the engine held it, and steer every orchestrator's routing.
"""

from __future__ import annotations

import base64
import binascii
import bisect
import functools
import hashlib
import os
from collections.abc import Iterable, Mapping
from dataclasses import dataclass

import numpy as np

from frontend.internal_secret import INTERNAL_TOKEN_ENV, INTERNAL_TOKEN_HEADER, InternalSecret

CHAIN_HEADER = "x-disagg-prefix-chain"
MAX_LINKS = 1024
# (link size, offset where links of this size stop)
_SCHEDULE = ((512, 8 * 1024), (2048, 64 * 1024), (8192, 512 * 1024), (32 * 1024, 1 << 62))
FULL_BYTES = 64 * 1024  # links ending here or before are named by every byte
SAMPLE_BYTES = 1024  # a link past that: by its last this many bytes
# The key of a deployment without a secret: public, so that every process still names alike (module docstring).
PUBLIC_CHAIN_KEY = b"disagg-serve prefix chain: no deployment secret"
_NAME_BYTES = 4  # the low 32 bits of a name; the link's index is above them (``name >> 32``)


def chain_key(secret: InternalSecret | None) -> bytes:
    """The key link names are made with: derived from the deployment secret, or the public one without it."""
    return secret.derive("prefix-chain") if secret is not None else PUBLIC_CHAIN_KEY


@functools.lru_cache(maxsize=4)
def _key_of_token(token: str) -> bytes:
    return chain_key(InternalSecret(token) if token else None)


def key_from_env() -> bytes:
    """This process's chain key, from ``DISAGG_INTERNAL_TOKEN`` as it is now (one lookup and a cache hit)."""
    return _key_of_token(os.environ.get(INTERNAL_TOKEN_ENV, ""))


def trusted_chain_header(headers: Mapping[str, str], secret: InternalSecret | None) -> str | None:
    """The request's ``CHAIN_HEADER`` if it may be believed: from a caller holding the deployment secret (or any
    caller where there is none). Anyone else's is ignored, not refused: the request is served, its chain unrecorded."""
    value = headers.get(CHAIN_HEADER)
    if value is None or secret is None or secret.accepts(headers.get(INTERNAL_TOKEN_HEADER)):
        return value
    return None


def _link_ends() -> tuple[int, ...]:
    ends: list[int] = []
    offset = 0
    for size, stop in _SCHEDULE:
        while offset < stop and len(ends) < MAX_LINKS:
            offset += size
            ends.append(offset)
        if len(ends) >= MAX_LINKS:
            break
    return tuple(ends)


LINK_ENDS = _link_ends()  # byte offset where link i ends; the same for every prompt


def _hashed_ranges() -> tuple[tuple[tuple[int, int], ...], ...]:
    ranges = []
    start = 0
    for end in LINK_ENDS:
        if end <= FULL_BYTES or end - start <= 2 * SAMPLE_BYTES:
            ranges.append(((start, end),))
        else:
            ranges.append(((end - SAMPLE_BYTES, end),))
        start = end
    return tuple(ranges)


_HASHED = _hashed_ranges()  # the byte ranges (absolute offsets) link i's name is made of
_WHOLE = tuple(((start, end),) for start, end in zip((0, *LINK_ENDS[:-1]), LINK_ENDS, strict=True))


@dataclass(frozen=True, slots=True)
class PrefixChain:
    """The names of a prompt's links, in order, and the prompt's size in bytes."""

    links: tuple[int, ...] = ()
    total_bytes: int = 0

    def covered_bytes(self, matched_links: int) -> int:
        """How many of the prompt's bytes its first ``matched_links`` links cover."""
        return LINK_ENDS[matched_links - 1] if matched_links > 0 else 0

    def link_bytes(self, index: int) -> int:
        return LINK_ENDS[index] - (LINK_ENDS[index - 1] if index else 0)

    def header_value(self) -> str:
        """``<total bytes>.<base64 of the names as big-endian uint64>``: ~11 characters a link."""
        packed = np.array(self.links, dtype=">u8").tobytes()
        return f"{self.total_bytes}.{base64.b64encode(packed).decode('ascii')}"

    @classmethod
    def from_header(cls, value: str) -> PrefixChain:
        """The chain a ``CHAIN_HEADER`` names; ``ValueError`` if it is not one."""
        size, _, encoded = value.partition(".")
        total = int(size)
        try:  # the stdlib's codec: the orchestrator never loads pybase64 (it decodes no prompt); ~2 KB here
            packed = base64.b64decode(encoded, validate=True)
        except binascii.Error as exc:
            raise ValueError("not a prefix chain") from exc
        if total < 0 or len(packed) % 8 or len(packed) // 8 > MAX_LINKS:
            raise ValueError("not a prefix chain")
        # .tolist(): Python ints at C speed (~6 us for 200 links, against ~30 us for a loop over numpy scalars)
        links = tuple(np.frombuffer(packed, dtype=">u8").tolist())
        if len(links) and LINK_ENDS[len(links) - 1] > total:
            raise ValueError("a prefix chain with more links than its size holds")
        return cls(links, total)


class ChainBuilder:
    """Feeds the prompt's pieces in order and names each link as its end goes by."""

    __slots__ = ("_cursor", "_hash", "_hashed", "_links", "_offset")

    def __init__(self, sampled: bool = True, key: bytes | None = None) -> None:
        # ``sampled=False``: every byte of every link, for where an overestimated match would cost a worker a
        # long prefill it was not sized for (conditional disaggregation: docs/routing.md).
        # ``key``: the names' key (``chain_key``); None: this process's, from its environment.
        self._hashed = _HASHED if sampled else _WHOLE
        self._hash = hashlib.blake2b(key=key if key is not None else key_from_env(), digest_size=_NAME_BYTES)
        self._offset = 0  # bytes fed so far
        self._cursor = 0  # bytes hashed or skipped so far
        self._links: list[int] = []

    def feed(self, piece: bytes | memoryview) -> None:
        base = self._offset
        stop = base + len(piece)
        self._offset = stop
        links = self._links
        if len(links) >= MAX_LINKS or not len(piece):
            return
        view = memoryview(piece)
        cursor = self._cursor
        digest = self._hash
        update, copy = digest.update, digest.copy
        hashed = self._hashed
        index = len(links)
        # The link under way when the piece starts, up to its end or the piece's.
        for low, high in hashed[index]:
            low, high = max(low, cursor), min(high, stop)
            if low < high:
                update(view[low - base : high - base])
                cursor = high
        if LINK_ENDS[index] <= stop:
            # A name is the running hash as of the link's end: a copy's digest, the hash itself runs on.
            links.append(index << 32 | int.from_bytes(copy().digest(), "big"))
            # Links that lie whole inside the piece: no bounds to clip (a long text is one piece: most links).
            for whole in range(index + 1, min(bisect.bisect_right(LINK_ENDS, stop), MAX_LINKS)):
                for low, high in hashed[whole]:
                    update(view[low - base : high - base])
                links.append(whole << 32 | int.from_bytes(copy().digest(), "big"))
            cursor = LINK_ENDS[len(links) - 1]
            # The link the piece ends inside: what of it is here.
            if len(links) < MAX_LINKS:
                for low, high in hashed[len(links)]:
                    low, high = max(low, cursor), min(high, stop)
                    if low < high:
                        update(view[low - base : high - base])
                        cursor = high
        self._cursor = cursor

    def chain(self) -> PrefixChain:
        return PrefixChain(tuple(self._links), self._offset)


def chain_of(pieces: Iterable[bytes | memoryview], sampled: bool = True, key: bytes | None = None) -> PrefixChain:
    builder = ChainBuilder(sampled, key)
    for piece in pieces:
        builder.feed(piece)
    return builder.chain()

"""A prompt's prefix chain: names for its leading pieces of text, the vocabulary routing shares with the workers.

The orchestrator never tokenizes, so routing names text: the prompt's bytes are cut into links at fixed offsets,
and each link is named by a keyed hash of everything up to its end (far links by a sample of their bytes). Equal
prefixes get equal names in every process that holds the deployment secret, and a name tells nothing about a prompt
to anyone without it. Offsets, sampling, cost and who may send a chain: docs/routing.md#cache_aware-step-by-step."""

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

"""frontend/prefix_chain.py: links fixed by position, so a follow-up turn shares the earlier prompt's links; the
header the orchestrator sends each worker round-trips, and anything else is a ValueError."""

from __future__ import annotations

import itertools
import random
import zlib

import pytest

from frontend.internal_secret import INTERNAL_TOKEN_ENV, INTERNAL_TOKEN_HEADER, InternalSecret, internal_secret_from_env
from frontend.prefix_chain import (
    CHAIN_HEADER,
    FULL_BYTES,
    LINK_ENDS,
    MAX_LINKS,
    PUBLIC_CHAIN_KEY,
    SAMPLE_BYTES,
    PrefixChain,
    chain_key,
    chain_of,
    trusted_chain_header,
)

PROMPT = bytes(random.Random(7).randrange(256) for _ in range(40_000))


def test_link_ends_follow_the_schedule() -> None:
    assert LINK_ENDS[:3] == (512, 1024, 1536)
    assert LINK_ENDS[15] == 8 * 1024 and LINK_ENDS[16] == 10 * 1024  # 512 B links to 8 KiB, then 2 KiB
    assert LINK_ENDS[43] == 64 * 1024 and LINK_ENDS[44] == 72 * 1024  # then 8 KiB
    assert len(LINK_ENDS) == MAX_LINKS
    assert all(b > a for a, b in itertools.pairwise(LINK_ENDS))


def test_a_prompt_has_one_link_per_whole_link_and_its_total_bytes() -> None:
    chain = chain_of([PROMPT])
    assert chain.total_bytes == len(PROMPT)
    assert len(chain.links) == sum(1 for end in LINK_ENDS if end <= len(PROMPT))
    assert chain.covered_bytes(len(chain.links)) <= len(PROMPT) < LINK_ENDS[len(chain.links)]
    assert sum(chain.link_bytes(i) for i in range(len(chain.links))) == chain.covered_bytes(len(chain.links))
    assert [link >> 32 for link in chain.links] == list(range(len(chain.links)))  # a name carries its position


def test_a_tail_shorter_than_its_link_is_not_named() -> None:
    assert chain_of([b"x" * 511]) == PrefixChain((), 511)
    assert len(chain_of([b"x" * 512]).links) == 1


def test_links_are_stable_when_the_prompt_is_extended() -> None:
    short = chain_of([PROMPT[:10_000]])
    longer = chain_of([PROMPT[:10_000], b"and the next turn of the conversation " * 100])
    assert longer.links[:len(short.links)] == short.links
    assert len(longer.links) > len(short.links)


def test_a_prompt_that_differs_shares_only_the_links_before_the_difference() -> None:
    changed = bytearray(PROMPT)
    changed[5_000] ^= 0xFF
    a, b = chain_of([PROMPT]), chain_of([bytes(changed)])
    first_different = next(i for i, end in enumerate(LINK_ENDS) if end > 5_000)
    assert a.links[:first_different] == b.links[:first_different]
    assert all(x != y for x, y in zip(a.links[first_different:], b.links[first_different:], strict=True))


@pytest.mark.parametrize("cuts", [[1], [255, 256, 257], [1000, 1001], list(range(0, 40_000, 333)), [39_999]])
def test_piece_boundaries_do_not_matter(cuts: list[int]) -> None:
    bounds = [0, *cuts, len(PROMPT)]
    pieces = [memoryview(PROMPT)[a:b] for a, b in itertools.pairwise(bounds)]
    assert chain_of(pieces) == chain_of([PROMPT])


def test_the_header_round_trips() -> None:
    chain = chain_of([PROMPT])
    value = chain.header_value()
    assert value.isascii() and value.startswith(f"{len(PROMPT)}.")
    assert PrefixChain.from_header(value) == chain
    assert PrefixChain.from_header(PrefixChain((), 12).header_value()) == PrefixChain((), 12)


@pytest.mark.parametrize("value", [
    "", "abc", "-1.", "12.!!!!", "12.AAAA",  # no size, no size, a negative size, bad base64, 3 bytes of names
    f"100.{PrefixChain((1,), 300).header_value().split('.')[1]}",  # a link that ends past the prompt's size
    "1000000000." + PrefixChain(tuple(range(MAX_LINKS + 1)), 1 << 40).header_value().split(".")[1],  # too many
    "12.é",
])
def test_a_malformed_header_is_a_value_error(value: str) -> None:
    with pytest.raises(ValueError):
        PrefixChain.from_header(value)


def test_far_links_are_named_by_their_last_bytes_and_any_piece_boundaries_agree() -> None:
    """Past FULL_BYTES a link's name covers its last SAMPLE_BYTES (frontend/prefix_chain.py says why): a change
    there renames it and every later link; a change in its unsampled part renames only from the next change."""
    prompt = bytes(range(256)) * 4096  # 1 MiB
    chain = chain_of([prompt])
    far = next(i for i, end in enumerate(LINK_ENDS) if end > FULL_BYTES)
    end = LINK_ENDS[far]
    in_sample = bytearray(prompt)
    in_sample[end - 1] ^= 1
    renamed = chain_of([bytes(in_sample)]).links
    assert renamed[:far] == chain.links[:far] and all(a != b for a, b in zip(renamed[far:], chain.links[far:],
                                                                            strict=True))
    unsampled = bytearray(prompt)
    unsampled[end - SAMPLE_BYTES - 1] ^= 1
    assert chain_of([bytes(unsampled)]).links == chain.links
    pieces = [prompt[:1], prompt[1:70_000], prompt[70_000:70_001], prompt[70_001:500_000], prompt[500_000:]]
    assert chain_of(pieces) == chain


# -- keyed names -------------------------------------------------------------------------------------------------------
DOCUMENTS = [bytes(random.Random(seed).randrange(256) for _ in range(4_096)) for seed in range(3)]


def unkeyed_crc_names(prompt: bytes) -> list[int]:
    """What bb7e60b named a short prompt's links: a CRC-32 chained over every byte up to each link's end."""
    names, crc, start = [], 0, 0
    for index, end in enumerate(end for end in LINK_ENDS if end <= len(prompt)):
        crc = zlib.crc32(prompt[start:end], crc)
        names.append(index << 32 | crc)
        start = end
    return names


def test_a_subscriber_without_the_secret_cannot_tell_which_guessed_document_was_sent(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """The attack: read a name off the KV events, name each guessed document yourself, compare. Keyed by the
    deployment secret, the names of a guess (unkeyed, or under another key) match nothing that was sent."""
    monkeypatch.setenv(INTERNAL_TOKEN_ENV, "the-deployment-secret-0123456789")
    sent = chain_of([DOCUMENTS[1]])  # the orchestrator names it under this process's environment
    guesses = [unkeyed_crc_names(doc) for doc in DOCUMENTS]
    guesses += [list(chain_of([doc], key=chain_key(None)).links) for doc in DOCUMENTS]
    guesses += [list(chain_of([doc], key=chain_key(InternalSecret("a-guessed-secret-0123456789"))).links)
                for doc in DOCUMENTS]
    assert not any(set(sent.links) & set(guess) for guess in guesses)
    # Whoever holds the secret names alike: equality, all routing needs, is kept in every process.
    assert chain_of([DOCUMENTS[1]], key=chain_key(internal_secret_from_env())) == sent


def test_equal_prefixes_get_equal_names_under_one_key_and_the_position_stays_in_the_name() -> None:
    key = chain_key(InternalSecret("the-deployment-secret-0123456789"))
    one = chain_of([DOCUMENTS[0], b"one ending" * 100], key=key)
    other = chain_of([DOCUMENTS[0][:1000], DOCUMENTS[0][1000:], b"another" * 100], key=key)  # fed in other pieces
    shared = sum(1 for end in LINK_ENDS if end <= len(DOCUMENTS[0]))
    assert one.links[:shared] == other.links[:shared] and one.links[shared] != other.links[shared]
    assert [link >> 32 for link in one.links] == list(range(len(one.links)))
    assert chain_of([DOCUMENTS[0]], key=key) != chain_of([DOCUMENTS[0]], key=chain_key(None))


def test_without_a_secret_names_use_the_public_key(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(INTERNAL_TOKEN_ENV, raising=False)
    assert chain_of([PROMPT]) == chain_of([PROMPT], key=PUBLIC_CHAIN_KEY)


def test_a_chain_header_is_believed_only_from_a_holder_of_the_secret() -> None:
    secret = InternalSecret("the-deployment-secret-0123456789")
    value = chain_of([PROMPT]).header_value()
    assert trusted_chain_header({CHAIN_HEADER: value, **secret.headers()}, secret) == value
    assert trusted_chain_header({CHAIN_HEADER: value}, secret) is None
    forged = {CHAIN_HEADER: value, INTERNAL_TOKEN_HEADER: "a-forged-token-0123456789"}
    assert trusted_chain_header(forged, secret) is None
    assert trusted_chain_header({CHAIN_HEADER: value}, None) == value  # no secret: the open deployment of before
    assert trusted_chain_header({}, secret) is None

from __future__ import annotations

import itertools

import pytest
from hypothesis import given
from hypothesis import strategies as st

from frontend.token_codec import TOKEN_DTYPE
from workers.engines.byte_tokenizer import ByteDetokenizer, ByteTokenizer

TOKENIZER = ByteTokenizer(50_000)


@given(st.text(max_size=50))
def test_encode_decode_round_trip(text: str) -> None:
    tokens = TOKENIZER.encode(text)
    assert tokens.dtype == TOKEN_DTYPE
    assert tokens.tolist() == list(text.encode())
    assert TOKENIZER.decode(tokens) == text
    assert TOKENIZER.decode(tokens.tolist()) == text


@given(st.text(max_size=30), st.lists(st.integers(min_value=0, max_value=200), max_size=8))
def test_incremental_detokenizer_gives_the_whole_text_whatever_the_split(text: str, cuts: list[int]) -> None:
    data = list(text.encode())
    bounds = sorted({0, len(data), *(min(c, len(data)) for c in cuts)})
    detokenizer = ByteDetokenizer()
    pieces = [detokenizer.add(data[a:b]) for a, b in itertools.pairwise(bounds)]
    assert "".join(pieces) == text


def test_special_ids_decode_to_nothing() -> None:
    assert TOKENIZER.decode([72, 256, 105, 49_999]) == "Hi"
    assert ByteDetokenizer().add([256, 72]) == "H"


def test_incomplete_utf8_is_held_back() -> None:
    detokenizer = ByteDetokenizer()
    encoded = list("é".encode())
    assert detokenizer.add(encoded[:1]) == ""
    assert detokenizer.add(encoded[1:]) == "é"


def test_chat_rendering() -> None:
    rendered = TOKENIZER.render_chat([{"role": "system", "content": "s"}, {"role": "user", "content": "u"}])
    assert rendered == "<|system|>\ns\n<|user|>\nu\n<|assistant|>\n"


def test_the_vocabulary_must_hold_the_bytes_and_eos() -> None:
    with pytest.raises(ValueError, match="at least 257"):
        ByteTokenizer(256)
    assert ByteTokenizer(257).vocab_size == 257


@given(st.text(max_size=30))
def test_token_bytes_are_the_bytes_of_the_text(text: str) -> None:
    tokens = TOKENIZER.encode(text).tolist()
    assert [TOKENIZER.token_bytes(t) for t in tokens] == [bytes((b,)) for b in text.encode()]
    assert TOKENIZER.token_bytes(256) == b""  # special ids decode to nothing

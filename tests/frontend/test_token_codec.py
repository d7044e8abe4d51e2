from __future__ import annotations

import base64
from typing import Any

import numpy as np
import pybase64
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from hypothesis.extra import numpy as hnp

from frontend.errors import ContextLengthError, InvalidRequestError, TokenCodecError
from frontend.token_codec import (
    B64_FIELD,
    LIST_FIELD,
    TOKEN_DTYPE,
    decode_prompt_tokens,
    encode_prompt_tokens,
    token_array_from_list,
)

VOCAB = 50_000


@st.composite
def token_arrays(draw: st.DrawFn) -> tuple[np.ndarray[Any, np.dtype[np.int32]], int]:
    vocab = draw(st.integers(min_value=1, max_value=2**31 - 1))
    size = draw(st.integers(min_value=1, max_value=300))
    array = draw(hnp.arrays(np.int32, size, elements=st.integers(min_value=0, max_value=vocab - 1)))
    return array, vocab


@given(token_arrays())
def test_round_trip_gives_identical_ids(case: tuple[np.ndarray[Any, np.dtype[np.int32]], int]) -> None:
    array, vocab = case
    encoded = encode_prompt_tokens(array)
    decoded = decode_prompt_tokens(encoded, vocab_size=vocab, expected_len=array.size, max_tokens=array.size)
    assert decoded.dtype == TOKEN_DTYPE
    np.testing.assert_array_equal(decoded, array)
    # The list path of the same ids lands on the same array.
    np.testing.assert_array_equal(token_array_from_list(array.tolist(), vocab_size=vocab), array)


@given(st.lists(st.integers(min_value=0, max_value=VOCAB - 1), min_size=1, max_size=200))
def test_encoding_is_little_endian_int32_base64(ids: list[int]) -> None:
    encoded = encode_prompt_tokens(ids)
    raw = base64.b64decode(encoded, validate=True)
    assert raw == b"".join(i.to_bytes(4, "little", signed=True) for i in ids)
    assert encode_prompt_tokens(np.array(ids, dtype=np.int64)) == encoded  # wider input is narrowed, not refused


def test_decoded_array_is_a_read_only_zero_copy_view_of_the_decoded_bytes() -> None:
    ids = np.arange(1000, dtype=np.int32)
    decoded = decode_prompt_tokens(encode_prompt_tokens(ids), vocab_size=VOCAB)
    assert decoded.flags.owndata is False
    assert isinstance(decoded.base, bytes)
    assert len(decoded.base) == ids.nbytes
    assert np.shares_memory(decoded, np.frombuffer(decoded.base, dtype=np.uint8))
    assert decoded.flags.writeable is False
    with pytest.raises(ValueError, match="read-only"):
        decoded[0] = 7


def _b64(*ids: int) -> str:
    return pybase64.b64encode(np.array(ids, dtype="<i4").tobytes()).decode()


@pytest.mark.parametrize(
    ("encoded", "kwargs", "error", "param"),
    [
        pytest.param("AAAA!AAA", {}, TokenCodecError, B64_FIELD, id="bad-character"),
        pytest.param("AAAA AAA", {}, TokenCodecError, B64_FIELD, id="whitespace"),
        pytest.param("AAAAAAA", {}, TokenCodecError, B64_FIELD, id="bad-padding"),
        pytest.param("AAAAAAA=", {}, TokenCodecError, B64_FIELD, id="length-not-multiple-of-4"),
        pytest.param("é", {}, TokenCodecError, B64_FIELD, id="non-ascii"),
        pytest.param("", {}, TokenCodecError, B64_FIELD, id="empty"),
        pytest.param(_b64(1, -1, 3), {}, TokenCodecError, B64_FIELD, id="negative-id"),
        pytest.param(_b64(1, -(2**31)), {}, TokenCodecError, B64_FIELD, id="int32-min"),
        pytest.param(_b64(1, VOCAB), {}, TokenCodecError, B64_FIELD, id="id-equals-vocab"),
        pytest.param(_b64(2**31 - 1), {}, TokenCodecError, B64_FIELD, id="int32-max"),
        pytest.param(_b64(1, 2, 3), {"expected_len": 4}, TokenCodecError, "prompt_len", id="shorter-than-prompt_len"),
        pytest.param(_b64(1, 2, 3), {"expected_len": 2}, TokenCodecError, "prompt_len", id="longer-than-prompt_len"),
        pytest.param(_b64(1, 2, 3), {"max_tokens": 2}, ContextLengthError, B64_FIELD, id="too-long-for-context"),
    ],
)
def test_invalid_b64_input_is_a_400_naming_the_field(
    encoded: str, kwargs: dict[str, Any], error: type[InvalidRequestError], param: str
) -> None:
    with pytest.raises(error) as caught:
        decode_prompt_tokens(encoded, vocab_size=VOCAB, **kwargs)
    assert type(caught.value) is error
    assert caught.value.status_code == 400
    assert caught.value.param == param
    assert caught.value.to_dict() == {"error": {"message": caught.value.message, "type": "invalid_request_error",
                                                "param": param, "code": caught.value.code}}


def test_the_reported_index_is_the_first_bad_id() -> None:
    with pytest.raises(TokenCodecError, match=r"\[2\] = -5"):
        decode_prompt_tokens(_b64(0, 1, -5, VOCAB), vocab_size=VOCAB)


def test_non_string_is_refused() -> None:
    with pytest.raises(TokenCodecError) as caught:
        decode_prompt_tokens(b"AAAA", vocab_size=VOCAB)  # type: ignore[arg-type]
    assert caught.value.param == B64_FIELD


def test_custom_field_name_is_reported() -> None:
    with pytest.raises(TokenCodecError) as caught:
        decode_prompt_tokens("!!!!", vocab_size=VOCAB, field="x_b64")
    assert caught.value.param == "x_b64"


def test_exact_context_and_vocab_edges_are_accepted() -> None:
    decoded = decode_prompt_tokens(_b64(0, VOCAB - 1), vocab_size=VOCAB, max_tokens=2, expected_len=2)
    assert decoded.tolist() == [0, VOCAB - 1]


# -- the list path -------------------------------------------------------------------------------------------
@pytest.mark.parametrize(
    ("ids", "kwargs", "error", "param"),
    [
        pytest.param([], {}, TokenCodecError, LIST_FIELD, id="empty"),
        pytest.param([1, -1], {}, TokenCodecError, LIST_FIELD, id="negative"),
        pytest.param([1, VOCAB], {}, TokenCodecError, LIST_FIELD, id="id-equals-vocab"),
        pytest.param([2**31], {}, TokenCodecError, LIST_FIELD, id="beyond-int32"),
        pytest.param([2**32 + 1], {"vocab_size": 2**31 - 1}, TokenCodecError, LIST_FIELD, id="wraps-to-1-in-int32"),
        pytest.param([-(2**31) - 1], {}, TokenCodecError, LIST_FIELD, id="below-int32"),
        pytest.param([2**63], {}, TokenCodecError, LIST_FIELD, id="beyond-int64"),
        pytest.param([2**70], {}, TokenCodecError, LIST_FIELD, id="far-beyond-int64"),
        pytest.param([[1, 2], [3, 4]], {}, TokenCodecError, LIST_FIELD, id="nested"),
        pytest.param([[1, 2], [3]], {}, TokenCodecError, LIST_FIELD, id="ragged"),
        pytest.param(["1", "2"], {}, TokenCodecError, LIST_FIELD, id="strings"),
        pytest.param([1.5, 2.0], {}, TokenCodecError, LIST_FIELD, id="floats"),
        pytest.param([None], {}, TokenCodecError, LIST_FIELD, id="none"),
        pytest.param([True, False], {}, TokenCodecError, LIST_FIELD, id="bools"),
        pytest.param([1, 2, 3], {"expected_len": 2}, TokenCodecError, "prompt_len", id="prompt_len-mismatch"),
        pytest.param([1, 2, 3], {"max_tokens": 2}, ContextLengthError, LIST_FIELD, id="too-long-for-context"),
        pytest.param([1, -1], {"field": "prompt"}, TokenCodecError, "prompt", id="named-field"),
    ],
)
def test_invalid_list_input_is_a_400_naming_the_field(
    ids: list[Any], kwargs: dict[str, Any], error: type[InvalidRequestError], param: str
) -> None:
    options: dict[str, Any] = {"vocab_size": VOCAB, **kwargs}
    with pytest.raises(error) as caught:
        token_array_from_list(ids, **options)
    assert type(caught.value) is error
    assert caught.value.status_code == 400
    assert caught.value.param == param


def test_list_path_gives_a_read_only_ready_int32_array() -> None:
    tokens = token_array_from_list([5, 6, 7], vocab_size=VOCAB, expected_len=3, max_tokens=3)
    assert tokens.dtype == TOKEN_DTYPE
    assert tokens.tolist() == [5, 6, 7]


@settings(max_examples=50)
@given(st.lists(st.integers(min_value=-(2**40), max_value=2**40), min_size=1, max_size=50))
def test_list_path_accepts_exactly_the_ids_inside_the_vocabulary(ids: list[int]) -> None:
    if all(0 <= i < VOCAB for i in ids):
        assert token_array_from_list(ids, vocab_size=VOCAB).tolist() == ids
    else:
        with pytest.raises(TokenCodecError):
            token_array_from_list(ids, vocab_size=VOCAB)

from __future__ import annotations

import copy
import pickle
from typing import Any

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from frontend.sampling import SamplingParams
from frontend.token_codec import TOKEN_DTYPE, TokenArray, decode_prompt_tokens, encode_prompt_tokens
from workers.engines.request import GenerationRequest, Handoff, Phase, PromptPath

SAMPLING = SamplingParams(max_tokens=8)
VOCAB = 50_000


def array_request(ids: list[int] | None = None, **kw: Any) -> GenerationRequest:
    """A request on the array path, built the way a GEN worker builds it: from a decoded b64 string."""
    tokens = decode_prompt_tokens(encode_prompt_tokens(ids or list(range(1000))), vocab_size=VOCAB)
    return GenerationRequest("req-1", tokens, SAMPLING, **kw)


def test_array_path_builds_no_list_through_construction_copies_pickling_and_prompt_len() -> None:
    request = array_request()
    assert request.prompt_list_built is False
    assert request.prompt_len == 1000
    copy.copy(request)
    copy.deepcopy(request)
    pickle.loads(pickle.dumps(request))
    repr(request)
    assert request.prompt_list_built is False
    assert request.prompt_path is PromptPath.ARRAY
    assert request.prompt_is_placeholder is False


def test_reading_prompt_token_ids_builds_the_list_once_and_caches_it() -> None:
    request = array_request([3, 1, 4, 1, 5])
    first = request.prompt_token_ids
    assert first == [3, 1, 4, 1, 5]
    assert all(type(t) is int for t in first)
    assert request.prompt_list_built is True
    assert request.prompt_token_ids is first


@settings(max_examples=50)
@given(st.lists(st.integers(min_value=0, max_value=VOCAB - 1), min_size=1, max_size=300),
       st.sampled_from([0, 2, pickle.HIGHEST_PROTOCOL]))
def test_pickle_round_trips_give_identical_token_lists(ids: list[int], protocol: int) -> None:
    request = array_request(ids)
    clone = pickle.loads(pickle.dumps(request, protocol=protocol))
    assert clone.prompt_token_ids == ids
    assert clone.request_id == request.request_id
    assert clone.sampling == request.sampling
    assert clone.phase is request.phase
    assert clone.prompt_path is request.prompt_path


def test_an_unread_request_pickles_as_int32_bytes_and_stays_unread() -> None:
    request = array_request(list(range(300)))
    state = request.__getstate__()
    assert isinstance(state["prompt_i32"], bytes)
    assert state["prompt_i32"] == np.arange(300, dtype="<i4").tobytes()
    assert not any(isinstance(v, list) for v in state.values())
    clone = pickle.loads(pickle.dumps(request))
    assert clone.prompt_list_built is False
    assert request.prompt_list_built is False
    again = pickle.loads(pickle.dumps(clone))
    assert again.prompt_list_built is False
    np.testing.assert_array_equal(again.prompt_token_ids_i32, np.arange(300))


def test_a_read_request_still_pickles_bytes_not_its_cached_list() -> None:
    request = array_request([9, 8, 7])
    assert request.prompt_token_ids == [9, 8, 7]
    state = request.__getstate__()
    assert not any(isinstance(v, list) for v in state.values())
    assert pickle.loads(pickle.dumps(request)).prompt_list_built is False


def test_unpickled_array_is_read_only() -> None:
    clone = pickle.loads(pickle.dumps(array_request([1, 2, 3])))
    assert clone.prompt_token_ids_i32.flags.writeable is False


def test_copies_share_the_same_array() -> None:
    request = array_request()
    for clone in (copy.copy(request), copy.deepcopy(request)):
        assert clone is not request
        assert np.shares_memory(clone.prompt_token_ids_i32, request.prompt_token_ids_i32)
        assert clone.prompt_token_ids_i32 is request.prompt_token_ids_i32
        assert clone.prompt_list_built is False


def test_deepcopy_inside_a_container_shares_the_array_too() -> None:
    request = array_request()
    holder = copy.deepcopy({"r": [request]})
    assert np.shares_memory(holder["r"][0].prompt_token_ids_i32, request.prompt_token_ids_i32)


def test_the_array_is_not_writeable_even_when_given_a_writeable_one() -> None:
    writeable: TokenArray = np.arange(10, dtype=TOKEN_DTYPE)
    request = GenerationRequest("r", writeable, SAMPLING)
    held = request.prompt_token_ids_i32
    assert held.flags.writeable is False
    assert np.shares_memory(held, writeable)  # shared, not copied
    with pytest.raises(ValueError, match="read-only"):
        held[0] = 1


def test_decoded_array_is_kept_as_is() -> None:
    tokens = decode_prompt_tokens(encode_prompt_tokens([1, 2, 3]), vocab_size=VOCAB)
    request = GenerationRequest("r", tokens, SAMPLING)
    assert request.prompt_token_ids_i32 is tokens
    assert isinstance(request.prompt_token_ids_i32.base, bytes)


def test_list_path_keeps_the_clients_list_object() -> None:
    client_list = [7, 8, 9]
    tokens = np.array(client_list, dtype=TOKEN_DTYPE)
    request = GenerationRequest.from_token_list("r", client_list, tokens, SAMPLING)
    assert request.prompt_path is PromptPath.LIST
    assert request.prompt_list_built is True
    assert request.prompt_token_ids is client_list
    assert request.prompt_len == 3
    np.testing.assert_array_equal(request.prompt_token_ids_i32, client_list)


def test_placeholder_prompt_has_only_a_length() -> None:
    request = GenerationRequest.with_placeholder_prompt("r", 4096, SAMPLING)
    assert request.prompt_path is PromptPath.METADATA_ONLY
    assert request.prompt_is_placeholder is True
    assert request.prompt_len == 4096
    assert request.prompt_list_built is False
    assert request.prompt_token_ids_i32.dtype == TOKEN_DTYPE
    assert request.prompt_token_ids_i32.flags.writeable is False
    clone = pickle.loads(pickle.dumps(request))
    assert clone.prompt_is_placeholder is True
    assert clone.prompt_len == 4096


def test_generation_only_needs_a_handoff() -> None:
    tokens = np.array([1, 2], dtype=TOKEN_DTYPE)
    with pytest.raises(ValueError, match="hand-off"):
        GenerationRequest("r", tokens, SAMPLING, phase=Phase.GENERATION_ONLY)
    handoff = Handoff((5,), b"state", "ctx-1")
    request = GenerationRequest("r", tokens, SAMPLING, phase=Phase.GENERATION_ONLY, handoff=handoff)
    clone = pickle.loads(pickle.dumps(request))
    assert clone.handoff == handoff
    assert clone.phase is Phase.GENERATION_ONLY


@pytest.mark.parametrize(
    "bad",
    [
        np.array([1, 2], dtype=np.int64),
        np.array([1, 2], dtype=">i4"),
        np.array([[1, 2]], dtype=np.int32),
        np.array([1.0, 2.0]),
    ],
    ids=["int64", "big-endian", "2-d", "float"],
)
def test_only_a_flat_little_endian_int32_array_is_accepted(bad: np.ndarray[Any, Any]) -> None:
    with pytest.raises(TypeError):
        GenerationRequest("r", bad, SAMPLING)


def test_the_engine_never_sees_an_open_output_budget() -> None:
    with pytest.raises(ValueError, match="max_tokens"):
        GenerationRequest("a", np.zeros(3, np.int32), SamplingParams())
    assert GenerationRequest("a", np.zeros(3, np.int32), SAMPLING).max_tokens == 8

"""The vllm adapter's hand-off logic that needs no vLLM: the seed CTX hands on, and GEN's check of the first
token(s) it chooses again (equal to CTX's, then dropped)."""

from __future__ import annotations

import pytest

from frontend.errors import EngineRequestError
from frontend.sampling import SamplingParams
from workers.engines.outputs import EngineOutput, TokenLogprob
from workers.engines.vllm.engine import _FirstTokenCheck, _handoff_seed


def test_ctx_hands_on_the_clients_seed_draws_one_for_random_sampling_and_none_for_greedy() -> None:
    assert _handoff_seed(SamplingParams(temperature=0.7, seed=-4)) == -4
    assert _handoff_seed(SamplingParams(temperature=0)) is None
    drawn = _handoff_seed(SamplingParams(temperature=0.7, n=4))
    assert drawn is not None and 0 <= drawn < 2**62  # room for seed + i of every sequence


def test_gen_drops_each_sequences_first_token_once_it_matches_ctxs() -> None:
    check = _FirstTokenCheck([(5,), (6,)])
    lp = (TokenLogprob(5, -0.1), TokenLogprob(9, -0.2))
    first = check.strip(EngineOutput((5, 9), lp, index=0))
    assert first.token_ids == (9,) and first.logprobs == (TokenLogprob(9, -0.2),) and not check.done
    assert check.strip(EngineOutput((6,), index=1)).token_ids == ()
    assert check.done
    assert check.strip(EngineOutput((5,), index=0)).token_ids == (5,)  # later 5s are the answer's own


def test_a_first_token_other_than_ctxs_fails_the_request() -> None:
    check = _FirstTokenCheck([(5,), (6,)])
    with pytest.raises(EngineRequestError, match="sequence 1's first token") as caught:
        check.strip(EngineOutput((7,), index=1))
    assert caught.value.code == "engine_request_failed"


def test_a_sequence_that_ends_before_ctxs_first_tokens_fails_the_request() -> None:
    check = _FirstTokenCheck([(5, 6)])
    with pytest.raises(EngineRequestError, match="before CTX's first token"):
        check.strip(EngineOutput((5,), finish_reason="stop"))

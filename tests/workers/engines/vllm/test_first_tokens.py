"""GEN's first token(s), chosen again by its vLLM: the seed CTX hands on, and the watch over where GEN chose
otherwise. No vLLM needed."""

from __future__ import annotations

from frontend.sampling import SamplingParams
from workers.engines.outputs import EngineOutput
from workers.engines.vllm.first_tokens import FirstTokenWatch, handoff_seed


def test_ctx_hands_on_the_clients_seed_draws_one_for_random_sampling_and_none_for_greedy() -> None:
    assert handoff_seed(SamplingParams(temperature=0.7, seed=-4)) == -4
    assert handoff_seed(SamplingParams(temperature=0)) is None
    drawn = handoff_seed(SamplingParams(temperature=0.7, n=4))
    assert drawn is not None and 0 <= drawn < 2**62  # room for seed + i of every sequence


def test_the_watch_reports_each_sequence_whose_first_token_is_not_ctxs_once() -> None:
    watch = FirstTokenWatch([(5,), (6,)])
    assert watch.see(EngineOutput((5, 9), index=0)) is None and not watch.done  # CTX's: nothing to report
    assert watch.see(EngineOutput((7,), index=1)) == 1  # GEN chose 7 where CTX chose 6
    assert watch.done
    assert watch.see(EngineOutput((8,), index=1)) is None  # later tokens are the answer's own


def test_first_tokens_across_outputs_and_a_sequence_that_ends_sooner() -> None:
    watch = FirstTokenWatch([(5, 6), (5, 6)])
    assert watch.see(EngineOutput((5,), index=0)) is None and watch.see(EngineOutput((6,), index=0)) is None
    assert watch.see(EngineOutput((5,), finish_reason="stop", index=1)) == 1  # ended before CTX's second token
    assert watch.done

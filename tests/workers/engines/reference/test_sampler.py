from __future__ import annotations

import numpy as np
import numpy.typing as npt
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from frontend.sampling import SamplingParams
from workers.engines.reference.sampler import Sampler, log_softmax, seed_key

F32 = npt.NDArray[np.float32]
NO_PROMPT = np.zeros(0, np.int32)


def logits_of(*values: float) -> F32:
    return np.array(values, np.float32)


def random_logits(seed: int, vocab: int = 50, steps: int = 20) -> list[F32]:
    rng = np.random.default_rng(seed)
    return [(rng.standard_normal(vocab) * 2).astype(np.float32) for _ in range(steps)]


def run(cfg: SamplingParams, steps: list[F32], prompt: npt.NDArray[np.int32] = NO_PROMPT) -> list[int]:
    sampler = Sampler(cfg, prompt, len(steps[0]))
    return [sampler.sample(x).token_id for x in steps]


def test_greedy_is_argmax_and_records_output() -> None:
    sampler = Sampler(SamplingParams(temperature=0.0), NO_PROMPT, 4)
    assert sampler.sample(logits_of(0.1, 3.0, -1.0, 2.9)).token_id == 1
    assert sampler.position == 1


def test_presence_and_frequency_penalties_apply_to_output_only() -> None:
    x = logits_of(1.0, 0.9, 0.0, 0.0)
    prompt = np.array([0, 0, 0], np.int32)  # prompt tokens are not penalised by these two
    assert Sampler(SamplingParams(temperature=0.0, presence_penalty=0.5), prompt, 4).choose(x) == 0
    seen = Sampler(SamplingParams(temperature=0.0, presence_penalty=0.2), prompt, 4, output_so_far=[0])
    assert seen.choose(x) == 1
    # frequency: 1.0 - 0.06 * 2 = 0.88 < 0.9 after two occurrences, 0.94 > 0.9 after one.
    once = Sampler(SamplingParams(temperature=0.0, frequency_penalty=0.06), NO_PROMPT, 4, output_so_far=[0])
    twice = Sampler(
        SamplingParams(temperature=0.0, frequency_penalty=0.06), NO_PROMPT, 4, output_so_far=[0, 0]
    )
    assert once.choose(x) == 0 and twice.choose(x) == 1
    # Negative penalties encourage repetition, as in OpenAI's API.
    assert Sampler(SamplingParams(temperature=0.0, presence_penalty=-0.5), NO_PROMPT, 4, [1]).choose(x) == 1


def test_repetition_penalty_covers_prompt_and_output() -> None:
    cfg = SamplingParams(temperature=0.0, repetition_penalty=1.1)
    assert Sampler(cfg, np.array([0], np.int32), 3).choose(logits_of(2.0, 1.9, 0.0)) == 1  # 2.0 / 1.1 < 1.9
    assert Sampler(cfg, NO_PROMPT, 3, output_so_far=[0]).choose(logits_of(2.0, 1.9, 0.0)) == 1
    assert Sampler(cfg, NO_PROMPT, 3).choose(logits_of(2.0, 1.9, 0.0)) == 0
    # Negative logits are multiplied: -1.0 * 1.1 < -1.05.
    assert Sampler(cfg, np.array([0], np.int32), 3).choose(logits_of(-1.0, -1.05, -9.0)) == 1


def test_logprobs_describe_raw_logits() -> None:
    x = logits_of(1.0, 2.0, 0.5, -1.0)
    expected = log_softmax(x)
    assert np.isclose(np.exp(expected).sum(), 1.0)
    cfg = SamplingParams(temperature=0.0, repetition_penalty=3.0, presence_penalty=5.0, logprobs=2)
    token = Sampler(cfg, np.array([1], np.int32), 4, output_so_far=[1]).sample(x)
    assert token.token_id == 0  # penalties moved the choice ...
    assert token.logprob == pytest.approx(expected[0])  # ... but not the reported logprob
    assert [t for t, _ in token.top_logprobs] == [1, 0]
    assert [lp for _, lp in token.top_logprobs] == pytest.approx([expected[1], expected[0]])
    assert Sampler(SamplingParams(logprobs=0, seed=1), NO_PROMPT, 4).sample(x).top_logprobs == ()
    assert Sampler(SamplingParams(seed=1), NO_PROMPT, 4).sample(x).top_logprobs == ()
    many = Sampler(SamplingParams(logprobs=10, seed=1), NO_PROMPT, 4).sample(x).top_logprobs
    assert len(many) == 4


@settings(max_examples=30)
@given(seed=st.integers(0, 2**32), data_seed=st.integers(0, 1000))
def test_top_k_one_and_tiny_top_p_are_greedy(seed: int, data_seed: int) -> None:
    steps = random_logits(data_seed, steps=5)
    greedy = [int(np.argmax(x)) for x in steps]
    assert run(SamplingParams(temperature=1.5, top_k=1, seed=seed), steps) == greedy
    assert run(SamplingParams(temperature=1.5, top_p=1e-6, seed=seed), steps) == greedy


def test_top_k_and_top_p_restrict_candidates() -> None:
    x = np.log(np.array([0.4, 0.3, 0.2, 0.1], np.float32))
    top_k = {Sampler(SamplingParams(top_k=2, seed=s), NO_PROMPT, 4).sample(x).token_id for s in range(200)}
    assert top_k == {0, 1}
    # Nucleus: 0.4 < 0.5, 0.4 + 0.3 >= 0.5, so tokens 0 and 1 only.
    top_p = {Sampler(SamplingParams(top_p=0.5, seed=s), NO_PROMPT, 4).sample(x).token_id for s in range(200)}
    assert top_p == {0, 1}
    everything = {Sampler(SamplingParams(seed=s), NO_PROMPT, 4).sample(x).token_id for s in range(200)}
    assert everything == {0, 1, 2, 3}


def test_draws_follow_the_distribution() -> None:
    x = np.log(np.array([0.5, 0.3, 0.2], np.float32)) * 2  # temperature 2 undoes the doubling
    draws = [
        Sampler(SamplingParams(temperature=2.0, seed=s), NO_PROMPT, 3).sample(x).token_id for s in range(3000)
    ]
    freq = np.bincount(draws, minlength=3) / len(draws)
    np.testing.assert_allclose(freq, [0.5, 0.3, 0.2], atol=0.04)


@settings(max_examples=25)
@given(seed=st.integers(0, 2**63 - 1), data_seed=st.integers(0, 1000))
def test_seed_reproducible(seed: int, data_seed: int) -> None:
    steps = random_logits(data_seed)
    cfg = SamplingParams(temperature=1.0, top_p=0.95, seed=seed)
    assert run(cfg, steps) == run(cfg, steps)


def test_different_seeds_differ_and_none_is_random_but_replayable() -> None:
    steps = random_logits(0)
    outs = {tuple(run(SamplingParams(seed=s), steps)) for s in range(5)}
    assert len(outs) == 5
    sampler = Sampler(SamplingParams(), NO_PROMPT, 50)
    first = [sampler.sample(x).token_id for x in steps]
    assert run(SamplingParams(seed=sampler.seed), steps) == first


@settings(max_examples=40)
@given(
    seed=st.integers(0, 2**32),
    data_seed=st.integers(0, 1000),
    split=st.integers(1, 19),
    temperature=st.sampled_from([0.0, 0.7, 1.0, 1.3]),
    top_k=st.sampled_from([0, 5]),
    top_p=st.sampled_from([1.0, 0.8]),
    frequency=st.sampled_from([0.0, 0.5]),
    presence=st.sampled_from([0.0, -0.3, 0.8]),
    repetition=st.sampled_from([1.0, 1.3]),
)
def test_split_across_workers_continues_identically(
    seed: int,
    data_seed: int,
    split: int,
    temperature: float,
    top_k: int,
    top_p: float,
    frequency: float,
    presence: float,
    repetition: float,
) -> None:
    # Low-entropy logits so penalties and repeats actually matter.
    steps = random_logits(data_seed, vocab=12)
    prompt = np.random.default_rng(data_seed).integers(0, 12, 30).astype(np.int32)
    cfg = SamplingParams(temperature=temperature, top_p=top_p, top_k=top_k, seed=seed, frequency_penalty=frequency,
                         presence_penalty=presence, repetition_penalty=repetition, logprobs=2)
    whole = Sampler(cfg, prompt, 12)
    one = [whole.sample(x) for x in steps]
    ctx = Sampler(cfg, prompt, 12)
    head = [ctx.sample(x) for x in steps[:split]]
    gen = Sampler(cfg, prompt, 12, output_so_far=[t.token_id for t in head])
    assert gen.position == split
    assert head + [gen.sample(x) for x in steps[split:]] == one


def test_sampler_does_not_modify_logits_and_validates() -> None:
    x = logits_of(1.0, 2.0, 3.0)
    before = x.copy()
    Sampler(
        SamplingParams(temperature=0.0, repetition_penalty=2.0, presence_penalty=1.0), [2], 3, [2]
    ).sample(x)
    assert np.array_equal(x, before)
    with pytest.raises(ValueError):
        Sampler(SamplingParams(), NO_PROMPT, 3).sample(logits_of(1.0, 2.0))
    with pytest.raises(ValueError):
        Sampler(SamplingParams(), np.array([3], np.int32), 3)
    with pytest.raises(ValueError):
        Sampler(SamplingParams(), NO_PROMPT, 3).observe(-1)
    for bad in (
        {"temperature": -1.0},
        {"top_p": 0.0},
        {"top_p": 1.5},
        {"top_k": -1},
        {"repetition_penalty": 0.0},
        {"logprobs": -1},
    ):
        with pytest.raises(ValueError):
            SamplingParams(**bad)
    with pytest.raises(ValueError):  # beyond 64 bits: SamplingParams' own condition
        SamplingParams(seed=2**63)


@pytest.mark.parametrize("seed", [-1, -5, -(2**63), 2**63 - 1])
def test_any_signed_64_bit_seed_is_reproducible_and_its_own_stream(seed: int) -> None:
    steps = random_logits(3, steps=8)
    params = SamplingParams(temperature=1.0, seed=seed)
    assert run(params, steps) == run(params, steps)
    assert seed_key(seed) != seed_key(seed + 1) and 0 <= seed_key(seed) < 2**64
    assert seed_key(5) == 5  # non-negative seeds keep the streams they always had


def test_long_prompt_counts_built_once() -> None:
    prompt = np.random.default_rng(0).integers(0, 49152, 100_000).astype(np.int32)
    sampler = Sampler(SamplingParams(repetition_penalty=1.2, seed=0), prompt, 49152)
    x = np.random.default_rng(1).standard_normal(49152).astype(np.float32)
    assert 0 <= sampler.sample(x).token_id < 49152


@pytest.mark.parametrize("cfg", [
    SamplingParams(temperature=0.0),
    SamplingParams(temperature=0.9, seed=7),
    SamplingParams(temperature=1.3, top_k=5, seed=1),
    SamplingParams(temperature=0.8, top_p=0.5, seed=2, frequency_penalty=0.5),
])
def test_a_grammar_mask_limits_the_choice_whatever_the_sampling(cfg: SamplingParams) -> None:
    steps = random_logits(3)
    allowed = np.zeros(50, np.bool_)
    allowed[[4, 17, 33]] = True
    sampler = Sampler(cfg, NO_PROMPT, 50)
    assert all(sampler.sample(x, allowed).token_id in (4, 17, 33) for x in steps)


def test_logprobs_under_a_mask_are_those_of_the_raw_distribution() -> None:
    x = logits_of(3.0, 1.0, 0.5, 0.0)
    allowed = np.array([False, False, True, True])
    masked = Sampler(SamplingParams(temperature=0.0, logprobs=2), NO_PROMPT, 4).sample(x, allowed)
    free = Sampler(SamplingParams(temperature=0.0, logprobs=2), NO_PROMPT, 4).sample(x)
    assert masked.token_id == 2 and free.token_id == 0
    assert masked.logprob == pytest.approx(float(log_softmax(x)[2]))
    assert masked.top_logprobs == free.top_logprobs


def test_a_seeded_masked_draw_is_reproducible() -> None:
    allowed = np.zeros(50, np.bool_)
    allowed[::3] = True
    cfg = SamplingParams(temperature=1.0, seed=11)
    runs = [[Sampler(cfg, NO_PROMPT, 50).sample(x, allowed).token_id for x in random_logits(5)] for _ in range(2)]
    assert runs[0] == runs[1]

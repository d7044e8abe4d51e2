from __future__ import annotations

import dataclasses
from typing import Any

import orjson
import pytest

from frontend.sampling import InvalidSamplingValue, SamplingParams


def test_a_plain_request_reads_no_prompt_values() -> None:
    assert SamplingParams(max_tokens=4).reads_prompt_token_values == ()


@pytest.mark.parametrize(
    ("changes", "reason"),
    [
        ({"frequency_penalty": 0.1}, "frequency_penalty"),
        ({"presence_penalty": -0.1}, "presence_penalty"),
        ({"repetition_penalty": 1.05}, "repetition_penalty"),
        ({"no_repeat_ngram_size": 3}, "no_repeat_ngram_size"),
        ({"echo": True}, "echo"),
        ({"prompt_logprobs": 0}, "prompt_logprobs"),
        ({"logit_bias": ((1, 1.0),)}, "logit_bias"),
    ],
)
def test_each_value_reader_is_named(changes: dict[str, Any], reason: str) -> None:
    assert SamplingParams(max_tokens=4, **changes).reads_prompt_token_values == (reason,)


def test_sampling_params_are_immutable() -> None:
    with pytest.raises(dataclasses.FrozenInstanceError):
        SamplingParams(max_tokens=4).max_tokens = 5  # type: ignore[misc]


@pytest.mark.parametrize(
    ("bad", "field"),
    [
        ({"max_tokens": 0}, "max_tokens"),
        ({"temperature": -1.0}, "temperature"),
        ({"top_p": 0.0}, "top_p"),
        ({"top_p": 1.5}, "top_p"),
        ({"top_k": -1}, "top_k"),
        ({"repetition_penalty": 0.0}, "repetition_penalty"),
        ({"no_repeat_ngram_size": -1}, "no_repeat_ngram_size"),
        ({"logprobs": -1}, "logprobs"),
        ({"prompt_logprobs": -1}, "prompt_logprobs"),
    ],
)
def test_values_no_engine_accepts_are_refused_by_name(bad: dict[str, Any], field: str) -> None:
    with pytest.raises(InvalidSamplingValue) as caught:
        SamplingParams(**bad)
    assert caught.value.field == field


def test_the_ipc_form_round_trips_through_json() -> None:
    params = SamplingParams(max_tokens=7, temperature=0.5, top_p=0.9, top_k=4, seed=3, stop=("a", "bc"),
                            frequency_penalty=0.1, presence_penalty=0.2, repetition_penalty=1.1, echo=True,
                            prompt_logprobs=2, logit_bias=((1, 1.0), (5, -2.5)), logprobs=3, ignore_eos=True)
    wire = orjson.loads(orjson.dumps(params.to_wire()))
    assert SamplingParams.from_wire(wire) == params
    # Driven by the fields: a field added to the dataclass travels without touching the IPC code.
    assert set(wire) == {field.name for field in dataclasses.fields(SamplingParams)}


def test_an_unknown_ipc_field_is_refused() -> None:
    with pytest.raises(TypeError):
        SamplingParams.from_wire({"max_tokens": 1, "temprature": 0.5})

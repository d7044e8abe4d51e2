from __future__ import annotations

import dataclasses

import pytest

from workers.sampling_params import SamplingParams


def test_a_plain_request_reads_no_prompt_values() -> None:
    assert SamplingParams(max_tokens=4).reads_prompt_token_values == ()


@pytest.mark.parametrize(
    ("changes", "reason"),
    [
        ({"frequency_penalty": 0.1}, "frequency_penalty"),
        ({"presence_penalty": -0.1}, "presence_penalty"),
        ({"repetition_penalty": 1.05}, "repetition_penalty"),
        ({"echo": True}, "echo"),
        ({"prompt_logprobs": 0}, "prompt_logprobs"),
        ({"logit_bias": ((1, 1.0),)}, "logit_bias"),
    ],
)
def test_each_value_reader_is_named(changes: dict[str, object], reason: str) -> None:
    assert SamplingParams(max_tokens=4, **changes).reads_prompt_token_values == (reason,)  # type: ignore[arg-type]


def test_sampling_params_are_immutable() -> None:
    with pytest.raises(dataclasses.FrozenInstanceError):
        SamplingParams(max_tokens=4).max_tokens = 5  # type: ignore[misc]

"""Our sampling parameters as vLLM's keyword arguments, and what does not map refused by name."""

from __future__ import annotations

import pytest

from frontend.errors import UnsupportedParameterError
from frontend.sampling import SamplingParams
from workers.engines.vllm.sampling import vllm_sampling_fields


def test_every_mapped_field_reaches_vllm() -> None:
    sampling = SamplingParams(max_tokens=50, temperature=0.7, top_p=0.9, top_k=40, seed=-5, frequency_penalty=0.5,
                              presence_penalty=0.25, repetition_penalty=1.2, logprobs=3, logit_bias=((7, -2.0),),
                              stop=("never sent",))
    fields = vllm_sampling_fields(sampling, 1, {2, 0}, {"do_remote_decode": True})
    assert fields == {
        "max_tokens": 1, "temperature": 0.7, "top_p": 0.9, "top_k": 40, "seed": -5, "frequency_penalty": 0.5,
        "presence_penalty": 0.25, "repetition_penalty": 1.2, "logprobs": 3, "ignore_eos": False,
        "stop_token_ids": [0, 2], "detokenize": False, "logit_bias": {7: -2.0},
        "extra_args": {"kv_transfer_params": {"do_remote_decode": True}},
    }  # stop strings stay in our front end


def test_ignore_eos_sends_no_stop_ids_and_no_transfer_means_no_extra_args() -> None:
    fields = vllm_sampling_fields(SamplingParams(max_tokens=5, ignore_eos=True), 5, {2}, None)
    assert fields["stop_token_ids"] == [] and fields["ignore_eos"] is True
    assert "extra_args" not in fields and "logit_bias" not in fields


def test_prompt_logprobs_are_refused_by_name() -> None:
    with pytest.raises(UnsupportedParameterError) as caught:
        vllm_sampling_fields(SamplingParams(max_tokens=5, prompt_logprobs=1), 5, {2}, None)
    assert caught.value.param == "prompt_logprobs"

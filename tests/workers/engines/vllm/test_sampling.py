"""Our sampling parameters as vLLM's keyword arguments, and what does not map refused by name."""

from __future__ import annotations

import llguidance
import orjson
import pytest

from frontend.errors import UnsupportedParameterError
from frontend.sampling import SamplingParams
from frontend.structured_output import JSON_OPTIONS, check_json_schema, json_grammar
from frontend.tool_parsers import hermes
from workers.engines.vllm.sampling import (
    guidance_schema,
    refuse_n_across_handoff,
    repeated_sequences,
    vllm_sampling_fields,
)


def test_every_mapped_field_reaches_vllm() -> None:
    sampling = SamplingParams(max_tokens=50, temperature=0.7, top_p=0.9, top_k=40, seed=-5, frequency_penalty=0.5,
                              presence_penalty=0.25, repetition_penalty=1.2, logprobs=3, logit_bias=((7, -2.0),),
                              stop=("never sent",))
    fields = vllm_sampling_fields(sampling, 1, {2, 0}, {"do_remote_decode": True})
    assert fields == {
        "n": 1, "max_tokens": 1, "temperature": 0.7, "top_p": 0.9, "top_k": 40, "seed": -5, "frequency_penalty": 0.5,
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


def test_sampled_n_is_vllms_and_a_handed_off_seed_replaces_the_requests() -> None:
    fields = vllm_sampling_fields(SamplingParams(max_tokens=5, temperature=0.8, seed=3, n=3), 5, {2}, None, 99)
    assert fields["n"] == 3 and fields["seed"] == 99
    assert repeated_sequences(SamplingParams(max_tokens=5, temperature=0.8, n=3)) == 1


def test_greedy_n_asks_vllm_for_one_sequence_and_repeats_it() -> None:
    # vLLM refuses n > 1 under greedy sampling: every sequence would be the same one.
    sampling = SamplingParams(max_tokens=5, temperature=0, n=3)
    assert vllm_sampling_fields(sampling, 5, {2}, None)["n"] == 1
    assert repeated_sequences(sampling) == 3


def test_a_json_schema_reaches_vllm_as_the_grammar_our_front_end_compiles() -> None:
    # The client's own x-guidance asks for free whitespace; this server's options win, as in json_grammar.
    schema = check_json_schema({"type": "object", "properties": {"b": {"type": "integer"}, "a": {"type": "string"}},
                                "required": ["b", "a"], "x-guidance": {"whitespace_flexible": True}}, "response_format")
    fields = vllm_sampling_fields(SamplingParams(max_tokens=5, json_schema=schema), 5, {2}, None)
    sent = fields["structured_outputs"]["json"]
    assert list(orjson.loads(sent)["properties"]) == ["b", "a"]  # the client's key order: the output's order
    # What vLLM's guidance backend compiles: the schema with its own whitespace default under our x-guidance.
    vllm_compiles = llguidance.LLMatcher.grammar_from_json_schema(sent, defaults={"whitespace_flexible": True})
    assert vllm_compiles == json_grammar(schema)
    assert "structured_outputs" not in vllm_sampling_fields(SamplingParams(max_tokens=5), 5, {2}, None)


def test_tool_choice_autos_grammar_reaches_vllm_as_lark_for_its_guidance_backend() -> None:
    lark = hermes.grammar([{"type": "object", "properties": {"name": {"const": "f"}, "arguments": {"type": "object"}},
                            "required": ["name", "arguments"]}], parallel=True)
    fields = vllm_sampling_fields(SamplingParams(max_tokens=5, grammar=lark), 5, {2}, None)
    assert fields["structured_outputs"] == {"grammar": lark}
    assert lark.startswith("%llguidance")  # what llguidance reads as its Lark syntax
    assert not llguidance.LLMatcher.validate_grammar(llguidance.LLMatcher.grammar_from_lark(lark))


def test_a_boolean_schema_passes_as_it_is() -> None:
    assert guidance_schema("true") == "true"


def test_sampled_n_across_a_connector_that_hands_kv_over_once_is_refused_by_name() -> None:
    sampled = SamplingParams(temperature=0.8, n=2)
    with pytest.raises(UnsupportedParameterError, match="NixlConnector") as caught:
        refuse_n_across_handoff(sampled, "NixlConnector")
    assert caught.value.param == "n"
    refuse_n_across_handoff(sampled, "ExampleConnector")  # files: every sequence reads them
    refuse_n_across_handoff(sampled, None)  # nothing handed off
    refuse_n_across_handoff(SamplingParams(temperature=0, n=2), "NixlConnector")  # greedy: one vLLM request


def test_a_client_x_guidance_that_is_not_an_object_is_replaced_by_our_options() -> None:
    # A list there must not become a TypeError (a 500) in the adapter; our options are what counts anyway.
    schema = orjson.loads(guidance_schema(orjson.dumps({"type": "object", "x-guidance": [1, 2]}).decode()))
    assert schema["x-guidance"] == JSON_OPTIONS

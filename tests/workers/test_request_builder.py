from __future__ import annotations

from typing import Any

import numpy as np
import pybase64
import pytest

from frontend.chat_messages import ChatMessage
from frontend.disaggregated_params import DisaggregatedParams
from frontend.errors import ContextLengthError, HandoffError, InvalidRequestError, UnsupportedParameterError
from frontend.http import validate_wire
from frontend.openai_models import ChatCompletionRequest, CompletionRequest, GenerationWireRequest, ResponsesRequest
from frontend.sampling import SamplingParams
from frontend.token_codec import encode_prompt_tokens
from frontend.tool_parsers import FORMATS
from workers.engines.outputs import EngineInfo
from workers.engines.request import Phase, PromptPath
from workers.engines.synthetic import SyntheticConfig, SyntheticEngine
from workers.request_builder import (
    endpoint_of,
    handoff_from,
    phase_of,
    prepare_prompt,
    prompt_facts_of,
    resolve_max_tokens,
    sampling_params_from,
    template_message,
)

ENGINE = SyntheticEngine(SyntheticConfig(max_context=64))
INFO = ENGINE.info
CHAT: dict[str, Any] = {"model": "synthetic", "messages": [{"role": "user", "content": "hi"}]}
GEN_PARAMS = {"request_type": "generation_only", "prompt_len": 3, "first_gen_tokens": [84],
              "encoded_opaque_state": pybase64.b64encode(b"{}").decode(), "native_extensions": True}


def wire_of(model: type[GenerationWireRequest], body: dict[str, Any]) -> GenerationWireRequest:
    return validate_wire(model, body)


async def prepare(model: type[GenerationWireRequest], body: dict[str, Any], info: EngineInfo = INFO) -> Any:
    wire = wire_of(model, body)
    return await prepare_prompt(wire, sampling_params_from(wire, info), info, ENGINE.get_tokenizer())


def resolved(wire: GenerationWireRequest, prompt_len: int, info: EngineInfo = INFO) -> SamplingParams:
    return resolve_max_tokens(wire, sampling_params_from(wire, info), prompt_len, info)


async def test_b64_comes_first_and_is_zero_copy() -> None:
    body = {**CHAT, "prompt_token_ids": [9, 9], "prompt_token_ids_b64": encode_prompt_tokens([1, 2, 3])}
    prompt = await prepare(ChatCompletionRequest, body)
    assert prompt.path is PromptPath.ARRAY
    assert prompt.tokens.tolist() == [1, 2, 3]
    assert isinstance(prompt.tokens.base, bytes)
    assert prompt.token_list is None


async def test_an_explicit_list_comes_next_and_is_kept() -> None:
    body = {**CHAT, "prompt_token_ids": [4, 5, 6]}
    prompt = await prepare(ChatCompletionRequest, body)
    assert prompt.path is PromptPath.LIST
    assert prompt.token_list == [4, 5, 6]
    np.testing.assert_array_equal(prompt.tokens, [4, 5, 6])


@pytest.mark.parametrize("prompt", [[7, 8], [[7, 8]]])
async def test_completion_prompt_ids_are_the_list_path(prompt: list[Any]) -> None:
    result = await prepare(CompletionRequest, {"model": "synthetic", "prompt": prompt})
    assert result.path is PromptPath.LIST
    assert result.tokens.tolist() == [7, 8]


async def test_generation_only_with_just_prompt_len_is_a_placeholder() -> None:
    body = {**CHAT, "disaggregated_params": GEN_PARAMS}
    prompt = await prepare(ChatCompletionRequest, body)
    assert prompt.path is PromptPath.METADATA_ONLY
    assert prompt.tokens.size == 3


async def test_generation_only_with_just_prompt_len_and_a_penalty_is_refused() -> None:
    body = {**CHAT, "disaggregated_params": GEN_PARAMS, "presence_penalty": 1.0}
    with pytest.raises(InvalidRequestError) as caught:
        await prepare(ChatCompletionRequest, body)
    assert caught.value.code == "metadata_only_refused"
    assert caught.value.param == "presence_penalty"


async def test_text_is_tokenized_last() -> None:
    prompt = await prepare(CompletionRequest, {"model": "synthetic", "prompt": "héllo"})
    assert prompt.path is PromptPath.TEXT
    assert prompt.tokens.tolist() == list("héllo".encode())


async def test_long_text_is_tokenized_off_the_loop_with_the_same_result() -> None:
    info = EngineInfo("synthetic", "synthetic", 50_000, 1_000_000)
    text = "abc" * 10_000
    prompt = await prepare(CompletionRequest, {"model": "synthetic", "prompt": text}, info)
    assert prompt.tokens.size == len(text)


@pytest.mark.parametrize(
    ("model", "body", "param"),
    [
        (CompletionRequest, {"model": "synthetic", "prompt": "x" * 65}, "prompt"),
        (ChatCompletionRequest, {**CHAT, "messages": [{"role": "user", "content": "x" * 65}]}, "messages"),
        (CompletionRequest, {"model": "synthetic", "prompt": list(range(65))}, "prompt"),
        (ChatCompletionRequest, {**CHAT, "prompt_token_ids": list(range(65))}, "prompt_token_ids"),
        (ChatCompletionRequest, {**CHAT, "prompt_token_ids_b64": encode_prompt_tokens(list(range(65)))},
         "prompt_token_ids_b64"),
    ],
)
async def test_a_prompt_longer_than_the_context_is_refused(
    model: type[GenerationWireRequest], body: dict[str, Any], param: str
) -> None:
    with pytest.raises(ContextLengthError) as caught:
        await prepare(model, body)
    assert caught.value.param == param


async def test_a_too_long_responses_prompt_names_input() -> None:
    with pytest.raises(ContextLengthError) as caught:
        await prepare(ResponsesRequest, {"model": "synthetic", "input": "x" * 80})
    assert caught.value.param == "input"


async def test_an_empty_prompt_is_refused() -> None:
    with pytest.raises(InvalidRequestError) as caught:
        await prepare(CompletionRequest, {"model": "synthetic", "prompt": ""})
    assert caught.value.param == "prompt"


async def test_media_is_refused_for_a_text_model() -> None:
    body = {**CHAT, "messages": [{"role": "user", "content": [{"type": "input_audio", "input_audio": {}}]}]}
    with pytest.raises(UnsupportedParameterError) as caught:
        await prepare(ChatCompletionRequest, body)
    assert caught.value.param == "messages"


# -- sampling parameters -----------------------------------------------------------------------------------
def test_sampling_defaults_and_fields() -> None:
    wire = wire_of(ChatCompletionRequest, {**CHAT, "temperature": 0, "top_p": 0.5, "top_k": 3, "seed": 1,
                                           "stop": "x", "frequency_penalty": 0.5, "logit_bias": {"7": 2, "3": -1},
                                           "logprobs": True, "top_logprobs": 2})
    assert sampling_params_from(wire, INFO).max_tokens is None  # not asked for: open until the prompt is known
    sampling = resolved(wire, 10)
    assert sampling.max_tokens == 54  # the rest of the context
    assert (sampling.temperature, sampling.top_p, sampling.top_k, sampling.seed) == (0.0, 0.5, 3, 1)
    assert sampling.stop == ("x",)
    assert sampling.logit_bias == ((3, -1.0), (7, 2.0))
    assert sampling.logprobs == 2
    assert sampling.reads_prompt_token_values == ("frequency_penalty", "logit_bias")


@pytest.mark.parametrize(
    ("model", "body", "param"),
    [
        (ChatCompletionRequest, {**CHAT, "max_tokens": 60}, "max_tokens"),
        (ChatCompletionRequest, {**CHAT, "max_completion_tokens": 60}, "max_completion_tokens"),
        (CompletionRequest, {"model": "synthetic", "prompt": "x", "max_tokens": 60}, "max_tokens"),
        (ResponsesRequest, {"model": "synthetic", "input": "x", "max_output_tokens": 60}, "max_output_tokens"),
    ],
)
def test_max_tokens_beyond_the_context_names_its_field(
    model: type[GenerationWireRequest], body: dict[str, Any], param: str
) -> None:
    with pytest.raises(ContextLengthError) as caught:
        resolved(wire_of(model, body), 10)
    assert caught.value.param == param


def test_a_prompt_that_fills_the_context_leaves_no_room() -> None:
    with pytest.raises(ContextLengthError):
        resolved(wire_of(CompletionRequest, {"model": "synthetic", "prompt": "x", "max_tokens": None}), 64)


@pytest.mark.parametrize("key", ["-1", "abc", "64000", "1.5"])
def test_logit_bias_keys_must_be_token_ids(key: str) -> None:
    with pytest.raises(InvalidRequestError) as caught:
        sampling_params_from(wire_of(ChatCompletionRequest, {**CHAT, "logit_bias": {key: 1}}), INFO)
    assert caught.value.param == "logit_bias"


def test_logprobs_on_an_engine_without_them_is_refused() -> None:
    info = EngineInfo("x", "synthetic", 50_000, 64, supports_logprobs=False)
    with pytest.raises(UnsupportedParameterError):
        sampling_params_from(wire_of(CompletionRequest, {"model": "synthetic", "prompt": "x", "logprobs": 1}), info)


# -- what the guardrail reads of the prompt -------------------------------------------------------------------
@pytest.mark.parametrize(
    ("model", "body", "multimodal", "harmony"),
    [
        (ChatCompletionRequest, CHAT, False, False),
        (ChatCompletionRequest, {**CHAT, "messages": [{"role": "user", "content": [
            {"type": "text", "text": "see"}, {"type": "image_url", "image_url": {"url": "x"}}]}]}, True, False),
        (ChatCompletionRequest, {**CHAT, "chat_template_kwargs": {"format": "harmony"}}, False, True),
        (ResponsesRequest, {"model": "synthetic", "input": [{"role": "user", "content": [
            {"type": "input_audio", "input_audio": {}}]}]}, True, False),
        (ResponsesRequest, {"model": "synthetic", "input": "hi"}, False, False),
        (CompletionRequest, {"model": "synthetic", "prompt": "hi"}, False, False),
    ],
)
def test_prompt_facts_of_a_validated_request(
    model: type[GenerationWireRequest], body: dict[str, Any], multimodal: bool, harmony: bool
) -> None:
    facts = prompt_facts_of(wire_of(model, body))
    assert (facts.multimodal, facts.harmony) == (multimodal, harmony)


# -- hand-off, phase, endpoint ----------------------------------------------------------------------------------
def test_handoff_from_generation_only_params() -> None:
    params = DisaggregatedParams.model_validate({**GEN_PARAMS, "ctx_request_id": 12,
                                                 "first_gen_logprobs": [{"token_id": 84, "logprob": -0.1}]})
    handoff = handoff_from(params, 50_000)
    assert handoff is not None
    assert handoff.first_gen_tokens == (84,)
    assert handoff.opaque_state == b"{}"
    assert handoff.ctx_request_id == "12"
    assert handoff.first_gen_logprobs[0].token_id == 84
    assert handoff_from(None, 50_000) is None
    assert handoff_from(DisaggregatedParams(request_type="context_only"), 50_000) is None


@pytest.mark.parametrize(
    "changes",
    [{"first_gen_tokens": []}, {"first_gen_tokens": [-1]}, {"encoded_opaque_state": None},
     {"encoded_opaque_state": "@@@"},
     {"first_gen_tokens": [84, 85], "first_gen_steps": [1]}],  # steps that do not add up to the tokens
)
def test_bad_handoffs_are_refused(changes: dict[str, Any]) -> None:
    with pytest.raises(HandoffError):
        handoff_from(DisaggregatedParams.model_validate({**GEN_PARAMS, **changes}), 50_000)


def test_a_continued_stream_s_steps_ride_its_handoff() -> None:
    params = DisaggregatedParams.model_validate({**GEN_PARAMS, "first_gen_tokens": [84, 85, 86],
                                                 "first_gen_steps": [1, 2]})
    handoff = handoff_from(params, 50_000)
    assert handoff is not None and handoff.first_gen_steps == (1, 2)


def test_phase_and_endpoint() -> None:
    assert phase_of(None) is Phase.AGGREGATED
    assert phase_of(DisaggregatedParams(request_type="context_only")) is Phase.CONTEXT_ONLY
    assert phase_of(DisaggregatedParams(request_type="generation_only")) is Phase.GENERATION_ONLY
    assert endpoint_of(wire_of(ChatCompletionRequest, CHAT)) == "chat"
    assert endpoint_of(wire_of(CompletionRequest, {"model": "m", "prompt": "x"})) == "completions"
    assert endpoint_of(wire_of(ResponsesRequest, {"model": "m", "input": "x"})) == "responses"


def test_tool_calls_names_and_tool_answers_reach_the_chat_template() -> None:
    call = {"id": "c1", "type": "function", "function": {"name": "weather", "arguments": '{"city": "Oslo"}'}}
    assistant = ChatMessage.model_validate({"role": "assistant", "content": None, "tool_calls": [call],
                                            "refusal": None, "audio": None, "function_call": None})
    assert template_message(assistant) == {
        "role": "assistant",
        "content": '<tool_call>\n{"name":"weather","arguments":{"city":"Oslo"}}\n</tool_call>',
    }
    tool = ChatMessage.model_validate({"role": "tool", "tool_call_id": "c1", "content": "12 C"})
    assert template_message(tool) == {"role": "tool", "content": "12 C", "tool_call_id": "c1"}
    named = ChatMessage.model_validate({"role": "developer", "content": "Be brief", "name": "rules"})
    assert template_message(named) == {"role": "system", "content": "Be brief", "name": "rules"}
    # In the model's own format where it has another: as it is asked to write calls.
    assert template_message(assistant, FORMATS["mistral"].calls_text)["content"] == \
        '[TOOL_CALLS][{"name":"weather","arguments":{"city":"Oslo"}}]'

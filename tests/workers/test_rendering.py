"""The worker's renderer on its own: whole answers and streams from collected text steps, the context fields and the
field set of the request's dialect, and logprobs as clients read them."""

from __future__ import annotations

import asyncio
from typing import Any

import numpy as np

from frontend.openai_models import CompletionRequest, ResponsesRequest
from frontend.openai_output import ResponseIdentity
from frontend.sampling import SamplingParams
from frontend.token_codec import TOKEN_DTYPE
from workers.dialects import NATIVE, AnswerDialect
from workers.engines.byte_tokenizer import ByteTokenizer
from workers.engines.outputs import FinishReason, TokenLogprob
from workers.engines.request import GenerationRequest, Phase
from workers.prepared_generation import PreparedGeneration
from workers.rendering import Renderer, echo_logprob_infos, vllm_prompt_logprobs
from workers.text_stream import CollectedOutput, TextStep
from workers.trtllm.answers import Trtllm
from workers.trtllm.generation_first import HandoffBoard
from workers.trtllm.lifecycle import LifecycleControl
from workers.trtllm.settings import LifecycleSettings

TOKENIZER = ByteTokenizer(512)
PROMPT = np.frombuffer(b"prompt", dtype=np.uint8).astype(TOKEN_DTYPE)


class Tokenizers:
    def get_tokenizer(self) -> ByteTokenizer:
        return TOKENIZER


def prepared(sampling: SamplingParams, *, phase: Phase = Phase.AGGREGATED, dialect: AnswerDialect = NATIVE,
             disagg: dict[str, Any] | None = None) -> PreparedGeneration:
    wire = CompletionRequest.model_validate({"model": "m", "prompt": "prompt",
                                             **({"disaggregated_params": disagg} if disagg else {})})
    request = GenerationRequest("123", PROMPT, sampling, phase=phase)
    return PreparedGeneration(wire, request, ResponseIdentity("completions", "cmpl-123", "m"),
                              wire.disaggregated_params, dialect)


def collected(text: bytes, finish: FinishReason | None = "length", state: bytes | None = None) -> CollectedOutput:
    out = CollectedOutput.of(1)
    out.add(TextStep(text.decode(), tuple(text), tuple(TokenLogprob(t, -0.5) for t in text), finish, state))
    return out


def test_a_whole_answer_with_echo_and_logprobs_opens_with_the_prompt() -> None:
    body = Renderer(Tokenizers()).whole(prepared(SamplingParams(max_tokens=2, echo=True, logprobs=0)),
                                        collected(b"ab"))
    choice = body["choices"][0]
    assert choice["text"] == "promptab"
    assert choice["logprobs"]["tokens"] == list("promptab")
    assert choice["logprobs"]["token_logprobs"] == [None] * 6 + [-0.5, -0.5]
    assert body["system_fingerprint"]


def test_a_ctx_answer_in_our_shape_carries_our_hand_off_fields() -> None:
    ctx = prepared(SamplingParams(max_tokens=4), phase=Phase.CONTEXT_ONLY,
                   disagg={"request_type": "context_only", "native_extensions": True})
    body = Renderer(Tokenizers()).whole(ctx, collected(b"a", None, b"kv"))
    params = body["choices"][0]["disaggregated_params"]
    assert params["ctx_request_id"] == "123" and params["prompt_len"] == 6 and params["native_extensions"]
    assert params["first_gen_tokens"] == [ord("a")] and params["encoded_opaque_state"] == "a3Y="
    assert body["system_fingerprint"]


async def test_a_ctx_answer_in_tensorrt_llms_shape_has_its_fields_only() -> None:
    lifecycle = LifecycleControl("context", LifecycleSettings(), abort_request=_nothing, release_handoff=_kept)
    trtllm = Trtllm(lifecycle, HandoffBoard(60.0, lifecycle.clock))
    ctx = prepared(SamplingParams(max_tokens=4), phase=Phase.CONTEXT_ONLY, dialect=trtllm,
                   disagg={"request_type": "context_only"})
    body = Renderer(Tokenizers()).whole(ctx, collected(b"a", None, b"kv"))
    choice = body["choices"][0]
    assert choice["disaggregated_params"]["ctx_request_id"] == 123
    assert "prompt_len" not in choice["disaggregated_params"]
    assert choice["finish_reason"] == "not_finished"
    assert "system_fingerprint" not in body and body["prompt_token_ids"] == list(b"prompt")
    await lifecycle.aclose()


async def test_a_stream_tells_its_end_once_with_whether_it_finished() -> None:
    ends: list[bool] = []

    async def steps() -> Any:
        yield TextStep("b", (98,), finish_reason="length")

    request = prepared(SamplingParams(max_tokens=2))
    frames = Renderer(Tokenizers()).frames(request, steps(), TextStep("a", (97,)),
                                           lambda _, ok: ends.append(ok))
    text = b"".join([frame async for frame in frames])
    assert b'"text":"a"' in text and b'"text":"b"' in text and text.endswith(b"data: [DONE]\n\n")
    assert ends == [True]


def test_prompt_logprobs_in_vllms_shape_rank_the_prompts_token_among_the_top() -> None:
    scores = [None, TokenLogprob(98, -1.0, ((99, -0.5), (98, -1.0)))]
    assert vllm_prompt_logprobs(TOKENIZER, scores) == [None, {
        "98": {"logprob": -1.0, "rank": 2, "decoded_token": "b"},
        "99": {"logprob": -0.5, "rank": 1, "decoded_token": "c"},
    }]
    entries = echo_logprob_infos(TOKENIZER, [97, 98], scores)
    assert [(e.token, e.logprob) for e in entries] == [("a", None), ("b", -1.0)]


async def _nothing(_: str) -> None:
    await asyncio.sleep(0)


async def _kept(_: str, __: bytes) -> bool:
    return False


def responses_call(phase: Phase = Phase.AGGREGATED) -> PreparedGeneration:
    """A Responses request whose answer is a forced call (its structured output made it ``tool_call``)."""
    wire = ResponsesRequest.model_validate({"model": "m", "input": "hi", "tool_choice": "required", "tools": [
        {"type": "function", "name": "f", "parameters": {"type": "object"}}]})
    request = GenerationRequest("123", PROMPT, SamplingParams(max_tokens=32), phase=phase)
    return PreparedGeneration(wire, request, ResponseIdentity("responses", "resp_123", "m"), None, NATIVE,
                              tool_call=True)


CALL_TEXT = b'{"name": "f", "arguments": {"a": 1}}'


def test_a_whole_responses_call_is_a_function_call_item() -> None:
    body = Renderer(Tokenizers()).whole(responses_call(), collected(CALL_TEXT, "stop"))
    assert body["output"] == [{"type": "function_call", "id": "fc_123", "call_id": "call_123", "name": "f",
                               "arguments": '{"a":1}', "status": "completed"}]
    assert body["status"] == "completed"
    cut = Renderer(Tokenizers()).whole(responses_call(), collected(CALL_TEXT[:6], "length"))
    assert cut["output"][0]["type"] == "message" and cut["status"] == "incomplete"


async def test_a_streamed_responses_call_is_held_back_and_sent_as_a_function_call() -> None:
    async def steps() -> Any:
        yield TextStep(CALL_TEXT[4:].decode(), tuple(CALL_TEXT[4:]), finish_reason="stop")

    frames = Renderer(Tokenizers()).frames(responses_call(), steps(),
                                           TextStep(CALL_TEXT[:4].decode(), tuple(CALL_TEXT[:4])),
                                           lambda _, ok: None)
    events = [frame.split(b"\n")[0].removeprefix(b"event: ").decode() async for frame in frames]
    assert events == ["response.created", "response.in_progress", "response.output_item.added",
                      "response.function_call_arguments.delta", "response.function_call_arguments.done",
                      "response.output_item.done", "response.completed"]

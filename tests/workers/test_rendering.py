"""The worker's renderer on its own: whole answers and streams from collected text steps, the context fields and the
field set of the request's dialect, and logprobs as clients read them."""

from __future__ import annotations

import asyncio
from typing import Any

import numpy as np
import orjson
import pytest

from frontend.openai_models import ChatCompletionRequest, CompletionRequest, ResponsesRequest
from frontend.openai_output import Endpoint, ResponseIdentity
from frontend.sampling import SamplingParams
from frontend.token_codec import TOKEN_DTYPE
from frontend.tool_calls import FORCED, ToolCalling
from frontend.tool_parsers import FORMATS
from orchestrator.flow.migration import StreamLedger
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
                              tool_calling=FORCED)


CALL_TEXT = b'{"name": "f", "arguments": {"a": 1}}'


def test_a_whole_responses_call_is_a_function_call_item() -> None:
    body = Renderer(Tokenizers()).whole(responses_call(), collected(CALL_TEXT, "stop"))
    assert body["output"] == [{"type": "function_call", "id": "fc_123", "call_id": "call_123", "name": "f",
                               "arguments": '{"a": 1}', "status": "completed"}]  # as generated
    assert body["status"] == "completed"
    cut = Renderer(Tokenizers()).whole(responses_call(), collected(CALL_TEXT[:6], "length"))
    assert cut["output"][0]["type"] == "message" and cut["status"] == "incomplete"


async def test_a_streamed_responses_call_is_sent_as_a_function_call() -> None:
    async def steps() -> Any:
        yield TextStep(CALL_TEXT[4:].decode(), tuple(CALL_TEXT[4:]), finish_reason="stop")

    frames = Renderer(Tokenizers()).frames(responses_call(), steps(),
                                           TextStep(CALL_TEXT[:4].decode(), tuple(CALL_TEXT[:4])),
                                           lambda _, ok: None)
    events = [frame.split(b"\n")[0].removeprefix(b"event: ").decode() async for frame in frames]
    assert events == ["response.created", "response.in_progress", "response.output_item.added",
                      "response.function_call_arguments.delta", "response.function_call_arguments.done",
                      "response.output_item.done", "response.completed"]


# -- tool_choice "auto": the model's own format, read as it comes ------------------------------------------------------
AUTO_ANSWER = ('I will look.\n<tool_call>\n{"name": "f", "arguments": {"a": 1}}\n</tool_call>\n'
               '<tool_call>\n{"name": "g", "arguments": {}}\n</tool_call>')


def chat_auto(parallel: bool = True) -> PreparedGeneration:
    wire = ChatCompletionRequest.model_validate({"model": "m", "messages": [{"role": "user", "content": "hi"}],
                                                 "stream": True})
    request = GenerationRequest("123", PROMPT, SamplingParams(max_tokens=64), phase=Phase.AGGREGATED)
    return PreparedGeneration(wire, request, ResponseIdentity("chat", "chatcmpl-123", "m"), None, NATIVE,
                              tool_calling=ToolCalling(FORMATS["hermes"], parallel))


async def streamed_chunks(prepared: PreparedGeneration, text: str, piece: int, finish: FinishReason) -> list[Any]:
    """The stream's chunks for ``text`` generated ``piece`` characters at a time."""
    pieces = [text[i:i + piece] for i in range(0, len(text), piece)]

    async def steps() -> Any:
        for index, rest in enumerate(pieces[1:], start=1):
            yield TextStep(rest, (1,), finish_reason=finish if index == len(pieces) - 1 else None)

    first = TextStep(pieces[0], (1,), finish_reason=finish if len(pieces) == 1 else None)
    frames = Renderer(Tokenizers()).frames(prepared, steps(), first, lambda _, ok: None)
    return [orjson.loads(frame.removeprefix(b"data: ")) async for frame in frames if frame != b"data: [DONE]\n\n"]


def test_a_whole_chat_answer_in_the_models_format_is_its_text_then_its_calls() -> None:
    body = Renderer(Tokenizers()).whole(chat_auto(), collected(AUTO_ANSWER.encode(), "stop"))
    choice = body["choices"][0]
    assert choice["finish_reason"] == "tool_calls"
    assert choice["message"] == {"role": "assistant", "content": "I will look.", "tool_calls": [
        {"id": "call_123", "type": "function", "function": {"name": "f", "arguments": '{"a": 1}'}},
        {"id": "call_123-1", "type": "function", "function": {"name": "g", "arguments": "{}"}}]}
    one = Renderer(Tokenizers()).whole(chat_auto(parallel=False), collected(AUTO_ANSWER.encode(), "stop"))
    assert [call["function"]["name"] for call in one["choices"][0]["message"]["tool_calls"]] == ["f"]
    plain = Renderer(Tokenizers()).whole(chat_auto(), collected(b"no call <tool here", "stop"))
    assert plain["choices"][0]["message"] == {"role": "assistant", "content": "no call <tool here"}
    assert plain["choices"][0]["finish_reason"] == "stop"


async def test_a_streamed_chat_answer_sends_text_then_each_calls_arguments_in_pieces() -> None:
    for piece in (1, 3, len(AUTO_ANSWER)):
        chunks = await streamed_chunks(chat_auto(), AUTO_ANSWER, piece, "stop")
        deltas = [chunk["choices"][0]["delta"] for chunk in chunks if chunk["choices"]]
        text = "".join(delta.get("content") or "" for delta in deltas)
        assert text == "I will look."  # the marker and the whitespace before it never reach the client
        calls = [call for delta in deltas for call in delta.get("tool_calls") or ()]
        assert [(call["index"], call["id"], call["function"]["name"]) for call in calls if "id" in call] == \
            [(0, "call_123", "f"), (1, "call_123-1", "g")]
        arguments = ["".join(call["function"]["arguments"] for call in calls if call["index"] == index)
                     for index in (0, 1)]
        assert arguments == ['{"a": 1}', "{}"]
        if piece == 1:  # as generated: one piece per step, not one delta once the call is complete
            assert len([call for call in calls if call["index"] == 0]) == len('{"a": 1}') + 1
        assert chunks[-1]["choices"][0]["finish_reason"] == "tool_calls"


async def test_a_stream_cut_short_inside_a_call_ends_with_length_after_the_pieces_sent() -> None:
    cut = AUTO_ANSWER[:AUTO_ANSWER.index('"a": 1') + 4]
    chunks = await streamed_chunks(chat_auto(), cut, 2, "length")
    calls = [call for chunk in chunks if chunk["choices"] for call in chunk["choices"][0]["delta"].get("tool_calls")
             or ()]
    assert "".join(call["function"]["arguments"] for call in calls) == '{"a":'
    assert chunks[-1]["choices"][0]["finish_reason"] == "length"


async def test_an_answer_cut_short_after_its_calls_ends_with_length_whole_and_streamed() -> None:
    answer = AUTO_ANSWER + " and then I went on"  # without the grammar a model may write on after its calls
    body = Renderer(Tokenizers()).whole(chat_auto(), collected(answer.encode(), "length"))
    assert body["choices"][0]["finish_reason"] == "length"
    assert len(body["choices"][0]["message"]["tool_calls"]) == 2
    chunks = await streamed_chunks(chat_auto(), answer, 5, "length")
    assert chunks[-1]["choices"][0]["finish_reason"] == "length"


async def test_a_call_whose_arguments_are_not_json_is_no_tool_calls_turn_whole_or_streamed() -> None:
    """An engine without the grammar lets a model write broken JSON in the tags: the client is not told to run it."""
    broken = 'I will look.\n<tool_call>\n{"name": "f", "arguments": {"a": 1,}}\n</tool_call>'
    body = Renderer(Tokenizers()).whole(chat_auto(), collected(broken.encode(), "stop"))
    assert body["choices"][0]["message"] == {"role": "assistant", "content": broken}
    assert body["choices"][0]["finish_reason"] == "stop"
    chunks = await streamed_chunks(chat_auto(), broken, 2, "stop")
    assert chunks[-1]["choices"][0]["finish_reason"] == "stop"  # its pieces went out, but it is no call to run


async def tagged_frames(prepared: PreparedGeneration, pieces: list[str]) -> list[tuple[int, bytes]]:
    """The frames of a stream whose orchestrator asked for each step's token ids, each with how many steps the
    renderer had read when it wrote it (one token a character)."""
    prepared.stream_token_ids = True
    read = 1

    async def steps() -> Any:
        nonlocal read
        for index, piece in enumerate(pieces[1:], start=1):
            read += 1
            yield TextStep(piece, tuple(piece.encode()), finish_reason="stop" if index == len(pieces) - 1 else None)

    first = TextStep(pieces[0], tuple(pieces[0].encode()))
    return [(read, frame) async for frame in Renderer(Tokenizers()).frames(prepared, steps(), first,
                                                                         lambda _, ok: None)]


@pytest.mark.parametrize("endpoint", ["chat", "responses"])
async def test_a_stream_of_calls_moved_after_any_step_reaches_the_client_once(endpoint: Endpoint) -> None:
    """A step that writes several frames (a call opened and its arguments' first piece; a Responses message closed
    and a call's item added) is passed over whole when a continuation on another GEN replays it: the ids that say
    the client has a step's text ride the step's last frame, so nothing of it is sent twice, and nothing lost."""
    pieces = [AUTO_ANSWER[i:i + 5] for i in range(0, len(AUTO_ANSWER), 5)]

    def prepare() -> PreparedGeneration:
        if endpoint == "chat":
            return chat_auto()
        wire = ResponsesRequest.model_validate({"model": "m", "input": "hi", "stream": True, "tools": [
            {"type": "function", "name": "f"}, {"type": "function", "name": "g"}]})
        request = GenerationRequest("123", PROMPT, SamplingParams(max_tokens=64), phase=Phase.AGGREGATED)
        return PreparedGeneration(wire, request, ResponseIdentity("responses", "resp_123", "m"), None, NATIVE,
                                  tool_calling=ToolCalling(FORMATS["hermes"], True))

    frames = await tagged_frames(prepare(), pieces)
    whole = StreamLedger(endpoint).feed(b"".join(frame for _, frame in frames))
    assert b"<tool_call>" not in whole and b'"g"' in whole
    for broken_after in range(1, len(pieces)):
        ledger = StreamLedger(endpoint)
        before = ledger.feed(b"".join(frame for read, frame in frames if read <= broken_after))
        ledger.begin_replay()
        after = ledger.feed(b"".join(frame for _, frame in await tagged_frames(prepare(), pieces)))
        assert ledger.broken is None
        assert before + after == whole, broken_after

"""``tool_choice: "auto"`` end to end with the official ``openai`` SDK, through CTX and GEN and on one worker: the
call the model writes in its format is read out of its answer as chat's ``tool_calls`` and the Responses API's
``function_call`` item, whole and streamed, its arguments streamed in the pieces they are generated in.

The tiny model has random weights and would never call a tool by itself. Its vocabulary here holds Hermes' tags as
tokens of their own (as Hermes' and Qwen's do), and a ``logit_bias`` on ``<tool_call>`` makes it open a call; from
there the auto grammar holds what it writes to a tool's name and valid arguments, closes the call, and (one call
allowed) ends the answer. Without the bias the same request is text."""

from __future__ import annotations

import pathlib
from collections.abc import Iterator
from typing import Any

import jsonschema
import openai
import orjson
import pytest
from openai.types.chat import ChatCompletion
from openai.types.responses import ResponseFunctionToolCall

from tests.conformance.sdk_strict import assert_strict
from tests.workers.engines.reference.cluster import RefCluster, RefNode, reference_cluster
from tests.workers.engines.reference.tiny_model import tiny_vocab, write_tiny_model
from workers.engines.reference.options import ReferenceOptions

TAGS = ("<tool_call>", "</tool_call>")
OPEN_TOKEN = tiny_vocab(TAGS)[0].index(TAGS[0])
OPEN_A_CALL = {str(OPEN_TOKEN): 100}
# Short: every character of a tool is prompt, and the tiny model's context is 512 tokens of (mostly) one byte each.
PARAMETERS: dict[str, Any] = {
    "weather": {"type": "object", "properties": {"city": {"enum": ["Paris", "Rome"]}}, "required": ["city"],
                "additionalProperties": False},
    "time": {"type": "object", "properties": {"h": {"type": "integer", "minimum": 0, "maximum": 9}},
             "required": ["h"], "additionalProperties": False},
}
TOOLS: Any = [{"type": "function", "function": {"name": name, "parameters": parameters}}
              for name, parameters in PARAMETERS.items()]
ASK: Any = {"model": "tiny", "messages": [{"role": "user", "content": "Weather in Paris?"}], "tools": TOOLS,
            "parallel_tool_calls": False, "max_tokens": 64, "temperature": 0}


@pytest.fixture(scope="module")
def tool_cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RefCluster]:
    model: pathlib.Path = write_tiny_model(tmp_path_factory.mktemp("tools") / "tiny.gguf", seed=0, added_tokens=TAGS)
    with reference_cluster(ReferenceOptions(model_path=str(model), served_model_name="tiny", blas_threads=1)) as c:
        yield c


def the_call(reply: ChatCompletion) -> tuple[str, str]:
    (choice,) = reply.choices
    assert choice.finish_reason == "tool_calls" and choice.message.content is None
    (call,) = choice.message.tool_calls or []
    assert isinstance(call, openai.types.chat.ChatCompletionMessageFunctionToolCall)
    assert call.id.startswith("call_") and call.function.name in PARAMETERS
    jsonschema.validate(orjson.loads(call.function.arguments), PARAMETERS[call.function.name])
    return call.function.name, call.function.arguments


def whole(node: RefNode, **body: Any) -> ChatCompletion:
    with node.client() as client:
        reply: ChatCompletion = client.chat.completions.create(**{**ASK, **body})
    assert_strict(reply)
    return reply


def test_a_call_the_model_makes_is_tool_calls_equal_on_every_deployment(tool_cluster: RefCluster) -> None:
    calls = [the_call(whole(node, logit_bias=OPEN_A_CALL))
             for node in (tool_cluster.orchestrator, tool_cluster.aggregated)]
    assert calls[0] == calls[1]


def test_a_streamed_call_comes_in_pieces_and_assembles_in_the_sdk(tool_cluster: RefCluster) -> None:
    expected = the_call(whole(tool_cluster.orchestrator, logit_bias=OPEN_A_CALL))
    with tool_cluster.orchestrator.client() as client:
        chunks = list(client.chat.completions.create(**ASK, logit_bias=OPEN_A_CALL, stream=True))
        with client.chat.completions.stream(**ASK, logit_bias=OPEN_A_CALL) as events:
            final = events.get_final_completion()
    deltas = [chunk.choices[0].delta for chunk in chunks if chunk.choices]
    assert not "".join(delta.content or "" for delta in deltas)  # the tags never reach the client
    pieces = [call for delta in deltas for call in delta.tool_calls or ()]
    assert pieces[0].id and pieces[0].function and pieces[0].function.name == expected[0]
    assert "".join(piece.function.arguments or "" for piece in pieces if piece.function) == expected[1]
    assert len(pieces) > 2  # the arguments as they are generated, not one delta once the call is complete
    assert chunks[-1].choices[0].finish_reason == "tool_calls"
    (call,) = final.choices[0].message.tool_calls or []
    assert isinstance(call, openai.types.chat.ParsedFunctionToolCall)
    assert (call.function.name, call.function.arguments) == expected


def test_a_call_on_the_responses_api_is_a_function_call_item(tool_cluster: RefCluster) -> None:
    expected = the_call(whole(tool_cluster.orchestrator, logit_bias=OPEN_A_CALL))
    tools: Any = [{"type": "function", "name": name, "parameters": parameters}
                  for name, parameters in PARAMETERS.items()]
    with tool_cluster.orchestrator.client() as client:
        response = client.responses.create(model="tiny", input="Weather in Paris?", tools=tools, temperature=0,
                                           max_output_tokens=64, parallel_tool_calls=False,
                                           extra_body={"logit_bias": OPEN_A_CALL})
    assert_strict(response)
    (item,) = response.output
    assert isinstance(item, ResponseFunctionToolCall) and response.status == "completed"
    assert (item.name, item.arguments) == expected


def test_without_the_bias_the_answer_is_text(tool_cluster: RefCluster) -> None:
    (choice,) = whole(tool_cluster.orchestrator, max_tokens=8).choices
    assert choice.message.tool_calls is None and choice.message.content
    assert choice.finish_reason == "length"

"""Every deployment answers as the aggregated worker does: API x feature x wire x schedule, whole and streamed.

Each cell sends one request shape (``CASES``) to one deployment (``answer_matrix.DEPLOYMENTS``: the native wire
and TensorRT-LLM's, context first, generation first, GEN alone under ``max_local_prefill_length`` and past it,
lifecycle v0 and v1 workers, GEN sent only the prompt's length) and to the aggregated oracle, and compares what
the answers carry. A path added to the orchestrator is added to ``DEPLOYMENTS`` and diffed by construction.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import httpx
import pytest

from tests.conformance.answer_matrix import (
    DEPLOYMENTS,
    LONG_PREFIX,
    MODEL,
    PREVIOUS_CALL_ID,
    Api,
    Case,
    Deployment,
    Deployments,
    ask,
    deployments_running,
    schedule_of,
    text,
)
from tests.workers.engines.reference.cluster import RefCluster
from tests.workers.engines.reference.ledger import assert_ledger_balances

GREEDY = {"temperature": 0}
SEEDED = {"temperature": 1.0, "seed": 4242}
# The tiny model's favourite tokens are bytes that decode to no text; a bias towards the lower-case letters (token id
# 3 + byte) makes its answers readable, so that a stop string can be found in them. Each stop string below spans two
# tokens and cuts the short prompt's answer and the long one's after their first letters.
LETTERS = {str(3 + byte): 50 for byte in range(ord("a"), ord("z") + 1)}
# The first byte of "é" (token id 3 + byte), alone: a token that is only part of a character.
HALF_A_CHARACTER = {str(3 + "é".encode()[0]): 100}
# Bounded values: the grammar, not the random model, ends the object (in 20 tokens).
JSON_SCHEMA = {"type": "json_schema", "json_schema": {"name": "bounded", "strict": True, "schema": {
    "type": "object", "properties": {"ok": {"type": "boolean"}, "n": {"type": "integer", "minimum": 0, "maximum": 9}},
    "required": ["ok", "n"], "additionalProperties": False}}}


def chat(prompt: str, **options: Any) -> Any:
    return lambda long: {"messages": [{"role": "user", "content": text(prompt, long)}], "max_tokens": 4,
                         **GREEDY, **options}


def completion(prompt: str, **options: Any) -> Any:
    return lambda long: {"prompt": text(prompt, long), "max_tokens": 4, **GREEDY, **options}


def response(prompt: str, **options: Any) -> Any:
    def body(long: bool) -> dict[str, Any]:
        instructions = text(options.get("instructions", ""), long)
        return {"input": prompt, "max_output_tokens": 4, "store": False, **GREEDY, **options,
                **({"instructions": instructions} if instructions else {})}

    return body


def chain(long: bool) -> dict[str, Any]:
    instructions = {"instructions": LONG_PREFIX} if long else {}
    return {"chain": [{"input": "Hello there", "max_output_tokens": 3, **GREEDY, **instructions},
                      {"input": "And then?", "max_output_tokens": 3, **GREEDY, **instructions}]}


def function_call(long: bool) -> dict[str, Any]:
    items = [{"role": "user", "content": text("What is the weather in Paris?", long)},
             {"type": "function_call", "call_id": "call_1", "name": "get_weather",
              "arguments": '{"city": "Paris"}'},
             {"type": "function_call_output", "call_id": "call_1", "output": "12 C and sunny"}]
    return {"input": items, "max_output_tokens": 4, "store": False, **GREEDY}


def function_call_chain(long: bool) -> dict[str, Any]:
    """A follow-up whose input is a function call and its output, after the turn that asked."""
    asked, called, answered = function_call(long)["input"]
    return {"chain": [{"input": [asked], "max_output_tokens": 3, **GREEDY},
                      {"input": [called, answered], "max_output_tokens": 3, **GREEDY}]}


# One short function tool (every character of it is prompt: the long prompts must stay inside the context of 512).
HOUR = {"type": "function", "name": "hour", "parameters": {"type": "object", "properties": {"h": {"enum": [1, 2]}},
                                                            "required": ["h"], "additionalProperties": False}}


def tool_call_chain(long: bool) -> dict[str, Any]:
    """A forced call (a named function), then its output, by ``previous_response_id``; the follow-up's tools are
    echoed but left out of the prompt (``none``)."""
    output = {"type": "function_call_output", "call_id": PREVIOUS_CALL_ID, "output": "2"}
    return {"chain": [{"input": text("Which hour?", long), "tools": [HOUR], "max_output_tokens": 48,
                       "tool_choice": {"type": "function", "name": "hour"}, **GREEDY},
                      {"input": [output], "tools": [HOUR], "tool_choice": "none", "max_output_tokens": 3,
                       **GREEDY}]}


CASES = (
    Case("plain", "chat", chat("Say hello")),
    Case("max-tokens-1", "chat", chat("Say hello", max_tokens=1)),
    Case("max-tokens-1-half-a-character", "chat", chat("Say hello", max_tokens=1, logit_bias=HALF_A_CHARACTER)),
    Case("logprobs", "chat", chat("Say hello", logprobs=True, top_logprobs=3)),
    Case("n2", "chat", chat("Tell me a story", n=2, logprobs=True, **SEEDED, logit_bias=LETTERS)),
    Case("stop", "chat", chat("Say hello", max_tokens=8, stop=["yy", "vv"], logit_bias=LETTERS)),
    Case("json", "chat", chat("Give me JSON", max_tokens=32, response_format=JSON_SCHEMA)),
    Case("seed", "chat", chat("Tell me a story", **SEEDED, logit_bias=LETTERS)),
    Case("prompt-logprobs", "chat", chat("Say hello", prompt_logprobs=2)),
    Case("plain", "completions", completion("The capital of Germany is")),
    Case("max-tokens-1", "completions", completion("The capital of Germany is", max_tokens=1)),
    Case("max-tokens-1-half-a-character", "completions",
         completion("The capital of Germany is", max_tokens=1, logit_bias=HALF_A_CHARACTER)),
    Case("logprobs", "completions", completion("The capital of Germany is", logprobs=2)),
    Case("echo-logprobs-1-token", "completions",
         completion("The capital of Germany is", echo=True, logprobs=1, max_tokens=1)),
    Case("echo-logprobs-2-tokens", "completions",
         completion("The capital of Germany is", echo=True, logprobs=1, max_tokens=2)),
    Case("n2", "completions", completion("Once upon a time", n=2, logprobs=1, **SEEDED, logit_bias=LETTERS)),
    Case("stop", "completions",
         completion("The capital of Germany is", max_tokens=8, stop=["cj", "vv"], logit_bias=LETTERS)),
    Case("seed", "completions", completion("Once upon a time", **SEEDED, logit_bias=LETTERS)),
    Case("prompt-logprobs", "completions", completion("The capital of Germany is", prompt_logprobs=2)),
    Case("plain", "responses", response("Hello there")),
    Case("instructions", "responses", response("Hello there", instructions="Be brief.")),
    Case("json", "responses", response("Give me JSON", max_output_tokens=32, text={"format": {
        "type": "json_schema", "name": "bounded", "strict": True,
        "schema": JSON_SCHEMA["json_schema"]["schema"]}})),  # type: ignore[index]
    Case("previous-response-chain", "responses", chain),
    Case("function-call-items", "responses", function_call),
    Case("previous-response-chain-function-call", "responses", function_call_chain),
    Case("tool-call", "responses", response("Which hour?", tools=[HOUR], tool_choice="required",
                                            parallel_tool_calls=False, max_output_tokens=48)),
    Case("tool-call-chain", "responses", tool_call_chain),
)


def cells() -> Iterator[Any]:
    for deployment in DEPLOYMENTS:
        for case in CASES:
            for stream in (False, True):
                yield pytest.param(deployment, case, stream,
                                   id=f"{deployment.name}-{case.api}-{case.name}-{'stream' if stream else 'whole'}")


@pytest.fixture(scope="module")
def deployments(conformance_cluster: RefCluster) -> Iterator[Deployments]:
    with deployments_running(conformance_cluster) as running:
        yield running


@pytest.fixture(scope="module")
def oracle(deployments: Deployments) -> Any:
    """The aggregated worker's answer to a (case, long, stream), asked once."""
    answers: dict[tuple[Api, str, bool, bool], dict[str, Any]] = {}

    def answer(case: Case, long: bool, stream: bool) -> dict[str, Any]:
        key = (case.api, case.name, long, stream)
        if key not in answers:
            answers[key] = ask(deployments.oracle, case, long, stream, stored=False)
        return answers[key]

    return answer


@pytest.mark.parametrize(("deployment", "case", "stream"), list(cells()))
def test_the_deployment_answers_as_the_aggregated_worker(deployments: Deployments, oracle: Any,
                                                        deployment: Deployment, case: Case, stream: bool) -> None:
    expected = oracle(case, deployment.long_prompts, stream)
    observed = ask(deployments.urls[deployment.name], case, deployment.long_prompts, stream)
    assert observed == expected


@pytest.mark.parametrize("deployment", [d for d in DEPLOYMENTS if d.schedule is not None], ids=lambda d: d.name)
def test_each_deployment_runs_the_schedule_it_is_named_for(deployments: Deployments, deployment: Deployment) -> None:
    """What GEN was sent for one request: the matrix diffs the paths it says it diffs."""
    recorder = deployments.gen[deployment.workers]
    before = len(recorder.posts())
    ask(deployments.urls[deployment.name], CASES[0], deployment.long_prompts, stream=False)
    sent = [e for e in recorder.posts()[before:] if e.path == CASES[0].path]
    assert len(sent) == 1
    assert schedule_of(sent[0].request_json()) == deployment.schedule


@pytest.mark.parametrize("deployment", [d for d in DEPLOYMENTS if d.schedule is not None], ids=lambda d: d.name)
def test_a_client_that_leaves_mid_stream_leaves_nothing_parked(deployments: Deployments,
                                                               deployment: Deployment) -> None:
    """The client hangs up after the first event; CTX's hand-off ledger balances (nor did the matrix's requests
    before it leave anything parked)."""
    body = {**chat("Tell me a long story", max_tokens=200)(deployment.long_prompts), "model": MODEL, "stream": True}
    with httpx.stream("POST", deployments.urls[deployment.name] + "/v1/chat/completions", json=body,
                      timeout=60) as reply:
        assert reply.status_code == 200
        assert next(reply.iter_lines()).startswith("data: ")
    assert_ledger_balances(deployments.ctx[deployment.workers])

"""Our orchestrator and our CTX/GEN workers on ``--engine vllm`` (real vLLM, ExampleConnector): disaggregated
output equals aggregated output token for token, GEN's vLLM loads the KV instead of computing it, a client that
goes away aborts the request inside vLLM, and what vLLM cannot do is a 400.

Two vLLM instances, started together: CTX runs ``--role both``, so before the orchestrator sends it any hand-off it
is also the aggregated worker whose answers are the reference (as P is in ``test_vllm_fleet``). GEN never sees a
prompt before its hand-off, so a prompt's KV can only reach it through the connector: its external cache hits
count nothing else. (An aggregated run on a ``kv_both`` ExampleConnector worker saves the prompt's KV and keeps it
in its own prefix cache, which is why the reference is asked of CTX and not of GEN.)
"""

from __future__ import annotations

import contextlib
import json
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import httpx
import pytest

from tests.cluster import Node, sample, start_orchestrator
from tests.vllm.answers import (
    ASK,
    MAX_TOKENS,
    WHOLE_BLOCKS_PROMPT,
    Answer,
    case_variant,
    complete_ids,
    reference_answers,
    sdk_client,
)
from tests.vllm.availability import needs_vllm
from tests.vllm.feature_answers import (
    FEATURES,
    FeatureAnswer,
    ask_feature,
    feature_reference_answers,
    feature_variant,
)
from tests.vllm.processes import (
    EXTERNAL_HITS,
    METRIC_TIMEOUT_S,
    VllmProcess,
    example_connector,
    our_worker,
    vllm_processes,
)
from tests.vllm.prompts import FRANCE, MODEL, long_chat, long_prompt
from tests.waiting import eventually

pytestmark = needs_vllm

FIRST_TOKEN_DIFFERED = "disagg_vllm_first_token_differed_total"  # GEN's first tokens that were not CTX's


@dataclass
class Workers:
    ctx: VllmProcess  # --role both: the aggregated reference first, then CTX behind the orchestrator
    gen: VllmProcess


@pytest.fixture(scope="module")
def workers(tmp_path_factory: pytest.TempPathFactory, hf_checkpoint: Path) -> Iterator[Workers]:
    """Our CTX and GEN workers on --engine vllm sharing ExampleConnector's folder, started side by side."""
    connector = example_connector(tmp_path_factory.mktemp("vllm-kv"))
    logs = tmp_path_factory.mktemp("vllm-workers")
    with vllm_processes((our_worker("both", logs / "ctx.log", connector), logs / "ctx.log"),
                        (our_worker("generation", logs / "gen.log", connector), logs / "gen.log")) as (ctx, gen):
        yield Workers(ctx, gen)


@dataclass(frozen=True)
class Aggregated:
    answers: dict[tuple[str, bool], Answer]
    france: str
    errors: dict[str, httpx.Response]
    features: dict[tuple[str, bool], FeatureAnswer] = field(default_factory=dict)  # n and structured output
    whole_blocks: Answer | None = None  # WHOLE_BLOCKS_PROMPT's answer


@pytest.fixture(scope="module")
def aggregated(workers: Workers) -> Aggregated:
    """The aggregated (--role both) worker's answers, taken before the orchestrator sends it anything."""
    url = workers.ctx.url
    with sdk_client(url) as client:
        answers = reference_answers(client)
        features = feature_reference_answers(client)
        whole_blocks = complete_ids(client, WHOLE_BLOCKS_PROMPT)
        reply = client.chat.completions.create(model=MODEL, messages=FRANCE, max_tokens=16, temperature=0)
        errors = {
            "prompt_logprobs": httpx.post(url + "/v1/completions", timeout=60, json={
                "model": MODEL, "prompt": "Hi", "max_tokens": 2, "prompt_logprobs": 1}),
            "too_long": httpx.post(url + "/v1/completions", timeout=60, json={
                "model": MODEL, "prompt": "hello " * 2100, "max_tokens": 2}),
        }
    return Aggregated(answers, reply.choices[0].message.content or "", errors, features, whole_blocks)


@dataclass
class Disaggregated:
    ctx: VllmProcess
    gen: VllmProcess
    orchestrator: Node


@pytest.fixture(scope="module")
def disaggregated(workers: Workers, aggregated: Aggregated) -> Iterator[Disaggregated]:
    """The orchestrator in front of CTX and GEN; after ``aggregated``, so every reference is taken first."""
    with contextlib.ExitStack() as stack:
        orchestrator = start_orchestrator(stack, [workers.ctx.url], [workers.gen.url], request_timeout_s=600)
        yield Disaggregated(workers.ctx, workers.gen, orchestrator)


def test_aggregated_vllm_worker_answers_paris(aggregated: Aggregated) -> None:
    assert aggregated.france == "The capital of France is Paris."


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "streamed"])
@pytest.mark.parametrize("endpoint", ["chat", "completions"])
def test_disaggregated_equals_aggregated(aggregated: Aggregated, disaggregated: Disaggregated, endpoint: str,
                                         stream: bool) -> None:
    hits_before = disaggregated.gen.metric(EXTERNAL_HITS)
    differed_before = disaggregated.gen.metric(FIRST_TOKEN_DIFFERED)
    with sdk_client(disaggregated.orchestrator.url) as client:
        answer = ASK[endpoint](client, stream, case_variant(endpoint, stream))
    # GEN chose every first token CTX chose: on the CPU the two compute the tail's logits alike, bit for bit.
    assert disaggregated.gen.metric(FIRST_TOKEN_DIFFERED) == differed_before
    expected = aggregated.answers[endpoint, stream]
    assert expected.completion_tokens > 1  # the first token did not end it: the decode side had work to do
    assert answer.tokens == expected.tokens
    assert answer.text == expected.text
    assert answer.completion_tokens == expected.completion_tokens == len(expected.tokens)
    # GEN's vLLM loaded the prompt's KV through the connector (at least one 128-token block) instead of computing it.
    assert disaggregated.gen.loaded_external_kv(hits_before), disaggregated.gen.metric(EXTERNAL_HITS) - hits_before


def test_a_prompt_of_whole_kv_blocks_crosses_the_hand_off(aggregated: Aggregated,
                                                          disaggregated: Disaggregated) -> None:
    hits_before = disaggregated.gen.metric(EXTERNAL_HITS)
    with sdk_client(disaggregated.orchestrator.url) as client:
        answer = complete_ids(client, WHOLE_BLOCKS_PROMPT)
        assert answer == aggregated.whole_blocks
        assert disaggregated.gen.loaded_external_kv(hits_before), disaggregated.gen.metric(EXTERNAL_HITS) - hits_before
        # And GEN's answer said so: it computed none of the prompt's blocks itself (frontend/prompt_report.py).
        assert sample(disaggregated.orchestrator.metrics, "disagg_gen_prompt_tokens_recomputed_total", pool="gen",
                      worker=disaggregated.gen.url) == 0
        # GEN's engine core lives on: the next request is served too.
        assert complete_ids(client, [*WHOLE_BLOCKS_PROMPT[:-1], 42]).completion_tokens > 1


def test_disaggregated_france(disaggregated: Disaggregated) -> None:
    with sdk_client(disaggregated.orchestrator.url) as client:
        reply = client.chat.completions.create(model=MODEL, messages=FRANCE, max_tokens=16, temperature=0)
    assert reply.choices[0].message.content == "The capital of France is Paris."


def test_client_disconnect_aborts_in_vllm(disaggregated: Disaggregated) -> None:
    body = {"model": MODEL, "prompt": long_prompt("disconnect"), "max_tokens": 1500, "ignore_eos": True, "stream": True}
    gen = disaggregated.gen
    generated_before = gen.metric("vllm:generation_tokens_total")
    with httpx.Client(timeout=600) as http, \
            http.stream("POST", disaggregated.orchestrator.url + "/v1/completions", json=body) as reply:
        assert reply.status_code == 200
        chunks = reply.iter_bytes()
        while b"data: {" not in next(chunks):
            pass
        # GEN's vLLM is decoding this request now (its gauge follows the engine core's next step).
        assert eventually(lambda: gen.metric("vllm:num_requests_running") == 1, timeout_s=METRIC_TIMEOUT_S,
                          every_s=0.2)
    # The client is gone: the orchestrator drops GEN's stream, the worker aborts the request in vLLM.
    assert eventually(lambda: gen.metric("vllm:num_requests_running") == 0, timeout_s=METRIC_TIMEOUT_S, every_s=0.2)
    generated = gen.metric("vllm:generation_tokens_total") - generated_before
    assert generated < 1499  # stopped by the abort, not by running out of tokens


def test_what_vllm_cannot_do_is_a_400(aggregated: Aggregated) -> None:
    for name, reply in aggregated.errors.items():
        assert reply.status_code == 400, (name, reply.text)
        assert reply.json()["error"]["type"] == "invalid_request_error"
    assert aggregated.errors["prompt_logprobs"].json()["error"]["param"] == "prompt_logprobs"


# -- n and structured output: vLLM's n and guidance backend, GEN choosing the first tokens again (feature_answers) --
@pytest.mark.parametrize("stream", [False, True], ids=["whole", "streamed"])
@pytest.mark.parametrize("name", list(FEATURES))
def test_disaggregated_n_and_structured_output_equal_aggregated(aggregated: Aggregated, disaggregated: Disaggregated,
                                                                name: str, stream: bool) -> None:
    hits_before = disaggregated.gen.metric(EXTERNAL_HITS)
    differed_before = disaggregated.gen.metric(FIRST_TOKEN_DIFFERED)
    with sdk_client(disaggregated.orchestrator.url) as client:
        answer = ask_feature(client, name, stream, feature_variant(name, stream))
    assert disaggregated.gen.metric(FIRST_TOKEN_DIFFERED) == differed_before  # on the CPU, bit for bit
    expected = aggregated.features[name, stream]
    assert len(expected.choices) == FEATURES[name].get("n", 1)
    assert all(len(choice.tokens) > 1 for choice in expected.choices)  # GEN had work to do for every sequence
    assert answer == expected
    if name == "n2_greedy":
        assert expected.choices[0] == expected.choices[1]
    if name == "json_schema":
        person = json.loads(expected.choices[0].text)
        assert list(person) == ["name", "age"]  # PERSON's properties, in its order
        assert isinstance(person["name"], str) and isinstance(person["age"], int)
    assert disaggregated.gen.loaded_external_kv(hits_before), disaggregated.gen.metric(EXTERNAL_HITS) - hits_before


def test_disaggregated_unseeded_n_continues_the_draws_ctx_made(disaggregated: Disaggregated) -> None:
    # No seed: CTX draws one and hands it on, so GEN, choosing each first token again, chooses CTX's: on the CPU
    # bit for bit, so GEN's count of first tokens it chose otherwise stays where it was.
    differed_before = disaggregated.gen.metric(FIRST_TOKEN_DIFFERED)
    with sdk_client(disaggregated.orchestrator.url) as client:
        reply = client.chat.completions.create(model=MODEL, messages=long_chat("unseeded n"), n=3, temperature=1.0,
                                               max_tokens=8)
    assert sorted(choice.index for choice in reply.choices) == [0, 1, 2]
    assert reply.usage is not None and reply.usage.completion_tokens > 3
    assert disaggregated.gen.metric(FIRST_TOKEN_DIFFERED) == differed_before


def test_gen_continues_from_its_own_first_token_where_ctx_chose_another(workers: Workers) -> None:
    """On GPUs GEN's vLLM may choose another first token than CTX's did (logits differing in the last bits across
    batch shapes flip a near-tie or a seeded draw); as in vLLM's own P/D the decode side's choice is the answer's.
    On the CPU the two always agree, so here the hand-off's first token is altered, as TensorRT-LLM's orchestrator
    would relay it, to make them differ: GEN answers (no engine_request_failed), from its own first token, and
    counts it."""
    body = {"model": MODEL, "prompt": long_prompt("gen chooses again"), "max_tokens": MAX_TOKENS, "temperature": 0,
            "logprobs": 0, "ignore_eos": True}
    with httpx.Client(timeout=600) as http:
        reference = http.post(workers.ctx.url + "/v1/completions", json=body)  # aggregated (--role both)
        assert reference.status_code == 200, reference.text
        ctx = http.post(workers.ctx.url + "/v1/completions", json={**body, "disaggregated_params": {
            "request_type": "context_only", "disagg_request_id": 26, "schedule_style": 0}})
        assert ctx.status_code == 200, ctx.text
        params = ctx.json()["choices"][0]["disaggregated_params"]
        (first,) = params["first_gen_tokens"]
        differed_before = workers.gen.metric(FIRST_TOKEN_DIFFERED)
        gen = http.post(workers.gen.url + "/v1/completions", json={
            **body, "prompt": ctx.json()["prompt_token_ids"],
            "disaggregated_params": {**params, "request_type": "generation_only", "first_gen_tokens": [first ^ 1]}})
    assert gen.status_code == 200, gen.text
    expected, answer = reference.json()["choices"][0], gen.json()["choices"][0]
    assert answer["logprobs"]["tokens"] == expected["logprobs"]["tokens"]  # GEN's first token, then its own decode
    assert answer["text"] == expected["text"]
    assert gen.json()["usage"]["completion_tokens"] == MAX_TOKENS
    assert workers.gen.metric(FIRST_TOKEN_DIFFERED) == differed_before + 1

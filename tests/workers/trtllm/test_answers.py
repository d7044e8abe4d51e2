"""Direction B: TensorRT-LLM's orchestrator in front of our workers, on the reference engine (tiny model).

The test plays TensorRT-LLM's v0 context-first orchestrator (``tests.trtllm_wire``): it writes both legs as that
orchestrator does, sends them over real HTTP to our real CTX and GEN workers, and reads every whole answer with
TensorRT-LLM's strict models, so a field TensorRT-LLM would refuse fails here. The disaggregated output must equal
what the aggregated worker answers to the plain request.
"""

from __future__ import annotations

import random
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import replace
from typing import Any

import httpx
import msgspec
import orjson
import pytest

from tests.servers import open_post
from tests.trtllm_wire import (
    ChatCompletionResponse,
    needs_generation,
    response_model,
    trtllm_context_body,
    trtllm_generation_body,
)
from tests.waiting import eventually
from tests.workers.engines.reference.cluster import RefCluster, reference_cluster
from tests.workers.engines.reference.tiny_model import write_tiny_model
from workers.engines.reference.options import ReferenceOptions

CHAT, COMPLETIONS = "/v1/chat/completions", "/v1/completions"
MESSAGES = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "What is the capital of France?"}]


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RefCluster]:
    path = str(write_tiny_model(tmp_path_factory.mktemp("tiny") / "tiny.gguf", seed=0))
    with reference_cluster(ReferenceOptions(model_path=path, served_model_name="tiny", blas_threads=1)) as running:
        yield running


def client_body(path: str, model: str, **extra: Any) -> dict[str, Any]:
    prompt = {"messages": MESSAGES} if path == CHAT else {"prompt": "The capital of France is"}
    return {"model": model, **prompt, "max_tokens": 8, "temperature": 0, "ignore_eos": True, **extra}


def post(url: str, body: dict[str, Any], *, msgpack: bool = False) -> httpx.Response:
    if msgpack:  # as TensorRT-LLM sends it with TRTLLM_SERVE_ENABLE_MSGSPEC=1
        return httpx.post(url, content=msgspec.msgpack.encode(body), timeout=60,
                          headers={"Content-Type": "application/json", "X-TRTLLM-Msgpack": "1"})
    return httpx.post(url, json=body, timeout=60)


def streamed_text(reply: httpx.Response, path: str) -> str:
    text = []
    for line in reply.text.splitlines():
        if line.startswith("data: ") and line != "data: [DONE]":
            for choice in orjson.loads(line[6:])["choices"]:
                text.append((choice.get("delta") or {}).get("content") or "" if path == CHAT else choice["text"])
    return "".join(text)


def aggregated_text(cluster: RefCluster, path: str, body: dict[str, Any]) -> str:
    reply = post(cluster.aggregated.url + path, body)
    assert reply.status_code == 200, reply.text
    choice = reply.json()["choices"][0]
    return str(choice["message"]["content"] if path == CHAT else choice["text"])


@pytest.mark.parametrize("path", [CHAT, COMPLETIONS], ids=["chat", "completions"])
@pytest.mark.parametrize("stream", [False, True], ids=["whole", "stream"])
@pytest.mark.parametrize("tokids_ctxbytes", [False, True], ids=["token-list", "ctxbytes"])
def test_trtllm_orchestrator_legs_against_our_workers(cluster: RefCluster, path: str, stream: bool,
                                                     tokids_ctxbytes: bool) -> None:
    body = client_body(path, cluster.model, stream=stream)
    disagg_request_id = random.getrandbits(63)

    ctx_reply = post(cluster.ctx.url + path, trtllm_context_body(path, body, disagg_request_id, tokids_ctxbytes))
    assert ctx_reply.status_code == 200, ctx_reply.text
    ctx = response_model(path).model_validate(ctx_reply.json())  # strict: TensorRT-LLM's field set only
    assert needs_generation(ctx)
    params = ctx.choices[0].disaggregated_params
    assert params is not None and isinstance(params.ctx_request_id, int) and params.encoded_opaque_state
    assert params.disagg_request_id == disagg_request_id and params.first_gen_tokens
    if tokids_ctxbytes and isinstance(ctx, ChatCompletionResponse):
        assert ctx.prompt_token_ids_b64 and ctx.prompt_token_ids is None
    else:  # TensorRT-LLM's list path (and its only path for completions)
        assert ctx.prompt_token_ids and ctx.usage.prompt_tokens == len(ctx.prompt_token_ids)

    gen_body = trtllm_generation_body(path, body, ctx, disagg_request_id)
    assert ("messages" in gen_body) is (path == CHAT)
    gen_reply = post(cluster.gen.url + path, gen_body)
    assert gen_reply.status_code == 200, gen_reply.text
    if stream:  # TensorRT-LLM relays GEN's stream line by line
        text = streamed_text(gen_reply, path)
    else:
        gen = response_model(path).model_validate(gen_reply.json())
        assert gen.usage.completion_tokens == 8
        choice = gen.choices[0]
        text = str(choice.message.content if isinstance(gen, ChatCompletionResponse) else choice.text)  # type: ignore[union-attr]
    assert text == aggregated_text(cluster, path, client_body(path, cluster.model))


def test_msgpack_bodies_with_the_header_are_served(cluster: RefCluster) -> None:
    body = client_body(CHAT, cluster.model)
    ctx_reply = post(cluster.ctx.url + CHAT, trtllm_context_body(CHAT, body, 11, True), msgpack=True)
    assert ctx_reply.status_code == 200, ctx_reply.text
    ctx = ChatCompletionResponse.model_validate(ctx_reply.json())
    gen_reply = post(cluster.gen.url + CHAT, trtllm_generation_body(CHAT, body, ctx, 11, strip_message_history=True),
                     msgpack=True)
    assert gen_reply.status_code == 200, gen_reply.text
    gen = ChatCompletionResponse.model_validate(gen_reply.json())
    assert gen.choices[0].message.content == aggregated_text(cluster, CHAT, body)


def test_a_bad_msgpack_body_is_a_clear_400(cluster: RefCluster) -> None:
    reply = httpx.post(cluster.ctx.url + CHAT, content=b"\xc1not msgpack", timeout=30,
                       headers={"Content-Type": "application/json", "X-TRTLLM-Msgpack": "1"})
    assert reply.status_code == 400
    assert "msgpack" in reply.json()["error"]["message"]


@pytest.mark.parametrize("path", [CHAT, COMPLETIONS], ids=["chat", "completions"])
def test_context_and_generation_is_served_aggregated(cluster: RefCluster, path: str) -> None:
    body = client_body(path, cluster.model)
    reply = post(cluster.aggregated.url + path,
                 {**body, "disaggregated_params": {"request_type": "context_and_generation", "schedule_style": 0}})
    assert reply.status_code == 200, reply.text
    answer = response_model(path).model_validate(reply.json())
    choice = answer.choices[0]
    text = choice.message.content if isinstance(answer, ChatCompletionResponse) else choice.text  # type: ignore[union-attr]
    assert text == aggregated_text(cluster, path, body)


def test_every_trtllm_field_is_accepted(cluster: RefCluster) -> None:
    body = client_body(CHAT, cluster.model)
    params = {"request_type": "context_only", "disagg_request_id": 3, "schedule_style": 0, "conversation_id": "c-1",
              "draft_tokens": [], "ctx_dp_rank": 0, "ctx_info_endpoint": "host:1", "first_gen_logits": None,
              "ctx_usage": {"prompt_tokens": 1, "total_tokens": 1, "completion_tokens": 0},
              "return_prompt_token_ids_b64": False, "resolved_thinking": None}
    reply = post(cluster.ctx.url + CHAT, {**body, "disaggregated_params": params})
    assert reply.status_code == 200, reply.text
    ChatCompletionResponse.model_validate(reply.json())


@pytest.mark.parametrize("path", [CHAT, COMPLETIONS], ids=["chat", "completions"])
def test_generation_first_gen_sent_before_ctx(cluster: RefCluster, path: str) -> None:
    """TensorRT-LLM's v0 generation first: GEN gets its request first, with CTX's ``ctx_info_endpoint`` from
    CTX's /server_info; it waits for CTX's hand-off, which comes once the CTX request (sent after) has prefilled."""
    body = client_body(path, cluster.model)
    info = httpx.get(cluster.ctx.url + "/server_info", timeout=30).json()["disaggregated_params"]
    disagg_request_id = random.getrandbits(63)
    gen_body = {**body, "disaggregated_params": {
        "request_type": "generation_only", "ctx_request_id": disagg_request_id, "disagg_request_id": disagg_request_id,
        "schedule_style": 1, "ctx_info_endpoint": info["ctx_info_endpoint"][0], "ctx_dp_rank": info["ctx_dp_rank"]}}
    board = cluster.ctx.app.state.service.board
    with ThreadPoolExecutor(1) as pool:
        gen_reply = pool.submit(post, cluster.gen.url + path, gen_body)
        assert eventually(lambda: board.waiting(disagg_request_id) or gen_reply.done())  # GEN is there first
        assert not gen_reply.done(), gen_reply.result().text
        ctx_body = trtllm_context_body(path, body, disagg_request_id, True)
        ctx_body["disaggregated_params"]["schedule_style"] = 1
        ctx_reply = post(cluster.ctx.url + path, ctx_body)
        assert ctx_reply.status_code == 200, ctx_reply.text
        assert needs_generation(response_model(path).model_validate(ctx_reply.json()))
        reply = gen_reply.result()
    assert reply.status_code == 200, reply.text
    answer = response_model(path).model_validate(reply.json())
    choice = answer.choices[0]
    text = choice.message.content if isinstance(answer, ChatCompletionResponse) else choice.text  # type: ignore[union-attr]
    assert text == aggregated_text(cluster, path, body)


def test_a_generation_first_gen_whose_client_hangs_up_while_waiting_frees_its_slot(cluster: RefCluster) -> None:
    """The orchestrator drops a generation-first GEN request while it waits for CTX's hand-off: GEN stops waiting
    at once (not after generation_first_wait_s, made far longer than the wait here), frees its admission slot and
    hangs up on CTX, whose long poll stops too; the hand-off CTX parks later is claimed by nobody."""
    body = client_body(CHAT, cluster.model)
    service = cluster.gen.app.state.service
    board = cluster.ctx.app.state.service.board
    disagg_request_id = random.getrandbits(63)
    gen_body = {**body, "disaggregated_params": {
        "request_type": "generation_only", "ctx_request_id": disagg_request_id, "disagg_request_id": disagg_request_id,
        "schedule_style": 1, "ctx_info_endpoint": cluster.ctx.url}}
    lifecycle = service.settings.lifecycle
    service.settings = replace(service.settings, lifecycle=replace(lifecycle, generation_first_wait_s=300.0))
    try:
        with open_post(cluster.gen.url, CHAT, orjson.dumps(gen_body)):
            assert eventually(lambda: board.waiting(disagg_request_id))  # GEN holds its slot and asks CTX
            assert service.inflight == 1
        assert eventually(lambda: service.inflight == 0 and not board.waiting(disagg_request_id))
    finally:
        service.settings = replace(service.settings, lifecycle=lifecycle)


def test_generation_first_without_a_ctx_answer_is_a_clear_error(cluster: RefCluster) -> None:
    body = client_body(CHAT, cluster.model)
    service = cluster.gen.app.state.service
    service.settings = replace(service.settings, lifecycle=replace(service.settings.lifecycle,
                                                                   generation_first_wait_s=0.0))
    try:
        reply = post(cluster.gen.url + CHAT, {**body, "disaggregated_params": {
            "request_type": "generation_only", "disagg_request_id": 5, "schedule_style": 1,
            "ctx_info_endpoint": cluster.ctx.url}})
    finally:
        service.settings = replace(service.settings, lifecycle=replace(service.settings.lifecycle,
                                                                       generation_first_wait_s=30.0))
    assert reply.status_code == 400, reply.text
    assert "no hand-off for disagg_request_id 5" in reply.json()["error"]["message"]


@pytest.mark.parametrize("path", [CHAT, COMPLETIONS], ids=["chat", "completions"])
@pytest.mark.parametrize("stream", [False, True], ids=["whole", "stream"])
def test_a_request_ctx_finished_by_length_is_answered_by_gen_from_the_first_token(
        cluster: RefCluster, path: str, stream: bool) -> None:
    """TensorRT-LLM calls GEN on a CTX "length" even when the first token used up max_tokens (the KV is freed)."""
    body = client_body(path, cluster.model, max_tokens=1, stream=stream)
    ctx_reply = post(cluster.ctx.url + path, trtllm_context_body(path, body, 21, True))
    ctx = response_model(path).model_validate(ctx_reply.json())
    assert ctx.choices[0].finish_reason == "length" and needs_generation(ctx)
    params = ctx.choices[0].disaggregated_params
    assert params is not None and params.encoded_opaque_state is None
    gen_reply = post(cluster.gen.url + path, trtllm_generation_body(path, body, ctx, 21))
    assert gen_reply.status_code == 200, gen_reply.text
    expected = aggregated_text(cluster, path, client_body(path, cluster.model, max_tokens=1))
    if stream:
        assert streamed_text(gen_reply, path) == expected
    else:
        gen = response_model(path).model_validate(gen_reply.json())
        choice = gen.choices[0]
        assert choice.finish_reason == "length" and gen.usage.completion_tokens == 1
        assert (choice.message.content if isinstance(gen, ChatCompletionResponse) else choice.text) == expected  # type: ignore[union-attr]


@pytest.mark.parametrize("path", [CHAT, COMPLETIONS], ids=["chat", "completions"])
def test_a_generation_request_without_state_and_with_budget_left_is_refused(cluster: RefCluster, path: str) -> None:
    """First tokens without a hand-off state finish a request only when they used up max_tokens (see above)."""
    body = client_body(path, cluster.model, max_tokens=4)
    ctx = response_model(path).model_validate(post(cluster.ctx.url + path,
                                                   trtllm_context_body(path, body, 22, True)).json())
    gen_body = trtllm_generation_body(path, body, ctx, 22)
    gen_body["disaggregated_params"]["encoded_opaque_state"] = None
    reply = post(cluster.gen.url + path, gen_body)
    assert reply.status_code == 400, reply.text
    error = reply.json()["error"]
    assert error["param"] == "disaggregated_params.encoded_opaque_state" and error["code"] == "invalid_handoff"
    assert post(cluster.gen.url + path, trtllm_generation_body(path, body, ctx, 22)).status_code == 200


def test_the_first_token_logprob_travels_in_first_gen_log_probs(cluster: RefCluster) -> None:
    body = client_body(CHAT, cluster.model, logprobs=True, top_logprobs=2)
    ctx = ChatCompletionResponse.model_validate(post(cluster.ctx.url + CHAT,
                                                     trtllm_context_body(CHAT, body, 31, True)).json())
    params = ctx.choices[0].disaggregated_params
    assert params is not None and params.first_gen_log_probs is not None and len(params.first_gen_log_probs) == 1
    gen_reply = post(cluster.gen.url + CHAT, trtllm_generation_body(CHAT, body, ctx, 31))
    gen = ChatCompletionResponse.model_validate(gen_reply.json())
    aggregated = post(cluster.aggregated.url + CHAT, body).json()["choices"][0]["logprobs"]["content"]
    assert gen.choices[0].logprobs is not None
    assert gen.choices[0].logprobs["content"] == aggregated  # the first token's logprob included


def test_ctx_request_ids_come_from_a_secure_generator(monkeypatch: pytest.MonkeyPatch) -> None:
    """A CTX request's id is its hand-off's ctx_request_id: not from Python's Mersenne Twister (issue 44)."""
    import random

    from frontend.disaggregated_params import DisaggregatedParams
    from workers.trtllm.answers import new_request_id

    def predictable(_bits: int) -> int:
        raise AssertionError("random.getrandbits used for an id")

    monkeypatch.setattr(random, "getrandbits", predictable)
    assert int(new_request_id(DisaggregatedParams(request_type="context_only"))) < 2**63


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "stream"])
def test_echo_with_logprobs_that_ctx_finishes_is_refused_not_answered_with_null_scores(
        cluster: RefCluster, stream: bool) -> None:
    """The shape evaluation harnesses score a prompt with (echo, logprobs, max_tokens 1): CTX's first token ends the
    request and TensorRT-LLM's orchestrator calls GEN anyway, whose hand-off has no field for the prompt's scores.
    Answered from the first token alone, every prompt token's logprob read null; now GEN refuses, naming echo."""
    body = client_body(COMPLETIONS, cluster.model, max_tokens=1, echo=True, logprobs=1, stream=stream)
    ctx = response_model(COMPLETIONS).model_validate(
        post(cluster.ctx.url + COMPLETIONS, trtllm_context_body(COMPLETIONS, body, 41, False)).json())
    assert ctx.choices[0].finish_reason == "length" and needs_generation(ctx)
    reply = post(cluster.gen.url + COMPLETIONS, trtllm_generation_body(COMPLETIONS, body, ctx, 41))
    assert reply.status_code == 400, reply.text
    error = reply.json()["error"]
    assert error["param"] == "echo" and "native wire" in error["message"]


def test_ctxs_answer_from_its_first_token_carries_the_prompts_logprobs_on_our_wire(cluster: RefCluster) -> None:
    """On our own wire the orchestrator answers from CTX's body when CTX finished: it holds the echoed prompt's real
    scores, as the aggregated worker's answer does."""
    body = client_body(COMPLETIONS, cluster.model, max_tokens=1, echo=True, logprobs=1)
    reply = post(cluster.ctx.url + COMPLETIONS, {**body, "disaggregated_params": {
        "request_type": "context_only", "native_extensions": True}})
    assert reply.status_code == 200, reply.text
    choice = reply.json()["choices"][0]
    aggregated = post(cluster.aggregated.url + COMPLETIONS, body).json()["choices"][0]
    scores = choice["logprobs"]["token_logprobs"]
    assert scores[0] is None and None not in scores[1:]
    assert choice["finish_reason"] == "length" and choice["logprobs"] == aggregated["logprobs"]


@pytest.mark.parametrize("path", [CHAT, COMPLETIONS], ids=["chat", "completions"])
def test_prompt_logprobs_are_never_dropped_silently_from_a_whole_answer_in_tensorrt_llms_shape(
        cluster: RefCluster, path: str) -> None:
    """TensorRT-LLM's whole answers have no prompt_logprobs field; a GEN whole answer asked for them by a caller
    that is not one of ours is refused (it dropped them before), while a stream keeps them."""
    body = client_body(path, cluster.model, max_tokens=2)
    ctx_reply = post(cluster.ctx.url + path, {**trtllm_context_body(path, body, 42, False), "prompt_logprobs": 1})
    assert "prompt_logprobs" not in orjson.dumps(ctx_reply.json()).decode()  # GEN answers the client
    ctx = response_model(path).model_validate(ctx_reply.json())
    gen_body = {**trtllm_generation_body(path, body, ctx, 42), "prompt_logprobs": 1}
    reply = post(cluster.gen.url + path, gen_body)
    assert reply.status_code == 400, reply.text
    assert reply.json()["error"]["param"] == "prompt_logprobs"
    streamed = post(cluster.gen.url + path, {**gen_body, "stream": True})
    assert streamed.status_code == 200 and '"prompt_logprobs":[null,' in streamed.text


async def test_a_first_token_that_is_part_of_a_character_is_held_back_as_the_engine_holds_it() -> None:
    """GEN's answer from CTX's first token alone reads it as the engine's own answer does: a token that is only part
    of a UTF-8 character adds no text (it read U+FFFD before)."""
    from frontend.disaggregated_params import DisaggregatedParams
    from workers.engines.byte_tokenizer import ByteTokenizer
    from workers.trtllm.answers import first_tokens_only

    half = DisaggregatedParams(request_type="generation_only", first_gen_tokens=[0xC3])
    [step] = [step async for step in first_tokens_only(half, ByteTokenizer(512), 512)]
    assert step.text == "" and step.token_ids == (0xC3,) and step.finish_reason == "length"

"""The worker's request logic, exercised over real HTTP: CTX and GEN called directly, without the orchestrator."""

from __future__ import annotations

from typing import Any

import httpx
import numpy as np
import orjson
import pybase64
import pytest

from frontend.token_codec import decode_prompt_tokens, encode_prompt_tokens
from tests.cluster import MODEL, Cluster, Node, sample
from tests.trtllm_wire import response_model, trtllm_context_body, trtllm_generation_body
from workers.engines.byte_tokenizer import ByteTokenizer
from workers.engines.request import Phase, PromptPath
from workers.engines.synthetic import SYNTHETIC_TEXT

TOKENIZER = ByteTokenizer(50_000)
MESSAGES = [{"role": "user", "content": "Tell me a story."}]
CHAT_PATH = "/v1/chat/completions"


def synthetic_text(n: int, start: int = 0) -> str:
    return bytes(SYNTHETIC_TEXT[i % len(SYNTHETIC_TEXT)] for i in range(start, start + n)).decode()


def post(node: Node, path: str, body: dict[str, Any]) -> httpx.Response:
    return httpx.post(node.url + path, json=body, timeout=30)


def context_step(cluster: Cluster, body: dict[str, Any], path: str = CHAT_PATH) -> dict[str, Any]:
    reply = post(cluster.ctx, path, {**body, "disaggregated_params": {
        "request_type": "context_only", "disagg_request_id": 7, "return_prompt_token_ids_b64": True,
        "native_extensions": True}})
    assert reply.status_code == 200, reply.text
    answer: dict[str, Any] = reply.json()
    return answer


def params_of(answer: dict[str, Any]) -> dict[str, Any]:
    params: dict[str, Any] = (answer["choices"][0] if "choices" in answer else answer)["disaggregated_params"]
    return params


def generation_body(body: dict[str, Any], ctx_answer: dict[str, Any], **extra: Any) -> dict[str, Any]:
    return {**body, "disaggregated_params": {**params_of(ctx_answer), "request_type": "generation_only"},
            "prompt_token_ids_b64": ctx_answer["prompt_token_ids_b64"], **extra}


def test_ctx_answers_the_first_token_the_handoff_and_the_prompt(cluster: Cluster) -> None:
    answer = context_step(cluster, {"model": MODEL, "messages": MESSAGES, "max_tokens": 10})
    params = params_of(answer)
    prompt = TOKENIZER.encode(TOKENIZER.render_chat(MESSAGES))
    assert params["request_type"] == "context_only"
    assert params["disagg_request_id"] == 7
    assert params["first_gen_tokens"] == [SYNTHETIC_TEXT[0]]
    assert params["prompt_len"] == prompt.size
    assert isinstance(params["ctx_request_id"], str)
    assert pybase64.b64decode(params["encoded_opaque_state"], validate=True)
    assert answer["prompt_token_ids"] is None
    np.testing.assert_array_equal(decode_prompt_tokens(answer["prompt_token_ids_b64"], vocab_size=50_000), prompt)
    assert answer["choices"][0]["message"]["content"] == "T"
    assert answer["choices"][0]["finish_reason"] is None
    assert answer["usage"] == {"prompt_tokens": prompt.size, "completion_tokens": 1,
                               "total_tokens": prompt.size + 1, "prompt_tokens_details": {"cached_tokens": 0}}


def test_ctx_without_return_b64_sends_no_prompt(cluster: Cluster) -> None:
    reply = post(cluster.ctx, CHAT_PATH, {"model": MODEL, "messages": MESSAGES, "max_tokens": 3,
                                          "disaggregated_params": {"request_type": "context_only"}})
    assert reply.status_code == 200
    assert "prompt_token_ids_b64" not in reply.json()


@pytest.mark.parametrize("body", [
    {"model": MODEL, "messages": MESSAGES, "max_tokens": 1},
    {"model": MODEL, "messages": MESSAGES, "max_tokens": 10, "stop": "T"},
], ids=["max_tokens-1", "stop-string"])
def test_ctx_that_finishes_sends_no_handoff_and_holds_nothing(cluster: Cluster, body: dict[str, Any]) -> None:
    answer = context_step(cluster, body)
    params = params_of(answer)
    assert params["encoded_opaque_state"] is None
    assert answer["choices"][0]["finish_reason"] in ("length", "stop")
    assert cluster.ctx.engine is not None
    assert cluster.ctx.engine._running == set()  # nothing left parked in the engine


@pytest.mark.parametrize("path", [CHAT_PATH, "/v1/completions", "/v1/responses"])
def test_gen_continues_from_ctx_and_matches_aggregated(cluster: Cluster, path: str) -> None:
    body: dict[str, Any] = {"model": MODEL, "max_tokens": 50}
    if path == CHAT_PATH:
        body["messages"] = MESSAGES
    elif path == "/v1/completions":
        body["prompt"] = "Once"
    else:
        body = {"model": MODEL, "input": "Once", "max_output_tokens": 50}
    ctx_answer = context_step(cluster, body, path)
    assert cluster.gen.engine is not None
    before = len(cluster.gen.engine.requests)
    gen = post(cluster.gen, path, generation_body(body, ctx_answer))
    aggregated = post(cluster.aggregated, path, body)
    assert gen.status_code == aggregated.status_code == 200
    strip = {"id", "created", "created_at"}

    def comparable(answer: dict[str, Any]) -> Any:
        if "output" in answer:
            answer["output"][0].pop("id")
        return {k: v for k, v in answer.items() if k not in strip}

    assert comparable(gen.json()) == comparable(aggregated.json())
    (request,) = cluster.gen.engine.requests[before:]
    assert request.phase is Phase.GENERATION_ONLY
    assert request.prompt_path is PromptPath.ARRAY
    assert request.prompt_list_built is False


def test_gen_streams_from_the_handoff(cluster: Cluster) -> None:
    body = {"model": MODEL, "prompt": "x", "max_tokens": 8, "stream": True}
    ctx_answer = context_step(cluster, {**body, "stream": False}, "/v1/completions")
    raw = post(cluster.gen, "/v1/completions", generation_body(body, ctx_answer)).content
    frames = raw.split(b"\n\n")
    assert frames[-2:] == [b"data: [DONE]", b""]
    text = "".join(orjson.loads(f[6:])["choices"][0]["text"] for f in frames[:-2])
    assert text == synthetic_text(8)


# -- GEN's own checks ----------------------------------------------------------------------------------------
def gen_error(cluster: Cluster, body: dict[str, Any], path: str = CHAT_PATH) -> dict[str, Any]:
    reply = post(cluster.gen, path, body)
    assert reply.status_code == 400, reply.text
    error: dict[str, Any] = reply.json()["error"]
    return error


BASE = {"model": MODEL, "messages": MESSAGES, "max_tokens": 5}


def test_gen_refuses_a_b64_prompt_whose_length_is_not_prompt_len(cluster: Cluster) -> None:
    ctx_answer = context_step(cluster, BASE)
    body = generation_body(BASE, ctx_answer, prompt_token_ids_b64=encode_prompt_tokens([1, 2, 3]))
    assert gen_error(cluster, body)["param"] == "prompt_len"


@pytest.mark.parametrize("bad", ["characters", "id-outside-vocab", "negative-id"])
def test_gen_refuses_bad_tokens(cluster: Cluster, bad: str) -> None:
    ctx_answer = context_step(cluster, BASE)
    ids = decode_prompt_tokens(ctx_answer["prompt_token_ids_b64"], vocab_size=50_000).copy()
    ids[-1] = 50_000 if bad == "id-outside-vocab" else -1
    encoded = "*" * 8 if bad == "characters" else encode_prompt_tokens(ids)
    error = gen_error(cluster, generation_body(BASE, ctx_answer, prompt_token_ids_b64=encoded))
    assert error["param"] == "prompt_token_ids_b64"
    assert error["code"] == "invalid_prompt_tokens"


@pytest.mark.parametrize(
    ("params", "param"),
    [
        ({"first_gen_tokens": None}, "disaggregated_params.first_gen_tokens"),
        ({"first_gen_tokens": [50_000]}, "disaggregated_params.first_gen_tokens"),
        ({"encoded_opaque_state": None}, "disaggregated_params.encoded_opaque_state"),
        ({"encoded_opaque_state": "not base64!"}, "disaggregated_params.encoded_opaque_state"),
        ({"encoded_opaque_state": pybase64.b64encode(b"junk").decode()}, "disaggregated_params"),
    ],
)
def test_gen_refuses_a_bad_handoff(cluster: Cluster, params: dict[str, Any], param: str) -> None:
    body = generation_body(BASE, context_step(cluster, BASE))
    body["disaggregated_params"].update(params)
    error = gen_error(cluster, body)
    assert error["param"] == param
    assert error["code"] == "invalid_handoff"


def trtllm_generation_step(cluster: Cluster, path: str, body: dict[str, Any]) -> dict[str, Any]:
    """GEN's body as TensorRT-LLM's orchestrator writes it after a real CTX call, with the hand-off state gone."""
    reply = post(cluster.ctx, path, trtllm_context_body(path, {**body, "stream": False}, 11, True))
    assert reply.status_code == 200, reply.text
    gen_body = trtllm_generation_body(path, body, response_model(path).model_validate(reply.json()), 11)
    gen_body["disaggregated_params"]["encoded_opaque_state"] = None
    return gen_body


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "stream"])
@pytest.mark.parametrize("path", [CHAT_PATH, "/v1/completions"])
def test_gen_refuses_a_trtllm_handoff_without_state_while_max_tokens_are_left(
    cluster: Cluster, path: str, stream: bool
) -> None:
    # One first token of a 4-token budget: answering it as "length" would cut the output short without a word.
    body: dict[str, Any] = {"model": MODEL, "max_tokens": 4, "stream": stream,
                            **({"messages": MESSAGES} if path == CHAT_PATH else {"prompt": "abc"})}
    error = gen_error(cluster, trtllm_generation_step(cluster, path, body), path)
    assert set(error) == {"message", "type", "param", "code"}
    assert error["type"] == "invalid_request_error"
    assert error["param"] == "disaggregated_params.encoded_opaque_state"
    assert error["code"] == "invalid_handoff"


def test_gen_answers_a_trtllm_request_whose_first_token_used_up_max_tokens(cluster: Cluster) -> None:
    body: dict[str, Any] = {"model": MODEL, "max_tokens": 1, "messages": MESSAGES}
    reply = post(cluster.gen, CHAT_PATH, trtllm_generation_step(cluster, CHAT_PATH, body))
    assert reply.status_code == 200, reply.text
    choice = reply.json()["choices"][0]
    assert choice["message"]["content"] == synthetic_text(1) and choice["finish_reason"] == "length"


def test_gen_takes_a_length_only_prompt_when_nothing_reads_token_values(cluster: Cluster) -> None:
    ctx_answer = context_step(cluster, BASE)
    body = generation_body(BASE, ctx_answer)
    del body["prompt_token_ids_b64"]
    before = sample(cluster.gen.metrics, "disagg_gen_prompt_path_total", path="metadata_only")
    reply = post(cluster.gen, CHAT_PATH, body)
    assert reply.status_code == 200
    assert reply.json()["choices"][0]["message"]["content"] == synthetic_text(5)
    assert sample(cluster.gen.metrics, "disagg_gen_prompt_path_total", path="metadata_only") == before + 1


@pytest.mark.parametrize(
    ("path", "extra", "reason"),
    [
        (CHAT_PATH, {"frequency_penalty": 0.5}, "frequency_penalty"),
        (CHAT_PATH, {"presence_penalty": 0.5}, "presence_penalty"),
        (CHAT_PATH, {"repetition_penalty": 1.2}, "repetition_penalty"),
        (CHAT_PATH, {"logit_bias": {"5": 1.0}}, "logit_bias"),
        (CHAT_PATH, {"prompt_logprobs": 1}, "prompt_logprobs"),
        ("/v1/completions", {"echo": True}, "echo"),
    ],
)
def test_gen_refuses_a_length_only_prompt_that_a_feature_would_read(
    cluster: Cluster, path: str, extra: dict[str, Any], reason: str
) -> None:
    base: dict[str, Any] = {"model": MODEL, "max_tokens": 4, **extra}
    base.update({"messages": MESSAGES} if path == CHAT_PATH else {"prompt": "abc"})
    body = generation_body(base, context_step(cluster, base, path))
    del body["prompt_token_ids_b64"]
    error = gen_error(cluster, body, path)
    assert error["code"] == "metadata_only_refused"
    assert error["param"] == reason
    # With the real tokens, the same request is served.
    assert post(cluster.gen, path, generation_body(base, context_step(cluster, base, path))).status_code == 200


def test_gen_counts_the_list_path(cluster: Cluster) -> None:
    ids = [10, 20, 30, 40]
    base = {"model": MODEL, "prompt": ids, "max_tokens": 4}
    ctx_answer = context_step(cluster, base, "/v1/completions")
    body = generation_body(base, ctx_answer)
    del body["prompt_token_ids_b64"]
    before = sample(cluster.gen.metrics, "disagg_gen_prompt_path_total", path="list")
    assert cluster.gen.engine is not None
    engine_before = len(cluster.gen.engine.requests)
    reply = post(cluster.gen, "/v1/completions", body)
    assert reply.status_code == 200
    assert reply.json()["choices"][0]["text"] == synthetic_text(4)
    assert sample(cluster.gen.metrics, "disagg_gen_prompt_path_total", path="list") == before + 1
    (request,) = cluster.gen.engine.requests[engine_before:]
    assert request.prompt_path is PromptPath.LIST
    assert request.prompt_token_ids == ids


@pytest.mark.parametrize(
    ("node", "request_type"),
    [("gen", "context_only"), ("ctx", "generation_only")],
)
def test_each_role_refuses_the_other_step(cluster: Cluster, node: str, request_type: str) -> None:
    worker = cluster.gen if node == "gen" else cluster.ctx
    body = {**BASE, "disaggregated_params": {"request_type": request_type}}
    reply = post(worker, CHAT_PATH, body)
    assert reply.status_code == 400
    assert reply.json()["error"]["param"] == "disaggregated_params.request_type"


@pytest.mark.parametrize("node", ["ctx", "gen", "aggregated"])
@pytest.mark.parametrize("path", [CHAT_PATH, "/v1/completions"])
def test_the_synthetic_engine_refuses_n_above_1_by_name(cluster: Cluster, node: str, path: str) -> None:
    """It samples nothing, so n identical choices would be a silent wrong answer: a 400 naming ``n`` instead."""
    body: dict[str, Any] = {"model": MODEL, "max_tokens": 4, "n": 2}
    body.update({"messages": MESSAGES} if path == CHAT_PATH else {"prompt": "Hello"})
    reply = post(getattr(cluster, node), path, body)
    assert reply.status_code == 400
    assert reply.json()["error"]["param"] == "n"
    assert reply.json()["error"]["code"] == "unsupported_parameter"


@pytest.mark.parametrize("node", ["aggregated", "orchestrator"])
@pytest.mark.parametrize("stream", [False, True], ids=["whole", "stream"])
def test_a_response_object_repeats_what_the_request_set(cluster: Cluster, node: str, stream: bool) -> None:
    """instructions, temperature and max_output_tokens as the request set them (they read null before), whole and in
    the stream's created and final events; null where the request set nothing. Through CTX and GEN, GEN gets no
    instructions (the prompt travels as tokens), so only the other two are checked there."""
    url = getattr(cluster, node).url + "/v1/responses"
    set_ = {"instructions": "Be kind.", "temperature": 0.5, "max_output_tokens": 3}
    checked = set_ if node == "aggregated" else ("temperature", "max_output_tokens")
    unset = {"instructions": None, "temperature": None, "max_output_tokens": 2}  # a budget keeps the stream short
    for asked, expected in ((set_, set_), ({"max_output_tokens": 2}, unset)):
        reply = httpx.post(url, json={"model": MODEL, "input": "hi", "stream": stream, **asked}, timeout=30)
        assert reply.status_code == 200, reply.text
        if not stream:
            objects = [reply.json()]
        else:
            events = [orjson.loads(line[6:]) for line in reply.text.splitlines() if line.startswith("data: ")]
            objects = [e["response"] for e in events if e["type"] in ("response.created", "response.incomplete",
                                                                     "response.completed")]
            assert len(objects) == 2
        for answer in objects:
            assert {name: answer[name] for name in checked} == {name: expected[name] for name in checked}

"""Bad input through the orchestrator and through a worker: each is a 4xx in OpenAI's error shape that names the
offending field, and the very next normal request succeeds.

Real synthetic workers and orchestrators on loopback. The workers' model has a small context (1,024 tokens) so that
"longer than the context" fits in a small body; the body limits are small (16 KiB) so that 413 is cheap to provoke.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import httpx
import numpy as np
import orjson
import pybase64
import pytest

from frontend.token_codec import encode_prompt_tokens
from tests.cluster import MODEL, Node, sample, start_orchestrator, start_worker
from tests.waiting import eventually
from workers.engines.synthetic import SYNTHETIC_TEXT, SyntheticConfig

CONTEXT = 1024
VOCAB = 50_000
LIMIT = 16 * 1024
SMALL = SyntheticConfig(max_context=CONTEXT)
SLOW = SyntheticConfig(inter_token_latency_s=0.05)
MESSAGES: Any = [{"role": "user", "content": "hello"}]
ERROR_KEYS = {"message", "type", "param", "code"}


def synthetic_text(n: int) -> str:
    return bytes(SYNTHETIC_TEXT[i % len(SYNTHETIC_TEXT)] for i in range(n)).decode()


@dataclass
class Nodes:
    orchestrator: Node
    worker: Node  # role both
    gen: Node  # the orchestrator's GEN; also driven directly with generation_only bodies
    big_gen: Node  # default context and body limit
    big_orchestrator: Node  # default body limit, in front of default-context workers
    slow_worker: Node  # two requests at a time, slow tokens
    slow_orchestrator: Node  # two requests at a time, in front of a slow GEN


@pytest.fixture(scope="module")
def nodes() -> Iterator[Nodes]:
    with contextlib.ExitStack() as stack:
        ctx = start_worker(stack, "context", SMALL, max_body_bytes=LIMIT)
        gen = start_worker(stack, "generation", SMALL, max_body_bytes=LIMIT)
        worker = start_worker(stack, "both", SMALL, max_body_bytes=LIMIT)
        orchestrator = start_orchestrator(stack, [ctx.url], [gen.url], max_body_bytes=LIMIT)
        big_ctx, big_gen = start_worker(stack, "context"), start_worker(stack, "generation")
        big_orchestrator = start_orchestrator(stack, [big_ctx.url], [big_gen.url])
        slow_worker = start_worker(stack, "both", SLOW, max_concurrent_requests=2)
        slow_gen = start_worker(stack, "generation", SLOW)
        # No admission queue: over the running limit, a 429 at once (tests/orchestrator/test_admission.py
        # covers the queue).
        slow_orchestrator = start_orchestrator(stack, [big_ctx.url], [slow_gen.url], max_concurrent_requests=2,
                                               admission={"max_queued": 0})
        yield Nodes(orchestrator, worker, gen, big_gen, big_orchestrator, slow_worker, slow_orchestrator)


@pytest.fixture(params=["orchestrator", "worker"])
def target(request: pytest.FixtureRequest, nodes: Nodes) -> Node:
    node: Node = getattr(nodes, request.param)
    return node


def assert_error(reply: httpx.Response, status: int, param: str | None, code: str | None = None,
                 error_type: str = "invalid_request_error") -> dict[str, Any]:
    assert reply.status_code == status, reply.text
    assert reply.headers["content-type"] == "application/json"
    error: dict[str, Any] = reply.json()["error"]
    assert set(error) == ERROR_KEYS
    assert isinstance(error["message"], str) and error["message"]
    assert error["type"] == error_type
    assert error["param"] == param
    if code is not None:
        assert error["code"] == code
    return error


def assert_serving(url: str) -> None:
    reply = httpx.post(url + "/v1/chat/completions", json={"model": MODEL, "messages": MESSAGES, "max_tokens": 2},
                       timeout=30)
    assert reply.status_code == 200, reply.text
    assert reply.json()["choices"][0]["message"]["content"] == "Th"


# -- malformed bodies, wrong types, unknown model, limits of the request --------------------------------------------
@pytest.mark.parametrize("raw", [b'{"model": "synthetic", ', b"", b"[]", b'"text"', b"\xff\xfe{}", b"{'a': 1}"],
                         ids=["truncated", "empty", "array", "string", "not-utf8", "single-quotes"])
def test_a_body_that_is_not_a_json_object_is_400(target: Node, raw: bytes) -> None:
    reply = httpx.post(target.url + "/v1/chat/completions", content=raw,
                       headers={"content-type": "application/json"}, timeout=10)
    assert_error(reply, 400, None)
    assert_serving(target.url)


CHAT = {"model": MODEL, "messages": MESSAGES, "max_tokens": 4}
COMPLETION = {"model": MODEL, "prompt": "hello", "max_tokens": 4}
TOO_LONG = "x" * (CONTEXT + 50)  # the synthetic engine's byte tokenizer: one token per byte

Case = tuple[str, dict[str, Any], int, str | None, str | None]
CASES: list[Case] = [
    # wrong types
    ("/v1/chat/completions", {**CHAT, "temperature": "hot"}, 400, "temperature", None),
    ("/v1/chat/completions", {**CHAT, "max_tokens": 1.5}, 400, "max_tokens", None),
    ("/v1/chat/completions", {**CHAT, "messages": "hello"}, 400, "messages", None),
    ("/v1/chat/completions", {**CHAT, "messages": [{"role": "wizard", "content": "x"}]}, 400, "messages.0.role",
     None),
    ("/v1/chat/completions", {**CHAT, "stop": 5}, 400, "stop", None),
    ("/v1/chat/completions", {**CHAT, "top_p": [1]}, 400, "top_p", None),
    ("/v1/chat/completions", {**CHAT, "logprobs": "maybe"}, 400, "logprobs", None),
    ("/v1/chat/completions", {**CHAT, "stream": "yes"}, 400, "stream", None),
    ("/v1/chat/completions", {**CHAT, "model": None}, 400, "model", None),
    ("/v1/completions", {**COMPLETION, "prompt": {"text": "hi"}}, 400, "prompt", None),
    ("/v1/responses", {"model": MODEL, "input": 12}, 400, "input", None),
    # unknown model
    ("/v1/chat/completions", {**CHAT, "model": "gpt-4o"}, 404, "model", "model_not_found"),
    ("/v1/completions", {**COMPLETION, "model": "gpt-4o"}, 404, "model", "model_not_found"),
    # token ids out of the vocabulary, prompt longer than the context
    ("/v1/chat/completions", {**CHAT, "prompt_token_ids": [5, -1]}, 400, "prompt_token_ids",
     "invalid_prompt_tokens"),
    ("/v1/chat/completions", {**CHAT, "prompt_token_ids": [VOCAB]}, 400, "prompt_token_ids",
     "invalid_prompt_tokens"),
    ("/v1/chat/completions", {**CHAT, "prompt_token_ids": [2**40]}, 400, "prompt_token_ids",
     "invalid_prompt_tokens"),
    ("/v1/completions", {**COMPLETION, "prompt": [1, VOCAB + 7]}, 400, "prompt", "invalid_prompt_tokens"),
    ("/v1/chat/completions", {**CHAT, "prompt_token_ids": [7] * (CONTEXT + 1)}, 400, "prompt_token_ids",
     "context_length_exceeded"),
    ("/v1/completions", {**COMPLETION, "prompt": TOO_LONG}, 400, "prompt", "context_length_exceeded"),
    ("/v1/chat/completions", {**CHAT, "messages": [{"role": "user", "content": TOO_LONG}]}, 400, "messages",
     "context_length_exceeded"),
    ("/v1/responses", {"model": MODEL, "input": TOO_LONG}, 400, "input", "context_length_exceeded"),
    # max_tokens 0, negative, beyond the context
    ("/v1/chat/completions", {**CHAT, "max_tokens": 0}, 400, "max_tokens", None),
    ("/v1/chat/completions", {**CHAT, "max_tokens": -3}, 400, "max_tokens", None),
    ("/v1/chat/completions", {**CHAT, "max_completion_tokens": 0}, 400, "max_completion_tokens", None),
    ("/v1/completions", {**COMPLETION, "max_tokens": -1}, 400, "max_tokens", None),
    ("/v1/responses", {"model": MODEL, "input": "hi", "max_output_tokens": 0}, 400, "max_output_tokens", None),
    ("/v1/chat/completions", {**CHAT, "max_tokens": CONTEXT}, 400, "max_tokens", "context_length_exceeded"),
    ("/v1/chat/completions", {**CHAT, "max_completion_tokens": 10 * CONTEXT}, 400, "max_completion_tokens",
     "context_length_exceeded"),
    ("/v1/completions", {**COMPLETION, "max_tokens": 2**31}, 400, "max_tokens", "context_length_exceeded"),
    ("/v1/responses", {"model": MODEL, "input": "hi", "max_output_tokens": CONTEXT}, 400, "max_output_tokens",
     "context_length_exceeded"),
    # parameters OpenAI has and this (synthetic) engine cannot honour: it has no logits to constrain
    ("/v1/chat/completions", {**CHAT, "tools": [{"type": "function", "function": {"name": "f"}}],
                              "tool_choice": "required"}, 400, "tool_choice", "unsupported_parameter"),
    ("/v1/chat/completions", {**CHAT, "response_format": {"type": "json_schema", "json_schema": {
        "name": "s", "schema": {"type": "nope"}}}}, 400, "response_format", None),
    ("/v1/chat/completions", {**CHAT, "response_format": {"type": "json_object"}}, 400, "response_format",
     "unsupported_parameter"),
    ("/v1/chat/completions", {**CHAT, "n": 2}, 400, "n", "unsupported_parameter"),
    ("/v1/completions", {**COMPLETION, "best_of": 3}, 400, "best_of", "unsupported_parameter"),
    ("/v1/chat/completions", {**CHAT, "frobnicate": True}, 400, "frobnicate", None),
]


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "stream"])
@pytest.mark.parametrize(("path", "body", "status", "param", "code"), CASES,
                         ids=[f"{c[0].rsplit('/', 1)[1]}-{c[3]}-{i}" for i, c in enumerate(CASES)])
def test_bad_requests_are_openai_errors_naming_the_field(
    target: Node, path: str, body: dict[str, Any], status: int, param: str | None, code: str | None, stream: bool
) -> None:
    payload = {**body, "stream": True} if stream and "stream" not in body else body
    reply = httpx.post(target.url + path, json=payload, timeout=10)
    assert_error(reply, status, param, code)
    assert_serving(target.url)


def test_a_body_over_the_configured_limit_is_413(target: Node) -> None:
    body = {"model": MODEL, "messages": [{"role": "user", "content": "x" * LIMIT}], "max_tokens": 2}
    reply = httpx.post(target.url + "/v1/chat/completions", json=body, timeout=10)
    assert_error(reply, 413, None, "payload_too_large")
    assert str(LIMIT) in reply.json()["error"]["message"]
    assert_serving(target.url)


# -- the prompt as base64 int32, sent to a GEN worker as a generation_only body --------------------------------------
def synthetic_state(prompt_len: int, engine: str = "synthetic") -> str:
    raw = orjson.dumps({"engine": engine, "prompt_len": prompt_len, "position": 1})
    return pybase64.b64encode(raw).decode()


def generation_body(encoded: Any, prompt_len: int | None, **params: Any) -> dict[str, Any]:
    disagg: dict[str, Any] = {"request_type": "generation_only", "first_gen_tokens": [84],
                              "encoded_opaque_state": synthetic_state(prompt_len or 3), "native_extensions": True}
    if prompt_len is not None:
        disagg["prompt_len"] = prompt_len
    disagg.update(params)
    return {"model": MODEL, "messages": MESSAGES, "max_tokens": 4, "prompt_token_ids_b64": encoded,
            "disaggregated_params": disagg}


def assert_gen_serving(url: str) -> None:
    reply = httpx.post(url + "/v1/chat/completions", json=generation_body(encode_prompt_tokens([1, 2, 3]), 3),
                       timeout=30)
    assert reply.status_code == 200, reply.text
    assert reply.json()["choices"][0]["message"]["content"] == synthetic_text(4)


B64 = "prompt_token_ids_b64"
B64_CASES: list[tuple[str, Any, int | None, str, str]] = [
    ("bad-characters", "AAAA*AAA", None, B64, "invalid_prompt_tokens"),
    ("non-ascii", "ÄAAAAAAA", None, B64, "invalid_prompt_tokens"),
    ("padding-in-the-middle", "AAAA=AAA", None, B64, "invalid_prompt_tokens"),
    ("too-much-padding", "AAAAA===", None, B64, "invalid_prompt_tokens"),
    ("missing-padding", "AAAAAA", None, B64, "invalid_prompt_tokens"),
    ("whitespace", "AAAA AAA", None, B64, "invalid_prompt_tokens"),
    ("six-bytes", "AAAAAAAA", None, B64, "invalid_prompt_tokens"),
    ("one-byte", "AA==", None, B64, "invalid_prompt_tokens"),
    ("empty", "", None, B64, "invalid_prompt_tokens"),
    ("not-a-string", 12345, None, B64, None),  # type: ignore[list-item]
    ("negative-id", encode_prompt_tokens([3, -1, 4]), 3, B64, "invalid_prompt_tokens"),
    ("id-at-vocab", encode_prompt_tokens([3, VOCAB]), 2, B64, "invalid_prompt_tokens"),
    ("id-at-int32-max", encode_prompt_tokens([2**31 - 1]), 1, B64, "invalid_prompt_tokens"),
    ("prompt-len-disagrees", encode_prompt_tokens([1, 2, 3]), 4, "prompt_len", "invalid_prompt_tokens"),
    ("longer-than-context", encode_prompt_tokens(np.ones(CONTEXT + 1, np.int32)), CONTEXT + 1, B64,
     "context_length_exceeded"),
]


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "stream"])
@pytest.mark.parametrize(("encoded", "prompt_len", "param", "code"), [c[1:] for c in B64_CASES],
                         ids=[c[0] for c in B64_CASES])
def test_bad_prompt_token_ids_b64_is_400_naming_the_field(
    nodes: Nodes, encoded: Any, prompt_len: int | None, param: str, code: str | None, stream: bool
) -> None:
    body = {**generation_body(encoded, prompt_len), "stream": stream}
    reply = httpx.post(nodes.gen.url + "/v1/chat/completions", json=body, timeout=10)
    assert_error(reply, 400, param, code)
    assert_gen_serving(nodes.gen.url)


# (id, disaggregated_params overrides, param, checked by the engine rather than while parsing)
HANDOFF_CASES: list[tuple[str, dict[str, Any], str, bool]] = [
    ("state-not-base64", {"encoded_opaque_state": "%%%"}, "disaggregated_params.encoded_opaque_state", False),
    ("state-not-json", {"encoded_opaque_state": pybase64.b64encode(b"\x00\x01garbage").decode()},
     "disaggregated_params", True),
    ("state-json-but-not-a-handoff", {"encoded_opaque_state": pybase64.b64encode(b"[1, 2]").decode()},
     "disaggregated_params", True),
    ("state-missing-fields", {"encoded_opaque_state": pybase64.b64encode(b'{"engine": "synthetic"}').decode()},
     "disaggregated_params", True),
    ("state-of-another-engine", {"encoded_opaque_state": synthetic_state(3, engine="reference")},
     "disaggregated_params", True),
    ("state-for-another-prompt", {"encoded_opaque_state": synthetic_state(9)}, "disaggregated_params.prompt_len",
     True),
    ("no-state", {"encoded_opaque_state": None}, "disaggregated_params.encoded_opaque_state", False),
    ("no-first-token", {"first_gen_tokens": []}, "disaggregated_params.first_gen_tokens", False),
    ("first-token-outside-vocab", {"first_gen_tokens": [VOCAB]}, "disaggregated_params.first_gen_tokens", False),
]
HANDOFF_PARAMS = [
    pytest.param(params, param, stream, id=f"{name}-{'stream' if stream else 'whole'}")
    for name, params, param, _ in HANDOFF_CASES for stream in (False, True)
]


@pytest.mark.parametrize(("params", "param", "stream"), HANDOFF_PARAMS)
def test_a_malformed_synthetic_handoff_is_400_invalid_handoff(
    nodes: Nodes, params: dict[str, Any], param: str, stream: bool
) -> None:
    body = {**generation_body(encode_prompt_tokens([1, 2, 3]), 3, **params), "stream": stream}
    reply = httpx.post(nodes.gen.url + "/v1/chat/completions", json=body, timeout=10)
    try:
        assert_error(reply, 400, param, "invalid_handoff")
    finally:
        assert eventually(lambda: sample(nodes.gen.metrics, "disagg_engine_inflight_requests",
                                         role="generation") == 0)
        assert_gen_serving(nodes.gen.url)


def test_the_default_limit_admits_a_290k_token_prompt(nodes: Nodes) -> None:
    tokens = (np.arange(290_000, dtype=np.int32) * 7919) % VOCAB
    encoded = encode_prompt_tokens(tokens)
    assert len(encoded) > 1_500_000
    body = generation_body(encoded, tokens.size, encoded_opaque_state=synthetic_state(tokens.size))
    reply = httpx.post(nodes.big_gen.url + "/v1/chat/completions", json=body, timeout=60)
    assert reply.status_code == 200, reply.text[:500]
    assert reply.json()["usage"]["prompt_tokens"] == 290_000
    assert reply.json()["choices"][0]["message"]["content"] == synthetic_text(4)
    # And from a client through the orchestrator (CTX decodes the client's b64, GEN gets CTX's string).
    client_body = {"model": MODEL, "prompt": "unused", "prompt_token_ids_b64": encoded, "max_tokens": 3}
    via = httpx.post(nodes.big_orchestrator.url + "/v1/completions", json=client_body, timeout=60)
    assert via.status_code == 200, via.text[:500]
    assert via.json()["usage"]["prompt_tokens"] == 290_000
    assert via.json()["choices"][0]["text"] == synthetic_text(3)


# -- more concurrent requests than configured -------------------------------------------------------------------------
@pytest.mark.parametrize("which", ["slow_orchestrator", "slow_worker"])
def test_more_concurrent_requests_than_configured_is_429_with_retry_after(nodes: Nodes, which: str) -> None:
    node: Node = getattr(nodes, which)
    role = "orchestrator" if which == "slow_orchestrator" else "both"
    body = {"model": MODEL, "messages": MESSAGES, "max_tokens": 400, "stream": True}
    with httpx.Client(timeout=30) as first, httpx.Client(timeout=30) as second, \
            first.stream("POST", node.url + "/v1/chat/completions", json=body) as a, \
            second.stream("POST", node.url + "/v1/chat/completions", json=body) as b:
        assert a.status_code == b.status_code == 200
        chunks = (a.iter_raw(), b.iter_raw())  # keep the iterators: dropping one closes its connection
        for chunk in chunks:
            next(chunk)
        for path in ("/v1/chat/completions", "/v1/completions", "/v1/responses"):
            refused = httpx.post(node.url + path, json={**body, "stream": False, "prompt": "x", "input": "x"},
                                 timeout=10)
            error = assert_error(refused, 429, None, "overloaded", error_type="rate_limit_error")
            assert refused.headers["retry-after"] == "1"
            assert "limit of 2" in error["message"]
        assert sample(node.metrics, "disagg_engine_inflight_requests", role=role) == 2
    assert eventually(lambda: sample(node.metrics, "disagg_engine_inflight_requests", role=role) == 0)
    assert_serving(node.url)

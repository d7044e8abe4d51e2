"""Direction A: our orchestrator in front of trtllm-serve workers, speaking TensorRT-LLM's v0 context-first wire.

Unit by unit first (the CTX body, reading CTX's answer by its finish_reason, the GEN body for each way the prompt
travels), then over real HTTP: the official client -> our orchestrator -> strict TensorRT-LLM-shaped CTX and GEN
workers (``trtllm_worker``), which refuse whatever TensorRT-LLM's models would.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import numpy as np
import openai
import orjson
import pybase64
import pytest
from openai.types.chat import ChatCompletionMessageParam

from orchestrator.protocols.base import PromptCarriage
from orchestrator.protocols.trtllm.wire import TrtllmProtocol
from orchestrator.routers import _rendezvous
from orchestrator.upstream.base import body_bytes
from tests.cluster import start_orchestrator, start_worker
from tests.orchestrator.protocols.trtllm.trtllm_worker import FIRST, MODEL, REST, TrtllmWorker
from tests.servers import running
from tests.trtllm_wire import ChatCompletionRequest, CompletionRequest, DisaggregatedParams

MESSAGES: list[ChatCompletionMessageParam] = [
    {"role": "system", "content": "Be brief."}, {"role": "user", "content": "hi"},
    {"role": "assistant", "content": "Hello"}, {"role": "user", "content": "and?"}]
HISTORY: list[dict[str, Any]] = [dict(message) for message in MESSAGES]  # the same turns, as plain bodies


def chat_body(**extra: Any) -> dict[str, Any]:
    return {"model": "m", "messages": HISTORY, "max_tokens": 5, **extra}


def ctx_answer(finish: str | None = "length", **extra: Any) -> bytes:
    params = {"request_type": "context_only", "first_gen_tokens": [7], "ctx_request_id": 12,
              "encoded_opaque_state": "c3RhdGU=", "disagg_request_id": 5}
    return orjson.dumps({"id": "c", "object": "chat.completion", "created": 0, "model": "m",
                         "choices": [{"index": 0, "message": {"role": "assistant", "content": "T"},
                                      "finish_reason": finish, "disaggregated_params": params}],
                         "usage": {"prompt_tokens": 4, "completion_tokens": 1, "total_tokens": 5}, **extra})


# -- units ----------------------------------------------------------------------------------------------------
def test_the_ctx_body_is_what_trtllm_sends() -> None:
    body = chat_body(stream=True, stream_options={"include_usage": True},
                     conversation_params={"conversation_id": "conv-1"})
    sent = orjson.loads(body_bytes(TrtllmProtocol().context_request(body, return_prompt_tokens=True)))
    ChatCompletionRequest.model_validate(sent)  # strict: nothing TensorRT-LLM would refuse
    params = sent.pop("disaggregated_params")
    assert params == {"request_type": "context_only", "disagg_request_id": params["disagg_request_id"],
                      "schedule_style": 0, "conversation_id": "conv-1", "return_prompt_token_ids_b64": True}
    assert sent == {**body, "stream": False, "stream_options": None}


@pytest.mark.parametrize("finish, finished", [("length", False), ("not_finished", False), ("stop", True),
                                              (None, True), ("content_filter", True)])
def test_gen_is_called_only_on_length_or_not_finished(finish: str | None, finished: bool) -> None:
    assert TrtllmProtocol().read_context_answer(ctx_answer(finish)).finished is finished


def test_a_finished_ctx_answer_loses_its_hand_off_fields() -> None:
    protocol = TrtllmProtocol()
    response = protocol.finished_response(protocol.read_context_answer(ctx_answer("stop", prompt_token_ids=[1])))
    assert "prompt_token_ids" not in response and "disaggregated_params" not in response["choices"][0]


@pytest.mark.parametrize("strip", [False, True], ids=["history-kept", "history-stripped"])
def test_the_gen_body_relays_the_b64_string_itself_and_keeps_the_messages(strip: bool) -> None:
    protocol = TrtllmProtocol(strip_message_history=strip)
    encoded = "".join(["SGVsbG8sIHdvcmxk", "IQAAAA=="])  # a str object of its own, as orjson makes one
    ctx = protocol.read_context_answer(ctx_answer(prompt_token_ids_b64=encoded))
    body = chat_body(stream=True)
    sent_body = protocol.generation_request(body, ctx, PromptCarriage.CTX_TOKENS)
    sent = orjson.loads(body_bytes(sent_body))
    request = ChatCompletionRequest.model_validate(sent)
    # The b64 string is cut out of CTX's bytes unparsed and goes to GEN as a chunk of its own.
    assert isinstance(ctx.prompt_b64, memoryview) and any(chunk is ctx.prompt_b64 for chunk in sent_body)
    assert bytes(ctx.prompt_b64) == encoded.encode() and sent["prompt_token_ids_b64"] == encoded
    assert request.messages == (HISTORY[-1:] if strip else HISTORY)
    assert sent["disaggregated_params"] == {
        "request_type": "generation_only", "first_gen_tokens": [7], "ctx_request_id": 12,
        "encoded_opaque_state": "c3RhdGU=", "disagg_request_id": 5, "schedule_style": 0, "conversation_id": None,
        "ctx_usage": {"prompt_tokens": 4, "completion_tokens": 1, "total_tokens": 5}}
    assert body == chat_body(stream=True)  # the client's body is left alone


def test_the_list_path_and_completions_take_ctx_token_list() -> None:
    protocol = TrtllmProtocol()
    ctx = protocol.read_context_answer(ctx_answer(prompt_token_ids=[1, 2, 3]))
    chat = orjson.loads(body_bytes(protocol.generation_request(chat_body(), ctx, PromptCarriage.CLIENT_PROMPT)))
    assert chat["prompt_token_ids"] == [1, 2, 3] and chat["messages"] == HISTORY
    completion = orjson.loads(body_bytes(protocol.generation_request({"model": "m", "prompt": "hi"}, ctx,
                                                                     PromptCarriage.CTX_TOKENS)))
    CompletionRequest.model_validate(completion)
    assert completion["prompt"] == [1, 2, 3]


def test_our_own_hand_off_fields_never_reach_a_trtllm_gen() -> None:
    """A disagg-serve CTX in a mixed fleet: its extras are dropped and its decimal id becomes an int."""
    protocol = TrtllmProtocol()
    ours = {"request_type": "context_only", "ctx_request_id": "123", "first_gen_tokens": [7], "prompt_len": 4,
            "encoded_opaque_state": "c3Q=", "native_extensions": True, "first_gen_logprobs": []}
    answer = orjson.dumps({"choices": [{"finish_reason": "not_finished", "disaggregated_params": ours}],
                           "usage": {"prompt_tokens": 4, "completion_tokens": 1, "total_tokens": 5}})
    sent = orjson.loads(body_bytes(protocol.generation_request(chat_body(), protocol.read_context_answer(answer),
                                                               PromptCarriage.CLIENT_PROMPT)))
    params = DisaggregatedParams.model_validate(sent["disaggregated_params"])
    assert params.ctx_request_id == 123


# -- over HTTP: our orchestrator, strict trtllm-serve-shaped workers ----------------------------------------
@dataclass
class TrtllmFleet:
    ctx: TrtllmWorker
    gen: TrtllmWorker
    ctx_url: str
    gen_url: str


@pytest.fixture(scope="module")
def fleet() -> Iterator[TrtllmFleet]:
    ctx, gen = TrtllmWorker("ctx"), TrtllmWorker("gen")
    with running(ctx.app()) as ctx_url, running(gen.app()) as gen_url:
        yield TrtllmFleet(ctx, gen, ctx_url, gen_url)


@contextlib.contextmanager
def orchestrator(ctx_urls: list[str], gen_urls: list[str], **options: Any) -> Iterator[openai.OpenAI]:
    with contextlib.ExitStack() as stack:
        node = start_orchestrator(stack, ctx_urls, gen_urls, **options)
        with openai.OpenAI(base_url=node.url + "/v1", api_key="x", max_retries=0, timeout=30) as client:
            yield client


def _text(client: openai.OpenAI, chat: bool, stream: bool, max_tokens: int) -> str:
    prompt = "The capital of France is"
    if chat and stream:
        chunks = client.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=max_tokens, stream=True)
        return "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    if chat:
        reply = client.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=max_tokens)
        return reply.choices[0].message.content or ""
    if stream:
        parts = client.completions.create(model=MODEL, prompt=prompt, max_tokens=max_tokens, stream=True)
        return "".join(c.choices[0].text for c in parts if c.choices)
    return client.completions.create(model=MODEL, prompt=prompt, max_tokens=max_tokens).choices[0].text


@pytest.mark.parametrize("chat", [True, False], ids=["chat", "completions"])
@pytest.mark.parametrize("stream", [False, True], ids=["whole", "stream"])
@pytest.mark.parametrize("ctxbytes", [False, True], ids=["token-list", "ctxbytes"])
def test_our_orchestrator_drives_trtllm_workers(fleet: TrtllmFleet, chat: bool, stream: bool, ctxbytes: bool) -> None:
    with orchestrator([fleet.ctx_url], [fleet.gen_url], gen_tokids_ctxbytes=ctxbytes,
                      gen_strip_message_history=True) as client:
        seen = len(fleet.gen.bodies)
        assert _text(client, chat, stream, max_tokens=8) == FIRST + REST
    assert fleet.ctx.refused == [] and fleet.gen.refused == []
    (raw,) = fleet.gen.bodies[seen:]
    gen_body = orjson.loads(raw)
    if chat:
        assert gen_body["messages"] == HISTORY[-1:]  # kept, and stripped as the config asks
        tokens = list("".join(m["content"] for m in HISTORY).encode())  # the stand-in's "tokenizer"
        if ctxbytes:  # relayed as the bytes CTX sent
            encoded = pybase64.b64encode(np.asarray(tokens, "<i4").tobytes())
            assert b'"prompt_token_ids_b64":"' + encoded + b'"' in raw and "prompt_token_ids" not in gen_body
        else:
            assert gen_body["prompt_token_ids"] == tokens
    else:
        assert gen_body["prompt"] == list(b"The capital of France is")


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "stream"])
def test_a_ctx_that_finished_answers_without_gen(fleet: TrtllmFleet, stream: bool) -> None:
    with orchestrator([fleet.ctx_url], [fleet.gen_url]) as client:
        seen = len(fleet.gen.bodies)
        assert _text(client, True, stream, max_tokens=1) == FIRST
    assert len(fleet.gen.bodies) == seen and fleet.ctx.refused == []


def test_a_mixed_fleet_speaks_to_each_worker_in_its_own_protocol(fleet: TrtllmFleet) -> None:
    """A disagg-serve CTX beside a trtllm-serve CTX, in front of a trtllm-serve GEN: each CTX is asked in its
    own wire (ours with our extensions announced), and the GEN gets TensorRT-LLM's field set from either."""
    with contextlib.ExitStack() as stack:
        ours = start_worker(stack, "context")
        ctx_urls = [fleet.ctx_url, ours.url]
        node = start_orchestrator(stack, ctx_urls, [fleet.gen_url],
                                  context_servers={"urls": ctx_urls, "router": {"type": "round_robin"}})
        seen = len(fleet.gen.bodies)
        with openai.OpenAI(base_url=node.url + "/v1", api_key="x", max_retries=0, timeout=30) as client:
            for _ in range(2):  # round robin: one request through each CTX
                reply = client.chat.completions.create(model="synthetic", messages=MESSAGES, max_tokens=8,
                                                       extra_body={"ignore_eos": True})
                assert reply.choices[0].message.content == FIRST + REST
        our_ctx = ours.recorder.posts("/v1/chat/completions")
    assert len(our_ctx) == 1 and our_ctx[0].request_json()["disaggregated_params"]["native_extensions"] is True
    assert fleet.gen.refused == [] and len(fleet.gen.bodies) == seen + 2


# -- conversations: ids read as TensorRT-LLM sends them, told to both legs, and the session key of routing -----
def _conversation_ids(worker: TrtllmWorker, seen: int) -> list[str | None]:
    return [orjson.loads(raw)["disaggregated_params"]["conversation_id"] for raw in worker.bodies[seen:]]


@pytest.mark.parametrize("how", ["body", "x-correlation-id", "x-multi-turn-session-id"])
def test_the_conversation_id_reaches_both_legs(fleet: TrtllmFleet, how: str) -> None:
    extra: dict[str, Any] = {}
    if how == "body":
        extra["extra_body"] = {"conversation_params": {"conversation_id": "conv-7"}}
        extra["extra_headers"] = {"X-Session-ID": "loses-to-the-body"}
    else:
        extra["extra_headers"] = {how: "conv-7"}
    with orchestrator([fleet.ctx_url], [fleet.gen_url]) as client:
        seen_ctx, seen_gen = len(fleet.ctx.bodies), len(fleet.gen.bodies)
        reply = client.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=8, **extra)
    assert reply.choices[0].message.content == FIRST + REST
    assert fleet.ctx.refused == [] and fleet.gen.refused == []
    assert _conversation_ids(fleet.ctx, seen_ctx) == ["conv-7"] and _conversation_ids(fleet.gen, seen_gen) == ["conv-7"]


def test_subagent_affinity_keys_session_routing_and_workers_hear_their_own_id(fleet: TrtllmFleet) -> None:
    """Each sub-agent of one parent has its own conversation (what the workers are told), and every one of them
    is routed by the parent's id: to the CTX worker that session affinity ranks first for it."""
    other = TrtllmWorker("ctx")
    with running(other.app()) as other_url:
        ctx_urls = [fleet.ctx_url, other_url]
        own = max(ctx_urls, key=lambda url: _rendezvous("parent-1", url))
        workers = {fleet.ctx_url: fleet.ctx, other_url: other}
        seen = {url: len(w.bodies) for url, w in workers.items()}
        with orchestrator(ctx_urls, [fleet.gen_url],
                          context_servers={"urls": ctx_urls, "router": {"type": "cache_aware"}}) as client:
            for child in range(4):
                client.chat.completions.create(
                    model=MODEL, max_tokens=8, messages=[{"role": "user", "content": f"task {child}"}],
                    extra_headers={"x-trtllm-subagent-affinity-id": "parent-1", "x-session-id": f"child-{child}"})
    assert _conversation_ids(workers[own], seen[own]) == [f"child-{i}" for i in range(4)]
    assert all(len(w.bodies) == seen[url] for url, w in workers.items() if url != own)


# -- PR #15309: after a CTX retry, GEN waits on the id of the CTX answer that succeeded --------------------------
def test_after_a_ctx_retry_gen_carries_the_id_of_the_ctx_that_answered(fleet: TrtllmFleet) -> None:
    """Each CTX attempt is a new body with a new ``disagg_request_id`` (the failed attempt's id may still be live
    on its worker); GEN must get the one the succeeding CTX answered with, or it waits on a KV that never comes."""
    flaky = TrtllmWorker("ctx", fail_next=2)  # round robin: whichever request reaches it first fails there once
    with running(flaky.app()) as flaky_url:
        ctx_urls = [flaky_url, fleet.ctx_url]
        with orchestrator(ctx_urls, [fleet.gen_url],
                          context_servers={"urls": ctx_urls, "router": {"type": "round_robin"}}) as client:
            seen_ctx, seen_gen = len(fleet.ctx.bodies), len(fleet.gen.bodies)
            for _ in range(2):
                assert _text(client, True, False, max_tokens=8) == FIRST + REST
    failed = [orjson.loads(raw)["disaggregated_params"]["disagg_request_id"] for raw in flaky.bodies]
    answered = [orjson.loads(raw)["disaggregated_params"]["disagg_request_id"] for raw in fleet.ctx.bodies[seen_ctx:]]
    gen = [orjson.loads(raw)["disaggregated_params"]["disagg_request_id"] for raw in fleet.gen.bodies[seen_gen:]]
    assert failed and not set(failed) & set(answered)  # a retry is a new attempt with a new id
    assert gen == answered and fleet.gen.refused == []


def test_disagg_request_ids_come_from_a_secure_generator(monkeypatch: pytest.MonkeyPatch) -> None:
    """A disagg_request_id names a generation-first hand-off on CTX's board: it must not be predictable from
    Python's Mersenne Twister (issue 44, item 3; bb7e60b used random.getrandbits)."""
    import random

    from orchestrator.protocols.native import NativeProtocol
    from orchestrator.protocols.trtllm.wire import new_request_id

    def predictable(_bits: int) -> int:
        raise AssertionError("random.getrandbits used for an id")

    monkeypatch.setattr(random, "getrandbits", predictable)
    assert 0 <= new_request_id() < 2**63
    encoded = NativeProtocol().context_request({"model": "m", "prompt": "x"}, return_prompt_tokens=False)
    assert isinstance(encoded, bytes)
    body = orjson.loads(encoded)
    assert 0 <= body["disaggregated_params"]["disagg_request_id"] < 2**63

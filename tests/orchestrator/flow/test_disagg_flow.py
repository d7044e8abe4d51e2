"""The two-step flow and its wire protocol, watched at the CTX and GEN workers' own front doors."""

from __future__ import annotations

import contextlib
import json
import pathlib
import re
import subprocess
import sys
from collections.abc import Iterator
from typing import Any

import httpx
import numpy as np
import openai
import orjson
import pytest

import orchestrator
from frontend.token_codec import decode_prompt_tokens
from tests.cluster import (
    MODEL,
    Cluster,
    Exchange,
    Node,
    RecordingEngine,
    sample,
    start_orchestrator,
    start_worker,
    total,
)
from tests.servers import ServerThread
from workers.engines.byte_tokenizer import ByteTokenizer
from workers.engines.request import GenerationRequest, Phase, PromptPath
from workers.engines.synthetic import SYNTHETIC_TEXT, SyntheticConfig
from workers.server import create_worker_app
from workers.settings import WorkerSettings

TOKENIZER = ByteTokenizer(50_000)


def synthetic_text(n: int) -> str:
    return bytes(SYNTHETIC_TEXT[i % len(SYNTHETIC_TEXT)] for i in range(n)).decode()


def exchanges_for(node: Node, disagg_request_id: int) -> list[Exchange]:
    return [e for e in node.recorder.posts()
            if e.request_json().get("disaggregated_params", {}).get("disagg_request_id") == disagg_request_id]


def last_ctx_exchange(cluster: Cluster, before: int) -> Exchange:
    (exchange,) = cluster.ctx.recorder.posts()[before:]
    return exchange


def gen_requests(node: Node, before: int) -> list[GenerationRequest]:
    assert node.engine is not None
    return node.engine.requests[before:]


@contextlib.contextmanager
def watching(cluster: Cluster) -> Iterator[dict[str, int]]:
    """Positions in every recorder and engine log before a request, to find what it caused afterwards."""
    assert cluster.gen.engine is not None
    yield {"ctx": len(cluster.ctx.recorder.posts()), "gen": len(cluster.gen.recorder.posts()),
           "gen_engine": len(cluster.gen.engine.requests)}


# -- the relay -----------------------------------------------------------------------------------------------
@pytest.mark.parametrize("endpoint", ["chat", "completions", "responses"])
def test_gen_receives_exactly_the_b64_string_ctx_returned(
    client: openai.OpenAI, cluster: Cluster, endpoint: str
) -> None:
    long_text = "All work and no play makes Jack a dull boy. " * 300
    with watching(cluster) as before:
        if endpoint == "chat":
            client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": long_text}],
                                           max_tokens=5)
        elif endpoint == "completions":
            client.completions.create(model=MODEL, prompt=long_text, max_tokens=5)
        else:
            client.responses.create(model=MODEL, input=long_text, max_output_tokens=5)
    ctx = last_ctx_exchange(cluster, before["ctx"])
    ctx_body, ctx_answer = ctx.request_json(), ctx.response_json()
    ctx_params = ctx_answer["choices"][0]["disaggregated_params"] if "choices" in ctx_answer \
        else ctx_answer["disaggregated_params"]
    request_id = ctx_body["disaggregated_params"]["disagg_request_id"]
    (gen,) = exchanges_for(cluster.gen, request_id)
    gen_body = gen.request_json()

    # CTX was asked for a context_only step, whole, with the prompt back as b64.
    assert ctx_body["disaggregated_params"] == {"request_type": "context_only", "disagg_request_id": request_id,
                                                "return_prompt_token_ids_b64": True, "native_extensions": True}
    assert ctx_body["stream"] is False
    encoded = ctx_answer["prompt_token_ids_b64"]
    assert ctx_answer["prompt_token_ids"] is None
    assert isinstance(encoded, str) and len(encoded) > 4 * len(long_text)

    # GEN got the very same string, byte for byte, and the hand-off fields copied from CTX.
    assert gen_body["prompt_token_ids_b64"] == encoded
    assert b'"prompt_token_ids_b64":"' + encoded.encode() + b'"' in gen.request_body
    assert gen_body["disaggregated_params"] == {**ctx_params, "request_type": "generation_only"}
    assert gen_body["disaggregated_params"]["prompt_len"] == ctx_params["prompt_len"]
    assert "prompt_token_ids" not in gen_body

    # And the string is the prompt CTX tokenized.
    tokens = decode_prompt_tokens(encoded, vocab_size=TOKENIZER.vocab_size)
    assert tokens.size == ctx_params["prompt_len"]
    tail = long_text if endpoint == "completions" else long_text + "\n<|assistant|>\n"
    assert TOKENIZER.decode(tokens).endswith(tail)


def test_gen_engine_got_a_zero_copy_array_and_never_built_a_list(client: openai.OpenAI, cluster: Cluster) -> None:
    with watching(cluster) as before:
        reply = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "x" * 5000}],
                                               max_tokens=8)
    assert reply.choices[0].message.content == synthetic_text(8)
    (request,) = gen_requests(cluster.gen, before["gen_engine"])
    assert request.phase is Phase.GENERATION_ONLY
    assert request.prompt_path is PromptPath.ARRAY
    assert request.prompt_list_built is False  # after the request completed
    array = request.prompt_token_ids_i32
    assert array.flags.owndata is False
    assert isinstance(array.base, bytes)  # a view over the decoded base64, not a copy
    assert array.flags.writeable is False
    assert reply.usage is not None
    assert request.prompt_len == reply.usage.prompt_tokens


@pytest.fixture(scope="module")
def roomy(cluster: Cluster) -> Iterator[Node]:
    """An orchestrator with the default body limit (the session's takes 64 KiB) in front of the same workers."""
    with contextlib.ExitStack() as stack:
        yield start_orchestrator(stack, [cluster.ctx.url], [cluster.gen.url])


@pytest.mark.parametrize("endpoint", ["chat", "completions"])
def test_a_long_prompt_reaches_ctx_as_the_very_bytes_the_client_sent(
    cluster: Cluster, roomy: Node, endpoint: str
) -> None:
    text = 'He said "stop".\n\tA tab, a \\ backslash, ünïcödé. ' * 2000  # ~100 KB: kept as its literal
    body: dict[str, Any] = {"model": MODEL, "max_tokens": 4}
    if endpoint == "chat":
        body["messages"] = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": text}]
    else:
        body["prompt"] = text
    # The stdlib's habits (spaces after separators, non-ASCII as \u escapes), which the orchestrator keeps.
    raw = json.dumps(body, separators=(", ", ": ")).encode()
    with watching(cluster) as before:
        reply = httpx.post(roomy.url + ("/v1/chat/completions" if endpoint == "chat" else "/v1/completions"),
                           content=raw, headers={"content-type": "application/json"}, timeout=60)
    assert reply.status_code == 200, reply.text
    ctx = last_ctx_exchange(cluster, before["ctx"])
    assert json.dumps(text).encode() in ctx.request_body
    ctx_body = ctx.request_json()
    assert (ctx_body["messages"][1]["content"] if endpoint == "chat" else ctx_body["prompt"]) == text
    assert reply.json()["usage"]["prompt_tokens"] >= len(text.encode())  # the byte tokenizer read all of it


def test_a_long_prompt_the_worker_cannot_read_is_its_400_and_serving_goes_on(
    cluster: Cluster, roomy: Node, client: openai.OpenAI
) -> None:
    # The orchestrator does not read a long prompt's text (orchestrator.client_body): the CTX worker does.
    raw = b'{"model": "' + MODEL.encode() + b'", "max_tokens": 2, "prompt": "\xff' + b"a" * 70_000 + b'"}'
    reply = httpx.post(roomy.url + "/v1/completions", content=raw, headers={"content-type": "application/json"},
                       timeout=60)
    assert reply.status_code == 400
    error = reply.json()["error"]
    assert set(error) == {"message", "type", "param", "code"} and "not valid JSON" in error["message"]
    assert openai.OpenAI(base_url=roomy.url + "/v1", api_key="k", max_retries=0).completions.create(
        model=MODEL, prompt="Once", max_tokens=2).choices[0].text == synthetic_text(2)


def test_streamed_gen_answer_is_relayed_byte_for_byte(cluster: Cluster) -> None:
    body = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 30, "stream": True,
            "stream_options": {"include_usage": True}}
    with watching(cluster) as before, httpx.Client(timeout=30) as http:
        relayed = http.post(cluster.orchestrator.url + "/v1/chat/completions", json=body).content
    (gen,) = cluster.gen.recorder.posts()[before["gen"]:]
    assert gen.done
    # Byte for byte, less the lines of token ids the orchestrator asked GEN for and strips
    # (frontend/stream_token_ids.py)
    assert b": token_ids " in gen.response_body
    assert relayed == re.sub(rb"(?m)^: token_ids [0-9,]+\n\n?", b"", gen.response_body)
    assert relayed.endswith(b"data: [DONE]\n\n")
    # CTX saw no stream options: it always answers whole.
    ctx = last_ctx_exchange(cluster, before["ctx"]).request_json()
    assert "stream_options" not in ctx
    assert gen.request_json()["stream_options"] == {"include_usage": True}


def test_whole_gen_answer_is_relayed_unchanged(cluster: Cluster) -> None:
    body = {"model": MODEL, "prompt": "abc", "max_tokens": 9}
    with watching(cluster) as before:
        relayed = httpx.post(cluster.orchestrator.url + "/v1/completions", json=body, timeout=30).content
    (gen,) = cluster.gen.recorder.posts()[before["gen"]:]
    assert relayed == gen.response_body
    assert b"disaggregated_params" not in relayed
    assert b"prompt_token_ids_b64" not in relayed


def test_the_orchestrator_never_loads_the_codec() -> None:
    package = pathlib.Path(orchestrator.__file__).parent
    sources = sorted(package.rglob("*.py"))
    modules = [".".join(s.with_suffix("").relative_to(package.parent).parts).removesuffix(".__init__")
               for s in sources]
    probe = (f"import sys, {', '.join(modules)};"
             "print(sorted(m for m in ('frontend.token_codec', 'pybase64') if m in sys.modules))")
    result = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, timeout=60, check=True)
    assert result.stdout.strip() == "[]"
    for source in sources:
        text = source.read_text()
        # Bytes may be viewed as bytes (client_body finds quotes with numpy), never as token ids.
        for forbidden in ("token_codec", "b64decode", "b64encode", "int32", "TOKEN_DTYPE", "pybase64"):
            assert forbidden not in text, f"{source.name} mentions {forbidden}"


# -- CTX finishes the request by itself ------------------------------------------------------------------------
def gen_total(cluster: Cluster) -> float:
    return total(cluster.gen.metrics, "disagg_requests_total")


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "stream"])
@pytest.mark.parametrize("endpoint", ["chat", "completions", "responses"])
def test_max_tokens_1_is_finished_by_ctx_and_never_reaches_gen(
    client: openai.OpenAI, cluster: Cluster, endpoint: str, stream: bool
) -> None:
    gen_before, gen_posts = gen_total(cluster), len(cluster.gen.recorder.posts())
    finished_before = sample(cluster.orchestrator.metrics, "disagg_ctx_finished_requests_total")
    text, finish, completion_tokens = run_one(client, endpoint, stream, max_tokens=1)
    assert text == "T"
    assert finish in ("length", "incomplete")
    assert completion_tokens == 1
    assert gen_total(cluster) == gen_before
    assert len(cluster.gen.recorder.posts()) == gen_posts
    assert sample(cluster.orchestrator.metrics, "disagg_ctx_finished_requests_total") == finished_before + 1


def run_one(client: openai.OpenAI, endpoint: str, stream: bool, max_tokens: int) -> tuple[str, str | None, int]:
    """(text, finish reason or Responses status, completion tokens), through the official client."""
    messages: Any = [{"role": "user", "content": "hello"}]
    if endpoint == "chat" and not stream:
        chat = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=max_tokens)
        assert chat.usage is not None
        assert "disaggregated_params" not in (chat.model_extra or {})
        assert "prompt_token_ids_b64" not in (chat.model_extra or {})
        assert "disaggregated_params" not in (chat.choices[0].model_extra or {})
        return chat.choices[0].message.content or "", chat.choices[0].finish_reason, chat.usage.completion_tokens
    if endpoint == "chat":
        parts, finish, tokens = [], None, -1
        for chunk in client.chat.completions.create(model=MODEL, messages=messages, max_tokens=max_tokens,
                                                    stream=True, stream_options={"include_usage": True}):
            if chunk.choices:
                parts.append(chunk.choices[0].delta.content or "")
                finish = chunk.choices[0].finish_reason or finish
            if chunk.usage:
                tokens = chunk.usage.completion_tokens
        return "".join(parts), finish, tokens
    if endpoint == "completions" and not stream:
        completion = client.completions.create(model=MODEL, prompt="hello", max_tokens=max_tokens)
        assert completion.usage is not None
        return completion.choices[0].text, completion.choices[0].finish_reason, completion.usage.completion_tokens
    if endpoint == "completions":
        parts, finish, tokens = [], None, -1
        for piece in client.completions.create(model=MODEL, prompt="hello", max_tokens=max_tokens, stream=True,
                                               stream_options={"include_usage": True}):
            if piece.choices:
                parts.append(piece.choices[0].text)
                finish = piece.choices[0].finish_reason or finish
            if piece.usage:
                tokens = piece.usage.completion_tokens
        return "".join(parts), finish, tokens
    if not stream:
        response = client.responses.create(model=MODEL, input="hello", max_output_tokens=max_tokens)
        assert response.usage is not None
        assert "disaggregated_params" not in (response.model_extra or {})
        return response.output_text, response.status, response.usage.output_tokens
    events = list(client.responses.create(model=MODEL, input="hello", max_output_tokens=max_tokens, stream=True))
    types = [e.type for e in events]
    assert types[:4] == ["response.created", "response.in_progress", "response.output_item.added",
                         "response.content_part.added"]
    assert types[-4:-1] == ["response.output_text.done", "response.content_part.done", "response.output_item.done"]
    final = events[-1]
    assert final.type in ("response.completed", "response.incomplete")
    response = final.response
    assert response.usage is not None
    return response.output_text, response.status, response.usage.output_tokens


@pytest.fixture(scope="module")
def eos_orchestrator(cluster: Cluster) -> Iterator[str]:
    """A CTX whose engine emits EOS as the very first token, in front of the shared GEN."""
    with contextlib.ExitStack() as stack:
        eos_ctx = start_worker(stack, "context", SyntheticConfig(output_tokens=0))
        yield start_orchestrator(stack, [eos_ctx.url], [cluster.gen.url]).url


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "stream"])
@pytest.mark.parametrize("endpoint", ["chat", "completions", "responses"])
def test_eos_at_the_first_token_is_finished_by_ctx(
    cluster: Cluster, eos_orchestrator: str, endpoint: str, stream: bool
) -> None:
    gen_before, gen_posts = gen_total(cluster), len(cluster.gen.recorder.posts())
    with openai.OpenAI(base_url=eos_orchestrator + "/v1", api_key="x", max_retries=0, timeout=30) as oai:
        text, finish, tokens = run_one(oai, endpoint, stream, max_tokens=50)
    assert text == ""
    assert finish in ("stop", "completed")
    assert tokens == 1
    assert gen_total(cluster) == gen_before
    assert len(cluster.gen.recorder.posts()) == gen_posts


@pytest.mark.parametrize("path", ["/v1/chat/completions", "/v1/completions"])
def test_a_ctx_finished_stream_is_a_proper_raw_sse_stream(eos_orchestrator: str, path: str) -> None:
    body: dict[str, Any] = {"model": MODEL, "max_tokens": 5, "stream": True}
    body.update({"messages": [{"role": "user", "content": "x"}]} if "chat" in path else {"prompt": "x"})
    with httpx.Client(timeout=30) as http, http.stream("POST", eos_orchestrator + path, json=body) as reply:
        assert reply.status_code == 200
        assert reply.headers["content-type"].startswith("text/event-stream")
        raw = reply.read()
    frames = raw.split(b"\n\n")
    assert frames[-1] == b""
    assert frames[-2] == b"data: [DONE]"
    chunks = [orjson.loads(f.removeprefix(b"data: ")) for f in frames[:-2]]
    assert chunks[-1]["choices"][0]["finish_reason"] == "stop"
    assert all("disaggregated_params" not in c for c in chunks)


def responses_sequence_numbers(url: str, body: dict[str, Any]) -> tuple[list[int], list[str]]:
    with httpx.Client(timeout=30) as http, http.stream("POST", url + "/v1/responses", json=body) as reply:
        assert reply.status_code == 200
        raw = reply.read()
    events = [orjson.loads(frame.partition(b"\ndata: ")[2]) for frame in raw.split(b"\n\n")[:-1]]
    return [event["sequence_number"] for event in events], [event["type"] for event in events]


@pytest.mark.parametrize("finished_by", ["max_output_tokens", "eos"])
def test_a_ctx_finished_responses_stream_numbers_its_events_in_order(
    cluster: Cluster, eos_orchestrator: str, finished_by: str
) -> None:
    url = eos_orchestrator if finished_by == "eos" else cluster.orchestrator.url
    gen_posts = len(cluster.gen.recorder.posts())
    numbers, types = responses_sequence_numbers(url, {"model": MODEL, "input": "x", "stream": True,
                                                      "max_output_tokens": 1 if finished_by != "eos" else 5})
    assert len(cluster.gen.recorder.posts()) == gen_posts  # CTX finished it: replayed, not relayed from GEN
    assert numbers == list(range(len(numbers)))
    assert types[0] == "response.created"
    assert ("response.output_text.delta" in types) is (finished_by != "eos")


# -- the list path ---------------------------------------------------------------------------------------------
IDS = [72, 101, 108, 108, 111, 44, 32, 9_999, 40_000]


def test_client_prompt_token_ids_work_through_the_orchestrator(
    client: openai.OpenAI, aggregated_client: openai.OpenAI, cluster: Cluster
) -> None:
    for oai in (client, aggregated_client):
        chat = oai.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "ignored"}],
                                           max_tokens=12, extra_body={"prompt_token_ids": IDS})
        assert chat.usage is not None
        assert chat.usage.prompt_tokens == len(IDS)
        assert chat.choices[0].message.content == synthetic_text(12)
        completion = oai.completions.create(model=MODEL, prompt=IDS, max_tokens=12)
        assert completion.usage is not None
        assert completion.usage.prompt_tokens == len(IDS)
        assert completion.choices[0].text == synthetic_text(12)


def test_ctx_turns_the_clients_list_into_the_b64_that_gen_gets(client: openai.OpenAI, cluster: Cluster) -> None:
    with watching(cluster) as before:
        client.completions.create(model=MODEL, prompt=IDS, max_tokens=4)
    ctx_answer = last_ctx_exchange(cluster, before["ctx"]).response_json()
    decoded = decode_prompt_tokens(ctx_answer["prompt_token_ids_b64"], vocab_size=50_000)
    assert decoded.tolist() == IDS
    (gen,) = cluster.gen.recorder.posts()[before["gen"]:]
    assert gen.request_json()["prompt_token_ids_b64"] == ctx_answer["prompt_token_ids_b64"]
    (request,) = gen_requests(cluster.gen, before["gen_engine"])
    assert request.prompt_path is PromptPath.ARRAY  # b64 wins over the client's list when both are present


@pytest.fixture(scope="module")
def list_orchestrator(cluster: Cluster) -> Iterator[str]:
    """An orchestrator that does not relay CTX's b64: GEN gets the client's own list."""
    with contextlib.ExitStack() as stack:
        yield start_orchestrator(stack, [cluster.ctx.url], [cluster.gen.url], gen_tokids_ctxbytes=False).url


@pytest.mark.parametrize("kind", ["chat", "completions"])
def test_gen_counts_the_list_path_when_given_a_list(cluster: Cluster, list_orchestrator: str, kind: str) -> None:
    list_before = sample(cluster.gen.metrics, "disagg_gen_prompt_path_total", path="list")
    array_before = sample(cluster.gen.metrics, "disagg_gen_prompt_path_total", path="array")
    with watching(cluster) as before, openai.OpenAI(base_url=list_orchestrator + "/v1", api_key="x",
                                                     max_retries=0) as oai:
        if kind == "chat":
            text = oai.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "x"}],
                                               max_tokens=6, extra_body={"prompt_token_ids": IDS}
                                               ).choices[0].message.content
        else:
            text = oai.completions.create(model=MODEL, prompt=IDS, max_tokens=6).choices[0].text
    assert text == synthetic_text(6)
    assert sample(cluster.gen.metrics, "disagg_gen_prompt_path_total", path="list") == list_before + 1
    assert sample(cluster.gen.metrics, "disagg_gen_prompt_path_total", path="array") == array_before
    ctx_answer = last_ctx_exchange(cluster, before["ctx"]).response_json()
    assert "prompt_token_ids_b64" not in ctx_answer  # not asked for
    (gen,) = cluster.gen.recorder.posts()[before["gen"]:]
    assert "prompt_token_ids_b64" not in gen.request_json()
    (request,) = gen_requests(cluster.gen, before["gen_engine"])
    assert request.prompt_path is PromptPath.LIST
    assert request.prompt_token_ids == IDS


# -- metadata-only ---------------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def metadata_only(cluster: Cluster) -> Iterator[Node]:
    with contextlib.ExitStack() as stack:
        yield start_orchestrator(stack, [cluster.ctx.url], [cluster.gen.url], gen_tokids_metadata_only=True)


def test_metadata_only_sends_gen_just_prompt_len(cluster: Cluster, metadata_only: Node) -> None:
    before_path = sample(cluster.gen.metrics, "disagg_gen_prompt_path_total", path="metadata_only")
    with watching(cluster) as before, openai.OpenAI(base_url=metadata_only.url + "/v1", api_key="x",
                                                     max_retries=0) as oai:
        chat = oai.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "y" * 3000}],
                                           max_tokens=20)
    assert chat.choices[0].message.content == synthetic_text(20)
    (gen,) = cluster.gen.recorder.posts()[before["gen"]:]
    body = gen.request_json()
    assert "prompt_token_ids_b64" not in body
    assert chat.usage is not None
    assert body["disaggregated_params"]["prompt_len"] == chat.usage.prompt_tokens
    assert sample(cluster.gen.metrics, "disagg_gen_prompt_path_total", path="metadata_only") == before_path + 1
    (request,) = gen_requests(cluster.gen, before["gen_engine"])
    assert request.prompt_is_placeholder
    assert request.prompt_list_built is False


def test_metadata_only_falls_back_to_real_tokens_for_value_readers(cluster: Cluster, metadata_only: Node) -> None:
    fallback_before = sample(metadata_only.metrics, "disagg_metadata_only_fallback_total",
                             reason="frequency_penalty")
    with watching(cluster) as before, openai.OpenAI(base_url=metadata_only.url + "/v1", api_key="x",
                                                     max_retries=0) as oai:
        oai.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "z"}], max_tokens=3,
                                    frequency_penalty=0.5)
    assert sample(metadata_only.metrics, "disagg_metadata_only_fallback_total",
                  reason="frequency_penalty") == fallback_before + 1
    (gen,) = cluster.gen.recorder.posts()[before["gen"]:]
    assert "prompt_token_ids_b64" in gen.request_json()
    (request,) = gen_requests(cluster.gen, before["gen_engine"])
    assert request.prompt_path is PromptPath.ARRAY


def test_gen_engine_facts_come_from_the_gen_worker(cluster: Cluster, metadata_only: Node) -> None:
    (worker,) = metadata_only.app.state.flow.gen_pool.workers
    assert worker.healthy is True
    info = cluster.gen.app.state.service.engine.info
    assert worker.facts.kv_block_reuse is info.kv_block_reuse
    assert worker.facts.prompt_tokens_in_handoff is info.prompt_tokens_in_handoff


# -- retries ---------------------------------------------------------------------------------------------------
def test_a_gen_that_went_away_is_retried_on_another_and_leaves_routing(cluster: Cluster) -> None:
    doomed = ServerThread(create_worker_app(RecordingEngine(), WorkerSettings(role="generation")))
    doomed_url = doomed.start()
    stopped = False
    try:
        with contextlib.ExitStack() as stack:
            orch = start_orchestrator(stack, [cluster.ctx.url], [doomed_url, cluster.gen.url],
                                      health_check_interval_s=3600)
            flow = orch.app.state.flow
            assert all(w.healthy for w in flow.gen_pool.workers)
            doomed.stop()
            stopped = True
            with openai.OpenAI(base_url=orch.url + "/v1", api_key="x", max_retries=0) as oai:
                texts = [oai.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "r"}],
                                                     max_tokens=4).choices[0].message.content for _ in range(4)]
                streamed = "".join(c.choices[0].delta.content or "" for c in oai.chat.completions.create(
                    model=MODEL, messages=[{"role": "user", "content": "r"}], max_tokens=4, stream=True)
                    if c.choices)
            assert texts == [synthetic_text(4)] * 4
            assert streamed == synthetic_text(4)
            assert total(orch.metrics, "disagg_upstream_retries_total") == 1
            assert [w.healthy for w in flow.gen_pool.workers] == [False, True]
    finally:
        if not stopped:
            doomed.stop()


def test_a_prompt_array_decoded_by_the_test_matches_what_ctx_tokenized(cluster: Cluster) -> None:
    # A sanity anchor for the relay tests: the codec of the test side agrees with CTX's tokenizer.
    body = {"model": MODEL, "prompt": "héllo", "max_tokens": 2}
    with watching(cluster) as before:
        httpx.post(cluster.orchestrator.url + "/v1/completions", json=body, timeout=30)
    answer = last_ctx_exchange(cluster, before["ctx"]).response_json()
    tokens = decode_prompt_tokens(answer["prompt_token_ids_b64"], vocab_size=50_000)
    np.testing.assert_array_equal(tokens, np.frombuffer("héllo".encode(), dtype=np.uint8))


def test_without_relayed_tokens_gen_tokenizes_the_text_itself(cluster: Cluster, list_orchestrator: str) -> None:
    text_before = sample(cluster.gen.metrics, "disagg_gen_prompt_path_total", path="text")
    with watching(cluster) as before, openai.OpenAI(base_url=list_orchestrator + "/v1", api_key="x",
                                                     max_retries=0) as oai:
        chat = oai.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "plain text"}],
                                           max_tokens=6)
    assert chat.choices[0].message.content == synthetic_text(6)
    assert sample(cluster.gen.metrics, "disagg_gen_prompt_path_total", path="text") == text_before + 1
    (gen,) = cluster.gen.recorder.posts()[before["gen"]:]
    body = gen.request_json()
    assert "prompt_token_ids_b64" not in body
    assert "prompt_len" not in body["disaggregated_params"]
    (request,) = gen_requests(cluster.gen, before["gen_engine"])
    assert request.prompt_path is PromptPath.TEXT

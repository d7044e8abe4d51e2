"""The reference engine's adapter and hand-off, on the tiny model, through real servers and core processes."""

from __future__ import annotations

import asyncio
import contextlib
import pathlib
from collections.abc import Iterator
from typing import Any

import httpx
import numpy as np
import openai
import pytest
from openai.types.chat import ChatCompletionMessageParam

from frontend.errors import EngineError
from frontend.sampling import SamplingParams
from frontend.token_codec import TOKEN_DTYPE
from tests.waiting import eventually, eventually_async
from tests.workers.engines.reference.cluster import RefCluster, reference_cluster, start_reference_worker
from tests.workers.engines.reference.ledger import ADMIN_KEY, assert_ledger_balances, handoff_ledger
from tests.workers.engines.reference.tiny_model import write_tiny_model
from workers.engines.reference.engine import ReferenceEngine
from workers.engines.reference.options import ReferenceOptions
from workers.engines.request import GenerationRequest, Phase

MESSAGES: list[ChatCompletionMessageParam] = [{"role": "user", "content": "What is the capital of France?"}]


@pytest.fixture(scope="module")
def tiny_options(tiny_path: pathlib.Path) -> ReferenceOptions:
    return ReferenceOptions(model_path=str(tiny_path), served_model_name="tiny", blas_threads=1)


@pytest.fixture(scope="module")
def tiny_cluster(tiny_options: ReferenceOptions) -> Iterator[RefCluster]:
    with reference_cluster(tiny_options) as cluster:
        yield cluster


def _context_step(cluster: RefCluster, **extra: Any) -> dict[str, Any]:
    body = {"model": cluster.model, "messages": MESSAGES, "max_tokens": 8, "temperature": 0,
            "disaggregated_params": {"request_type": "context_only", "disagg_request_id": 1,
                                     "return_prompt_token_ids_b64": True,
                                     "native_extensions": True},  # as our orchestrator asks
            **extra}
    reply = httpx.post(cluster.ctx.url + "/v1/chat/completions", json=body, timeout=60)
    assert reply.status_code == 200, reply.text
    result: dict[str, Any] = reply.json()
    return result


def _generation_step(cluster: RefCluster, ctx: dict[str, Any], **params: Any) -> httpx.Response:
    disagg = {**ctx["choices"][0]["disaggregated_params"], "request_type": "generation_only", **params}
    body = {"model": cluster.model, "messages": MESSAGES, "max_tokens": 8, "temperature": 0,
            "disaggregated_params": disagg, "prompt_token_ids_b64": ctx["prompt_token_ids_b64"]}
    return httpx.post(cluster.gen.url + "/v1/chat/completions", json=body, timeout=60)


async def _no_active_requests(engine: ReferenceEngine) -> bool:
    return await engine.active_requests() == 0


def _kv_entries(node_url: str) -> float:
    text = httpx.get(node_url + "/metrics", timeout=10).text
    line = next(line for line in text.splitlines() if line.startswith("disagg_kv_store_entries "))
    return float(line.split()[1])


def test_disaggregated_equals_aggregated_on_the_tiny_model(tiny_cluster: RefCluster) -> None:
    cases: list[dict[str, Any]] = [
        {"temperature": 0},
        {"temperature": 0, "extra_body": {"repetition_penalty": 1.3}, "frequency_penalty": 0.5,
         "presence_penalty": 0.3},
        {"temperature": 0.9, "top_p": 0.9, "extra_body": {"top_k": 20}, "seed": 7},
        {"temperature": 0, "logprobs": True, "top_logprobs": 3},
    ]
    with tiny_cluster.orchestrator.client() as disagg, tiny_cluster.aggregated.client() as agg:
        for case in cases:
            a = disagg.chat.completions.create(model=tiny_cluster.model, messages=MESSAGES, max_tokens=12, **case)
            b = agg.chat.completions.create(model=tiny_cluster.model, messages=MESSAGES, max_tokens=12, **case)
            assert a.choices[0].message.content == b.choices[0].message.content, case
            assert a.usage == b.usage
            if case.get("logprobs"):
                assert a.choices[0].logprobs == b.choices[0].logprobs


def test_kv_store_is_empty_after_requests_complete(tiny_cluster: RefCluster) -> None:
    with tiny_cluster.orchestrator.client() as client:
        for stream in (False, True):
            result = client.completions.create(model=tiny_cluster.model, prompt="Hello", max_tokens=5,
                                               temperature=0, stream=stream)
            if stream:
                list(result)
    assert eventually(lambda: _kv_entries(tiny_cluster.ctx.url) == 0)


def test_a_replayed_handoff_is_refused(tiny_cluster: RefCluster) -> None:
    ctx = _context_step(tiny_cluster)
    assert _kv_entries(tiny_cluster.ctx.url) == 1
    first = _generation_step(tiny_cluster, ctx)
    assert first.status_code == 200, first.text
    replay = _generation_step(tiny_cluster, ctx)
    assert replay.status_code == 400
    error = replay.json()["error"]
    assert error["code"] == "invalid_handoff"
    assert "already taken" in error["message"]
    assert _kv_entries(tiny_cluster.ctx.url) == 0
    assert_ledger_balances(tiny_cluster.ctx.url)


def test_a_tampered_key_is_refused_and_the_entry_survives_for_the_real_key(tiny_cluster: RefCluster) -> None:
    import orjson
    import pybase64

    ctx = _context_step(tiny_cluster)
    params = ctx["choices"][0]["disaggregated_params"]
    state = orjson.loads(pybase64.b64decode(params["encoded_opaque_state"]))
    forged = pybase64.b64encode(orjson.dumps({**state, "key": "not-the-key"})).decode()
    refused = _generation_step(tiny_cluster, ctx, encoded_opaque_state=forged)
    assert refused.status_code == 400
    assert "wrong key" in refused.json()["error"]["message"]
    assert _generation_step(tiny_cluster, ctx).status_code == 200
    assert_ledger_balances(tiny_cluster.ctx.url)


def test_a_handoff_for_another_prompt_length_is_refused(tiny_cluster: RefCluster) -> None:
    ctx = _context_step(tiny_cluster)
    tokens = np.frombuffer(__import__("pybase64").b64decode(ctx["prompt_token_ids_b64"]), TOKEN_DTYPE)
    shorter = __import__("frontend.token_codec").token_codec.encode_prompt_tokens(tokens[:-1])
    disagg = {**ctx["choices"][0]["disaggregated_params"], "request_type": "generation_only",
              "prompt_len": int(tokens.size) - 1}
    body = {"model": tiny_cluster.model, "messages": MESSAGES, "max_tokens": 8,
            "disaggregated_params": disagg, "prompt_token_ids_b64": shorter}
    reply = httpx.post(tiny_cluster.gen.url + "/v1/chat/completions", json=body, timeout=60)
    assert reply.status_code == 400
    assert reply.json()["error"]["code"] == "invalid_handoff"
    assert _generation_step(tiny_cluster, ctx).status_code == 200  # refusing it did not consume it
    assert_ledger_balances(tiny_cluster.ctx.url)


def test_a_handoff_from_another_model_is_refused(tiny_cluster: RefCluster, tmp_path: pathlib.Path) -> None:
    other = write_tiny_model(tmp_path / "other.gguf", seed=1)
    options = ReferenceOptions(model_path=str(other), served_model_name="tiny", blas_threads=1)
    ctx = _context_step(tiny_cluster)
    with contextlib.ExitStack() as stack:
        other_gen = start_reference_worker(stack, "generation", options)
        disagg = {**ctx["choices"][0]["disaggregated_params"], "request_type": "generation_only"}
        body = {"model": "tiny", "messages": MESSAGES, "max_tokens": 8, "disaggregated_params": disagg,
                "prompt_token_ids_b64": ctx["prompt_token_ids_b64"]}
        reply = httpx.post(other_gen.url + "/v1/chat/completions", json=body, timeout=60)
    assert reply.status_code == 400
    assert "different model" in reply.json()["error"]["message"]
    assert _generation_step(tiny_cluster, ctx).status_code == 200


def test_an_unused_handoff_expires(tiny_path: pathlib.Path) -> None:
    options = ReferenceOptions(model_path=str(tiny_path), served_model_name="tiny", blas_threads=1, kv_ttl_s=0.5)
    with reference_cluster(options) as cluster:
        ctx = _context_step(cluster)
        assert _kv_entries(cluster.ctx.url) == 1
        assert eventually(lambda: _kv_entries(cluster.ctx.url) == 0)
        expired = _generation_step(cluster, ctx)
        assert expired.status_code == 400
        assert "expired" in expired.json()["error"]["message"]
        assert assert_ledger_balances(cluster.ctx.url)["totals"]["expired"] == 1


def test_a_stop_string_hit_at_ctx_frees_the_parked_kv(tiny_cluster: RefCluster) -> None:
    with tiny_cluster.aggregated.client() as agg:
        text = agg.chat.completions.create(model=tiny_cluster.model, messages=MESSAGES, max_tokens=1,
                                           temperature=0).choices[0].message.content
    assert text
    ctx = _context_step(tiny_cluster, stop=[text[:1]])
    assert ctx["choices"][0]["finish_reason"] == "stop"
    assert ctx["choices"][0]["disaggregated_params"]["encoded_opaque_state"] is None
    assert eventually(lambda: _kv_entries(tiny_cluster.ctx.url) == 0)
    assert_ledger_balances(tiny_cluster.ctx.url)


# Biases that leave the tiny model three first tokens of about equal chance: EOS (<|im_end|>, id 2), "a" and "b"
# (id 3 + byte). With the stop string "a", a sequence whose first token is "a" ends on the stop string in CTX (the
# worker sees it, the engine does not), one on EOS ends in the engine, one on "b" continues on GEN. Sequence i draws
# as a lone request seeded seed + i; the lone first tokens of seeds 0..10 are b a EOS EOS b b a b a b b.
ENDINGS_BIAS = {"2": 96, str(3 + ord("a")): 100, str(3 + ord("b")): 99}
FIRST = {"a": ("a", "length"), "b": ("b", "length"), "EOS": ("", "stop")}  # max_tokens 1, no stop string


@pytest.mark.parametrize(("seed", "firsts", "max_tokens", "continues"), [
    (1, ("a", "EOS"), 6, False),  # stop string, then EOS: CTX parked for the first, which it then finished
    (2, ("EOS", "EOS"), 6, False),  # EOS only: the engine never parks
    (1, ("a", "EOS", "EOS"), 6, False),
    (0, ("b", "a", "EOS"), 1, False),  # length, stop string, EOS: max_tokens 1 ends every sequence in CTX
    (6, ("a", "b"), 6, True),  # one ends on the stop string, one continues on GEN
    (10, ("b", "EOS"), 6, True),  # one continues, one ends on EOS
    (0, ("b", "a", "EOS"), 6, True),  # continues, stop string, EOS
], ids=["stop-eos", "eos-eos", "stop-eos-eos", "length-stop-eos", "stop-continues", "continues-eos",
        "continues-stop-eos"])
def test_the_ledger_balances_whatever_mix_of_endings_ctx_meets(tiny_cluster: RefCluster, seed: int,
                                                               firsts: tuple[str, ...], max_tokens: int,
                                                               continues: bool) -> None:
    """When CTX ends every sequence itself, nothing stays parked (no one could release it: its answer carries no
    hand-off); when one continues, the hand-off stays parked for GEN, which takes it."""
    body: dict[str, Any] = {"model": tiny_cluster.model, "messages": MESSAGES, "n": len(firsts), "temperature": 1.0,
                            "seed": seed, "logit_bias": ENDINGS_BIAS}
    with tiny_cluster.aggregated.client() as agg:
        alone = agg.chat.completions.create(**body, max_tokens=1)
    assert [(c.message.content, c.finish_reason) for c in alone.choices] == [FIRST[f] for f in firsts]
    before = assert_ledger_balances(tiny_cluster.ctx.url)["totals"]
    gen_calls = tiny_cluster.gen.recorder.count() if tiny_cluster.gen.recorder else 0
    body.update(max_tokens=max_tokens, stop=["a"])
    with tiny_cluster.orchestrator.client() as disagg, tiny_cluster.aggregated.client() as agg:
        disaggregated = disagg.chat.completions.create(**body)
        aggregated = agg.chat.completions.create(**body)
    assert [(c.message.content, c.finish_reason) for c in disaggregated.choices] == \
        [(c.message.content, c.finish_reason) for c in aggregated.choices]
    after = assert_ledger_balances(tiny_cluster.ctx.url)["totals"]
    assert after["expired"] == before["expired"]
    assert tiny_cluster.gen.recorder is not None
    if continues:
        assert after["parked"] == before["parked"] + 1 and after["taken"] == before["taken"] + 1
        assert after["released"] == before["released"]
        assert tiny_cluster.gen.recorder.count() == gen_calls + 1
    else:
        assert after["taken"] == before["taken"]  # whatever CTX parked, it released itself
        assert tiny_cluster.gen.recorder.count() == gen_calls


async def test_closing_the_stream_early_aborts_the_request_in_the_core(tiny_options: ReferenceOptions) -> None:
    engine = ReferenceEngine(tiny_options)
    await engine.start()
    try:
        prompt = engine.get_tokenizer().encode("Once upon a time")
        request = GenerationRequest("r1", prompt, SamplingParams(max_tokens=400, temperature=0, ignore_eos=True))
        outputs = engine.generate(request)
        received = [await anext(outputs) for _ in range(3)]
        assert all(len(o.token_ids) == 1 for o in received)
        assert await engine.active_requests() == 1
        await outputs.aclose()
        assert await eventually_async(lambda: _no_active_requests(engine))
        assert not request.prompt_list_built  # the prompt crossed to the core as raw int32 bytes
    finally:
        await engine.aclose()
    assert not await engine.health()


async def test_requests_are_interleaved_so_a_long_one_does_not_starve_a_short_one(
    tiny_options: ReferenceOptions,
) -> None:
    engine = ReferenceEngine(tiny_options)
    await engine.start()
    try:
        prompt = engine.get_tokenizer().encode("Tell me a story")
        long = GenerationRequest("long", prompt, SamplingParams(max_tokens=450, temperature=0, ignore_eos=True))
        short = GenerationRequest("short", prompt, SamplingParams(max_tokens=5, temperature=0, ignore_eos=True))
        order: list[str] = []
        long_started = asyncio.Event()

        async def consume(request: GenerationRequest) -> None:
            async for output in engine.generate(request):
                long_started.set()
                if output.finish_reason is not None:
                    order.append(request.request_id)

        long_task = asyncio.create_task(consume(long))
        await long_started.wait()  # the long request is decoding when the short one arrives
        await consume(short)
        await long_task
        assert order == ["short", "long"]
    finally:
        await engine.aclose()


async def test_a_context_only_request_parks_its_kv_and_reports_the_handoff(tiny_options: ReferenceOptions) -> None:
    engine = ReferenceEngine(tiny_options)
    await engine.start()
    try:
        prompt = engine.get_tokenizer().encode("Hello there")
        request = GenerationRequest("c1", prompt, SamplingParams(max_tokens=4, temperature=0),
                                    phase=Phase.CONTEXT_ONLY)
        outputs = [o async for o in engine.generate(request)]
        assert len(outputs) == 1 and len(outputs[0].token_ids) == 1
        assert outputs[0].handoff_state is not None
        assert await eventually_async(lambda: engine.kv_store_stats()[0] == 1)
        await engine.abort("c1")  # aborting a parked request frees its hand-off
        assert await eventually_async(lambda: engine.kv_store_stats() == (0, 0))
    finally:
        await engine.aclose()


async def test_a_missing_model_file_fails_start_up_with_a_clear_error(tmp_path: pathlib.Path) -> None:
    engine = ReferenceEngine(ReferenceOptions(model_path=str(tmp_path / "missing.gguf"), startup_timeout_s=60))
    with pytest.raises(EngineError, match=r"missing\.gguf does not exist"):
        await engine.start()
    assert not await engine.health()


def test_openai_client_streams_from_the_reference_worker(tiny_cluster: RefCluster) -> None:
    with tiny_cluster.orchestrator.client() as client, tiny_cluster.aggregated.client() as agg:
        chunks = client.chat.completions.create(model=tiny_cluster.model, messages=MESSAGES, max_tokens=10,
                                                temperature=0, stream=True)
        streamed = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
        whole = agg.chat.completions.create(model=tiny_cluster.model, messages=MESSAGES, max_tokens=10,
                                            temperature=0)
    assert streamed == whole.choices[0].message.content
    _ = openai  # the official client is the client in every test here


async def test_kv_block_reuse_serves_a_repeated_prefix_from_the_cache(tiny_path: pathlib.Path) -> None:
    engine = ReferenceEngine(ReferenceOptions(model_path=str(tiny_path), blas_threads=1, kv_block_reuse=True))
    await engine.start()
    try:
        assert engine.info.kv_block_reuse
        prompt = engine.get_tokenizer().encode("A long shared system prompt that repeats across requests. " * 3)
        texts = []
        for request_id in ("first", "second"):
            request = GenerationRequest(request_id, prompt, SamplingParams(max_tokens=6, temperature=0))
            texts.append([t for o in [o async for o in engine.generate(request)] for t in o.token_ids])
        stats = await engine.core_stats()
        assert stats["prefix_cache_blocks"] >= prompt.size // 16
        assert stats["prefix_cache_hit_tokens"] >= 16 * ((prompt.size - 1) // 16)
        assert texts[0] == texts[1]
    finally:
        await engine.aclose()


def test_a_parked_handoff_is_released_only_with_its_key(tiny_cluster: RefCluster) -> None:
    import orjson
    import pybase64

    ctx = _context_step(tiny_cluster)
    params = ctx["choices"][0]["disaggregated_params"]
    state = orjson.loads(pybase64.b64decode(params["encoded_opaque_state"]))
    forged = pybase64.b64encode(orjson.dumps({**state, "key": "guess"})).decode()
    release = tiny_cluster.ctx.url + "/v1/disagg/release"
    refused = httpx.post(release, json={"ctx_request_id": params["ctx_request_id"], "encoded_opaque_state": forged})
    assert refused.status_code == 200 and refused.json() == {"released": False}
    assert _kv_entries(tiny_cluster.ctx.url) == 1
    released = httpx.post(release, json={"ctx_request_id": params["ctx_request_id"],
                                         "encoded_opaque_state": params["encoded_opaque_state"]})
    assert released.json() == {"released": True}
    assert eventually(lambda: _kv_entries(tiny_cluster.ctx.url) == 0)
    assert_ledger_balances(tiny_cluster.ctx.url)


def test_the_orchestrator_frees_ctx_kv_when_gen_refuses_the_request(tiny_path: pathlib.Path,
                                                                    tmp_path: pathlib.Path) -> None:
    """GEN runs another model, so it refuses the hand-off without taking it: CTX's KV is freed at once."""
    options = ReferenceOptions(model_path=str(tiny_path), served_model_name="tiny", blas_threads=1, kv_ttl_s=600)
    other = ReferenceOptions(model_path=str(write_tiny_model(tmp_path / "other.gguf", seed=3)),
                             served_model_name="tiny", blas_threads=1)
    with reference_cluster(options, gen_options=other) as cluster, cluster.orchestrator.client() as client:
        with pytest.raises(openai.BadRequestError, match="different model"):
            client.chat.completions.create(model="tiny", messages=MESSAGES, max_tokens=8)
        assert eventually(lambda: _kv_entries(cluster.ctx.url) == 0)
        assert assert_ledger_balances(cluster.ctx.url)["totals"]["released"] == 1


def test_the_handoff_ledger_lists_what_is_parked_with_its_age_and_size(tiny_cluster: RefCluster) -> None:
    before = assert_ledger_balances(tiny_cluster.ctx.url)["totals"]
    ctx = _context_step(tiny_cluster)
    params = ctx["choices"][0]["disaggregated_params"]
    ledger = handoff_ledger(tiny_cluster.ctx.url)
    (parked,) = ledger["parked_now"]
    assert parked["ctx_request_id"] == params["ctx_request_id"]
    assert parked["bytes"] > 0 and parked["bytes"] == ledger["parked_bytes"]
    assert parked["age_s"] >= 0 and parked["expires_in_s"] > 0
    assert ledger["totals"]["parked"] == before["parked"] + 1
    assert _generation_step(tiny_cluster, ctx).status_code == 200
    after = assert_ledger_balances(tiny_cluster.ctx.url)["totals"]
    assert after["taken"] == before["taken"] + 1
    metrics = httpx.get(tiny_cluster.ctx.url + "/metrics", timeout=10).text
    assert f'disagg_kv_handoffs_total{{outcome="taken"}} {float(after["taken"])}' in metrics
    assert f'disagg_kv_handoffs_total{{outcome="parked"}} {float(after["parked"])}' in metrics


def test_a_fresh_worker_exports_its_handoff_outcomes_and_prompt_paths_at_zero(tiny_options: ReferenceOptions) -> None:
    """Before its first request (a dashboard over a fresh system shows zeros, not "No data")."""
    with contextlib.ExitStack() as stack:
        ctx = start_reference_worker(stack, "context", tiny_options)
        gen = start_reference_worker(stack, "generation", tiny_options)
        scraped = {node.url: httpx.get(node.url + "/metrics", timeout=10).text for node in (ctx, gen)}
    for text in scraped.values():  # each has a KV store (a GEN's stays empty, and says so)
        for outcome in ("parked", "taken", "released", "expired"):
            assert f'disagg_kv_handoffs_total{{outcome="{outcome}"}} 0.0' in text, outcome
    for path in ("array", "list", "metadata_only", "text"):
        assert f'disagg_gen_prompt_path_total{{path="{path}"}} 0.0' in scraped[gen.url], path
    assert "disagg_gen_prompt_path_total{" not in scraped[ctx.url]  # a CTX worker takes no generation_only request


def test_the_handoff_ledger_is_admin_only(tiny_cluster: RefCluster, tiny_options: ReferenceOptions) -> None:
    url = tiny_cluster.ctx.url + "/v1/disagg/handoffs"
    wrong = httpx.get(url, headers={"Authorization": "Bearer not-" + ADMIN_KEY}, timeout=10)
    assert wrong.status_code == 401 and wrong.json()["error"]["type"]
    assert httpx.get(url, timeout=10).status_code == 401
    with contextlib.ExitStack() as stack:
        keyless = start_reference_worker(stack, "context", tiny_options, admin_key=None)
        shut = httpx.get(keyless.url + "/v1/disagg/handoffs", headers={"Authorization": f"Bearer {ADMIN_KEY}"},
                         timeout=10)
    assert shut.status_code == 403
    assert shut.json()["error"]["code"] == "admin_disabled"

"""The model of a worker's prefix cache for a worker that publishes nothing: what was sent there, least recently
used first, bounded by the worker's capacity, corrected by what its answers say it found cached."""

from __future__ import annotations

import asyncio
from typing import Any

from frontend.prefix_chain import chain_of
from orchestrator.cache_index import CacheIndex
from orchestrator.sent_cache import SentCacheModel, answer_cached_tokens, card_capacity_tokens, vllm_capacity_tokens
from orchestrator.upstream.base import WorkerTimeouts
from orchestrator.upstream.choice import make_transport
from tests.servers import running

SYSTEM = b"s" * 4096


def conversation(n: int, size: int = 4096) -> bytes:
    return f"conversation {n}: ".encode() + b"u" * size


def covered(model: SentCacheModel, chain_links: tuple[int, ...]) -> int:
    return sum(model.holds(link) for link in chain_links)


def test_it_holds_what_was_sent_until_the_capacity_is_spent_oldest_first() -> None:
    model = SentCacheModel(capacity_tokens=16_384)
    model.bytes_per_token = 1.0  # one byte a token: capacity 16 KiB of prompt text
    first = chain_of([SYSTEM, conversation(0)])
    model.note(first)
    assert covered(model, first.links) == len(first.links)
    for n in range(1, 4):  # 12 KiB more: the shared system prompt is touched by every one, conversation 0 not
        model.note(chain_of([SYSTEM, conversation(n)]))
    assert model.held_bytes <= 16_384
    assert all(model.holds(link) for link in chain_of([SYSTEM]).links)  # recently used: kept
    assert not model.holds(first.links[-1])  # the oldest conversation's tail went first


def test_what_it_holds_stays_prefix_closed() -> None:
    model = SentCacheModel(capacity_tokens=10_000)
    model.bytes_per_token = 1.0
    chain = chain_of([SYSTEM, conversation(0, 8192)])
    model.note(chain)  # more than it keeps: the tail goes, the head stays
    held = [model.holds(link) for link in chain.links]
    assert held[0] and not held[-1]
    assert held == sorted(held, reverse=True)  # no held link after one that is not


def test_an_answer_with_fewer_cached_tokens_than_predicted_lowers_what_it_counts_on() -> None:
    model = SentCacheModel(capacity_tokens=64_000)
    chain = chain_of([SYSTEM, conversation(0)])
    model.note(chain)
    model.learn(chain, chain.total_bytes, len(chain.links), None)  # an exact length: one byte a token
    assert 0.99 < model.bytes_per_token < 4.0  # moving from the default 4 towards the measured 1
    for _ in range(60):
        model.learn(chain, chain.total_bytes, 0, None)
    assert abs(model.bytes_per_token - 1.0) < 0.01
    before = model.capacity_bytes
    model.learn(chain, chain.total_bytes, len(chain.links), cached_tokens=0)  # it held none of what we thought
    assert model.share < 1.0 and model.capacity_bytes < before
    lowered = model.share
    model.learn(chain, chain.total_bytes, len(chain.links), cached_tokens=chain.total_bytes)  # confirmed
    assert lowered < model.share <= 1.0


def test_a_miss_within_a_link_is_no_miss() -> None:
    model = SentCacheModel(capacity_tokens=64_000)
    model.bytes_per_token = 1.0
    chain = chain_of([SYSTEM, conversation(0)])
    model.note(chain)
    # the engine counts whole blocks and stops short of the prompt's unnamed tail: a few tokens under
    model.learn(chain, None, len(chain.links), cached_tokens=chain.covered_bytes(len(chain.links)) - 100)
    assert model.share == 1.0


def test_misses_never_take_the_whole_capacity() -> None:
    model = SentCacheModel(capacity_tokens=8_192)
    model.bytes_per_token = 1.0
    chain = chain_of([SYSTEM, conversation(0)])
    for _ in range(100):
        model.note(chain)
        model.learn(chain, None, len(chain.links), cached_tokens=0)
    assert model.share > 0


def test_the_capacity_a_card_says() -> None:
    assert card_capacity_tokens({"engine_info": {"kv_capacity_tokens": 131_072}}) == 131_072
    assert card_capacity_tokens({"engine_info": {"kv_events": {"capacity_tokens": 4096}}}) == 4096
    cards: tuple[object, ...] = ({}, {"engine_info": {}}, {"engine_info": {"kv_capacity_tokens": 0}},
                                 {"engine_info": {"kv_capacity_tokens": True}}, {"engine_info": "x"}, None, [])
    for card in cards:
        assert card_capacity_tokens(card) is None


def test_the_cached_tokens_an_answer_says() -> None:
    assert answer_cached_tokens({}, {"cached_tokens": 512}) == 512  # our workers' hand-off
    usage = {"usage": {"prompt_tokens": 900, "prompt_tokens_details": {"cached_tokens": 640}}}
    assert answer_cached_tokens(usage, {}) == 640  # OpenAI's usage (vLLM with prompt tokens details)
    assert answer_cached_tokens({"usage": {"prompt_tokens_details": {"cached_tokens": 0}}}, {}) == 0
    for response in ({}, {"usage": None}, {"usage": {"prompt_tokens_details": None}},
                     {"usage": {"prompt_tokens_details": {"cached_tokens": -1}}},
                     {"usage": {"prompt_tokens_details": {"cached_tokens": "12"}}}):
        assert answer_cached_tokens(response, {}) is None


VLLM_METRICS = (
    '# HELP vllm:cache_config_info Information of the LLMEngine CacheConfig\n'
    '# TYPE vllm:cache_config_info gauge\n'
    'vllm:cache_config_info{block_size="16",cache_dtype="auto",enable_prefix_caching="True",engine="0",'
    'gpu_memory_utilization="0.9",num_cpu_blocks="None",num_gpu_blocks="27000",prefix_caching_hash_algo="sha256"}'
    ' 1.0\n'
    'vllm:num_requests_running{engine="0",model_name="m"} 0.0\n')


def test_a_vllm_servers_capacity_from_its_metrics() -> None:
    assert vllm_capacity_tokens(VLLM_METRICS) == 27_000 * 16
    assert vllm_capacity_tokens(VLLM_METRICS.replace('enable_prefix_caching="True"',
                                                     'enable_prefix_caching="False"')) is None
    assert vllm_capacity_tokens(VLLM_METRICS.replace('num_gpu_blocks="27000"', 'num_gpu_blocks="None"')) is None
    assert vllm_capacity_tokens("vllm:num_requests_running 0.0\n") is None


async def _metrics_app(scope: dict[str, Any], receive: Any, send: Any) -> None:
    """A vLLM server's /metrics, as far as the index reads it."""
    if scope["type"] != "http":
        return
    found = scope["path"] == "/metrics"
    await send({"type": "http.response.start", "status": 200 if found else 404,
                "headers": [(b"content-type", b"text/plain")]})
    await send({"type": "http.response.body", "body": VLLM_METRICS.encode() if found else b""})


def test_the_index_reads_a_vllm_workers_capacity_over_http() -> None:
    with running(_metrics_app) as url:
        async def describe() -> tuple[float, float]:
            index = CacheIndex(kv_capacity_tokens=1_000)
            transport = make_transport(url, WorkerTimeouts())
            try:
                await index.describe(url, {"id": "m", "owned_by": "vllm"}, transport)
                await index.describe("http://other", {"id": "m", "owned_by": "someone"}, transport)
            finally:
                await transport.aclose()
            vllm, other = index._of(url).model, index._of("http://other").model
            return vllm.capacity_tokens, other.capacity_tokens

        assert asyncio.run(describe()) == (27_000 * 16, 1_000)

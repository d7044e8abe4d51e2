"""The reference engine's KV capacity (``ReportsKvCapacity``): with ``--kv-block-reuse`` its prefix cache's byte
budget in whole blocks of the model's KV; without it, none. A worker in front of it then publishes what it
holds (the tiny model, a real engine core process, a real ZMQ subscriber)."""

from __future__ import annotations

import contextlib
import pathlib
from collections.abc import Iterator
from dataclasses import replace

import httpx
import pytest

from frontend.kv_events import BlockStored, EventSubscriber, KVCacheEvent
from frontend.prefix_chain import CHAIN_HEADER, chain_of
from tests.servers import running
from tests.waiting import eventually_async
from workers.engines.base import ReportsKvCapacity
from workers.engines.reference.engine import ReferenceEngine
from workers.engines.reference.model_file import load_model_file
from workers.engines.reference.options import ReferenceOptions
from workers.engines.reference.prefix_cache import BLOCK_TOKENS, capacity_tokens
from workers.server import create_worker_app
from workers.settings import WorkerSettings


@pytest.fixture(scope="module")
def options(tiny_path: pathlib.Path) -> ReferenceOptions:
    return ReferenceOptions(model_path=str(tiny_path), served_model_name="tiny", blas_threads=1,
                            kv_block_reuse=True, kv_block_reuse_bytes=8 * 1024**2)


def test_capacity_is_the_budget_in_whole_blocks_of_kv(tiny_path: pathlib.Path) -> None:
    config = load_model_file(tiny_path).config
    per_token = 2 * config.n_layers * config.n_kv_heads * config.head_dim * 4  # float32 K and V, every layer
    block = per_token * BLOCK_TOKENS
    assert capacity_tokens(10 * block, config) == 10 * BLOCK_TOKENS
    assert capacity_tokens(10 * block + block - 1, config) == 10 * BLOCK_TOKENS  # part of a block holds none
    assert capacity_tokens(block - 1, config) == 0
    assert capacity_tokens(0, config) == 0


@contextlib.contextmanager
def worker(options: ReferenceOptions) -> Iterator[tuple[str, ReferenceEngine]]:
    engine = ReferenceEngine(options)
    with running(create_worker_app(engine, WorkerSettings(role="both"))) as url:
        yield url, engine


async def test_with_block_reuse_the_worker_publishes_what_the_engine_holds(
    options: ReferenceOptions, tiny_path: pathlib.Path,
) -> None:
    with worker(options) as (url, engine):
        assert isinstance(engine, ReportsKvCapacity)
        expected = capacity_tokens(options.kv_block_reuse_bytes, load_model_file(tiny_path).config)
        assert engine.kv_capacity_tokens() == expected > 0
        async with httpx.AsyncClient(timeout=120) as client:
            card = (await client.get(url + "/v1/models")).json()["data"][0]["engine_info"]
            assert card["kv_events"]["capacity_tokens"] == expected
            batches: list[list[KVCacheEvent]] = []
            subscriber = EventSubscriber(card["kv_events"]["endpoint"], card["kv_events"]["replay_endpoint"],
                                         batches.append, lambda: None)
            subscriber.start()
            try:
                text = " the and of is in" * 65  # ~1.1 KB in few tokens: the tiny model has 512 of context
                chain = chain_of([text.encode()])
                reply = await client.post(url + "/v1/completions", headers={CHAIN_HEADER: chain.header_value()},
                                          json={"model": "tiny", "prompt": text, "max_tokens": 2})
                assert reply.status_code == 200, reply.text

                def stored() -> list[int | bytes]:
                    return [h for batch in batches for e in batch if isinstance(e, BlockStored)
                            for h in e.block_hashes]

                assert await eventually_async(lambda: stored() == list(chain.links))
            finally:
                await subscriber.aclose()


async def test_without_block_reuse_there_is_no_capacity_and_no_events(options: ReferenceOptions) -> None:
    with worker(replace(options, kv_block_reuse=False)) as (url, engine):
        assert engine.kv_capacity_tokens() is None
        async with httpx.AsyncClient(timeout=30) as client:
            card = (await client.get(url + "/v1/models")).json()["data"][0]["engine_info"]
        assert "kv_events" not in card and card["kv_block_reuse"] is False

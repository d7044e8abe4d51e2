"""Our KV events are vLLM's: vLLM's own msgspec decoder reads what our publisher encodes, ours reads vLLM's
encoding, and our subscriber follows vLLM's own ZMQ publisher (live stream and replay) over loopback TCP. The vLLM
engine's capacity comes from vLLM's own ``CacheConfig``."""

from __future__ import annotations

from typing import Any

import msgspec
import pytest

from frontend.kv_events import (
    PREFIX_CHAIN_TOPIC,
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    EventSubscriber,
    KVCacheEvent,
    decode_batch,
    encode_batch,
)
from tests.vllm.availability import needs_vllm
from tests.vllm.processes import free_ports
from tests.waiting import eventually_async
from workers.engines.vllm.vllm_api import kv_capacity_of

# Importing vLLM imports torch, whose own imports warn of deprecations of its own.
pytestmark = [needs_vllm, pytest.mark.filterwarnings("ignore::DeprecationWarning")]

OURS: list[KVCacheEvent] = [
    BlockStored(block_hashes=[1 << 32 | 7, 2 << 32 | 9], parent_block_hash=None, token_ids=[], block_size=128,
                lora_id=None, medium=None, lora_name=None),
    BlockStored(block_hashes=[3 << 32 | 1], parent_block_hash=2 << 32 | 9, token_ids=[], block_size=512,
                lora_id=None, medium=None, lora_name=None),
    BlockRemoved(block_hashes=[3 << 32 | 1], medium=None),
    AllBlocksCleared(),
]


def vllm_events() -> Any:
    from vllm.distributed import kv_events

    return kv_events


def test_vllms_decoder_reads_what_we_publish() -> None:
    kv = vllm_events()
    batch = msgspec.msgpack.Decoder(type=kv.KVEventBatch).decode(encode_batch(OURS))
    first, second, removed, cleared = batch.events
    assert isinstance(first, kv.BlockStored) and first.block_hashes == [1 << 32 | 7, 2 << 32 | 9]
    assert first.parent_block_hash is None and first.token_ids == [] and first.block_size == 128
    assert (first.lora_id, first.medium, first.lora_name) == (None, None, None)
    assert isinstance(second, kv.BlockStored) and second.parent_block_hash == 2 << 32 | 9
    assert second.block_size == 512
    assert isinstance(removed, kv.BlockRemoved) and removed.block_hashes == [3 << 32 | 1]
    assert isinstance(cleared, kv.AllBlocksCleared)
    assert batch.data_parallel_rank is None


def test_we_read_vllms_encoding_of_a_block_stored_batch() -> None:
    kv = vllm_events()
    theirs = kv.KVEventBatch(ts=1234.5, data_parallel_rank=0, events=[
        kv.BlockStored(block_hashes=[11, b"\x01\x02"], parent_block_hash=10, token_ids=[1, 2, 3, 4],
                       block_size=16, lora_id=None, medium="GPU", lora_name=None, group_idx=0),
        kv.BlockRemoved(block_hashes=[10], medium="GPU"),
        kv.AllBlocksCleared(),
    ])
    batch = decode_batch(msgspec.msgpack.encode(theirs))
    assert batch.ts == 1234.5 and batch.data_parallel_rank == 0
    stored, removed, cleared = batch.events
    assert stored == BlockStored(block_hashes=[11, b"\x01\x02"], parent_block_hash=10, token_ids=[1, 2, 3, 4],
                                 block_size=16, lora_id=None, medium="GPU", lora_name=None)
    assert removed == BlockRemoved(block_hashes=[10], medium="GPU")
    assert isinstance(cleared, AllBlocksCleared)


async def test_our_subscriber_follows_vllms_own_publisher_with_its_replay() -> None:
    kv = vllm_events()
    port, replay_port = free_ports(2)
    publisher = kv.ZmqEventPublisher(0, endpoint=f"tcp://*:{port}", replay_endpoint=f"tcp://*:{replay_port}",
                                     topic=PREFIX_CHAIN_TOPIC.decode())
    read: list[list[KVCacheEvent]] = []
    subscriber = EventSubscriber(f"tcp://127.0.0.1:{port}", f"tcp://127.0.0.1:{replay_port}", read.append,
                                 lambda: None)
    try:
        def stored(name: int) -> Any:
            return kv.BlockStored(block_hashes=[name], parent_block_hash=None, token_ids=[], block_size=16,
                                  lora_id=None, medium=None, lora_name=None)

        sent = 0

        def publish() -> None:
            nonlocal sent
            publisher.publish(kv.KVEventBatch(ts=float(sent), events=[stored(sent)]))
            sent += 1

        for _ in range(3):  # before anyone listens: these come by replay
            publish()
        subscriber.start()

        def caught_up() -> bool:  # keep the stream going until it is followed live
            if len(read) > 3:
                return True
            publish()
            return False

        assert await eventually_async(caught_up, every_s=0.05)
        assert await eventually_async(lambda: len(read) == sent)
        names = [event.block_hashes[0] for batch in read for event in batch if isinstance(event, BlockStored)]
        assert names == list(range(sent))  # every batch once, in order, the early ones included
    finally:
        await subscriber.aclose()
        publisher.shutdown()


def test_the_vllm_engines_capacity_is_its_blocks_with_prefix_caching_on() -> None:
    from vllm.config import CacheConfig

    config = CacheConfig(block_size=16, enable_prefix_caching=True)
    assert kv_capacity_of(config) is None  # not started: vLLM has not sized its KV cache yet
    config.num_gpu_blocks = 1000
    assert kv_capacity_of(config) == 16_000
    config.enable_prefix_caching = False
    assert kv_capacity_of(config) is None  # no reuse: nothing to route by

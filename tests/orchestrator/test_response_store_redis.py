"""The Redis store against a real Redis: shared by stores that stand for separate processes, exact bookkeeping under
concurrent writers, and failure that is bounded, loud once, counted, and over by itself when Redis is back.

The bounds and semantics every store shares are tests/orchestrator/test_response_store.py's, run on both."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator, Callable, Iterator
from pathlib import Path
from typing import Any

import openai
import orjson
import pytest

from bench.driver.redis_server import RedisServer, redis_running
from frontend.config import ResponseStoreConfig, parse_config
from frontend.errors import ResponseStoreUnavailableError
from frontend.metrics import Metrics
from orchestrator.flow.request import StreamedAnswer, WholeAnswer
from orchestrator.response_memory import ResponseMemory
from orchestrator.response_store_redis import RedisResponseStore, redacted
from orchestrator.server import create_orchestrator_app
from tests.cluster import MODEL, Cluster, sample
from tests.orchestrator.test_response_memory import BODY, answer_to, frames_of, stream_of
from tests.orchestrator.test_response_store import FakeClock
from tests.servers import running
from tests.waiting import eventually, eventually_async

StoreFactory = Callable[..., RedisResponseStore]


@pytest.fixture
async def stores() -> AsyncIterator[Callable[..., RedisResponseStore]]:
    made: list[RedisResponseStore] = []

    def make(url: str, metrics: Metrics | None = None, clock: FakeClock | None = None,
             **limits: Any) -> RedisResponseStore:
        config = ResponseStoreConfig.model_validate({**limits, "backend": "redis", "url": url})
        store = RedisResponseStore(config, metrics, clock or FakeClock())
        made.append(store)
        return store

    yield make
    for store in made:
        await store.aclose()


@pytest.fixture
def own_redis(tmp_path: Path) -> Iterator[RedisServer]:
    """A Redis of this test's own, which it may kill, pause and bring back (with its append-only file)."""
    with redis_running(tmp_path / "redis", appendonly=True) as server:
        yield server


async def test_what_one_process_stores_another_reads_deletes_and_evicts(redis_url: str, stores: StoreFactory
                                                                       ) -> None:
    one, other = stores(redis_url, max_entries=2), stores(redis_url, max_entries=2)
    assert await one.put("a", b'{"id":"a"}', b"[]", "a")
    entry = await other.get("a")
    assert entry is not None and (entry.response, entry.session) == (b'{"id":"a"}', "a")
    await other.put("b", b"{}", b"[]")
    assert await one.get("a") is not None  # a used last, through the other process
    await one.put("c", b"{}", b"[]")  # the bound is the deployment's: b, the least recently used anywhere, goes
    assert [rid for rid in "abc" if await other.get(rid) is not None] == ["a", "c"]
    assert await other.delete("a") and await one.get("a") is None


async def test_an_entry_expires_in_redis_by_itself_as_well(redis_server: RedisServer, redis_url: str,
                                                          stores: StoreFactory) -> None:
    # No process may write again for hours: Redis frees the entry itself when its TTL is up.
    store = stores(redis_url, ttl_s=90)
    await store.put("a", b"{}", b"[]")
    with redis_server.client() as client:
        entry_keys = [key for key in client.scan_iter() if key.endswith(b":r:a")]
        assert len(entry_keys) == 1
        assert 0 < client.pttl(entry_keys[0]) <= 90_000


async def test_the_bookkeeping_stays_exact_under_concurrent_writers(redis_server: RedisServer, redis_url: str,
                                                                   stores: StoreFactory) -> None:
    writers = [stores(redis_url, max_entries=20, max_bytes=3000) for _ in range(3)]

    async def write(store: RedisResponseStore, n: int) -> None:
        for i in range(40):
            await store.put(f"r{(n * 7 + i) % 50}", b"x" * (10 + i), b"y" * n)
            await store.get(f"r{i % 50}")

    await asyncio.gather(*(write(store, n) for n, store in enumerate(writers)))
    with redis_server.client() as client:
        sizes = {key.decode(): int(value) for key, value in client.hgetall("{disagg:responses}:sizes").items()}
        entries = {key.decode().rsplit(":r:", 1)[1]: key for key in client.scan_iter("{disagg:responses}:r:*")}
        assert set(sizes) == set(entries) == {m.decode() for m in client.zrange("{disagg:responses}:use", 0, -1)}
        assert len(entries) <= 20
        for rid, key in entries.items():
            assert client.hstrlen(key, "response") + client.hstrlen(key, "conversation") == sizes[rid]
        assert int(client.get("{disagg:responses}:bytes") or 0) == sum(sizes.values()) <= 3000


async def test_scripts_flushed_from_redis_are_loaded_again(redis_server: RedisServer, redis_url: str,
                                                          stores: StoreFactory) -> None:
    store = stores(redis_url)
    await store.put("a", b"{}", b"[]")
    with redis_server.client() as client:
        client.script_flush()
    assert await store.get("a") is not None


async def test_redis_killed_then_back_is_a_503_meanwhile_logged_once_and_nothing_lost(
    own_redis: RedisServer, stores: StoreFactory, caplog: pytest.LogCaptureFixture
) -> None:
    metrics = Metrics()
    store = stores(own_redis.url, metrics, timeout_s=2)
    await store.put("a", b'{"id":"a"}', b"[]")
    own_redis.kill()
    caplog.set_level(logging.WARNING, logger="orchestrator.response_store_redis")
    for call in (store.get("a"), store.put("b", b"{}", b"[]"), store.delete("a")):
        with pytest.raises(ResponseStoreUnavailableError) as caught:
            await call
        assert (caught.value.status_code, caught.value.code) == (503, "response_store_unavailable")
        assert caught.value.headers == {"Retry-After": "1"}
    assert [r.levelname for r in caplog.records] == ["ERROR"]  # once per outage, not once per request
    assert "127.0.0.1" in caplog.records[0].getMessage()
    assert sample(metrics, "disagg_response_store_up") == 0
    assert [sample(metrics, "disagg_response_store_errors_total", operation=op) for op in ("get", "put", "delete")
            ] == [1, 1, 1]
    own_redis.start()  # the same port, its append-only file replayed
    assert await eventually_async(lambda: _answers(store))
    entry = await store.get("a")  # written before the crash: there, whole
    assert entry is not None and entry.response == b'{"id":"a"}'
    assert sample(metrics, "disagg_response_store_up") == 1
    assert [r.levelname for r in caplog.records] == ["ERROR", "WARNING"]
    assert "answers again" in caplog.records[1].getMessage()


async def _answers(store: RedisResponseStore) -> bool:
    try:
        await store.get("probe")
    except ResponseStoreUnavailableError:
        return False
    return True


async def test_a_redis_that_stops_answering_costs_a_request_the_timeout_not_more(
    own_redis: RedisServer, stores: StoreFactory
) -> None:
    store = stores(own_redis.url, timeout_s=0.3)
    await store.put("a", b"{}", b"[]")  # a pooled connection, open
    own_redis.pause()  # connections accepted by the kernel, nothing answered
    try:
        loop = asyncio.get_running_loop()
        started = loop.time()
        with pytest.raises(ResponseStoreUnavailableError):
            await store.get("a")
        # Bounded, not measured: one timeout (a retry, if any, inside it), never a wait for the kernel's TCP
        # timeout (minutes). The bound is far from both, so a busy machine cannot fail it.
        assert loop.time() - started < 20.0
    finally:
        own_redis.resume()
    assert await eventually_async(lambda: _answers(store))
    assert await store.get("a") is not None


async def test_when_redis_is_down_a_follow_up_is_a_503_and_an_answer_is_delivered_unkept(
    own_redis: RedisServer,
) -> None:
    config = ResponseStoreConfig(backend="redis", url=own_redis.url, timeout_s=2)
    memory = ResponseMemory(config, RedisResponseStore(config))
    try:
        await (await memory.begin(BODY)).remember(WholeAnswer(orjson.dumps(answer_to("resp_1", "Hi."))))
        own_redis.kill()
        with pytest.raises(ResponseStoreUnavailableError):
            await memory.begin({**BODY, "input": "And then?", "previous_response_id": "resp_1"})
        with pytest.raises(ResponseStoreUnavailableError):
            await memory.stored("resp_1")
        whole = WholeAnswer(orjson.dumps(answer_to("resp_2", "Hello.")))
        assert await (await memory.begin(BODY)).remember(whole) is whole
        chunks = stream_of("resp_3", "Yes.")
        streamed = await (await memory.begin(BODY)).remember(StreamedAnswer(frames_of(chunks)))
        assert isinstance(streamed, StreamedAnswer)
        assert [chunk async for chunk in streamed.frames] == chunks  # every frame, the final event too
        own_redis.start()
        assert await eventually_async(lambda: _answers(memory.store))  # type: ignore[arg-type]
        assert (await memory.stored("resp_1")).response_id == "resp_1"
        assert await memory.store.get("resp_2") is None and await memory.store.get("resp_3") is None
    finally:
        await memory.store.aclose()


def test_a_logged_url_carries_no_password() -> None:
    assert redacted("redis://user:s3cret@redis.internal:6380/2") == "redis://redis.internal:6380/2"
    assert redacted("rediss://:s3cret@cache/0") == "rediss://cache/0"
    assert redacted("unix:///run/redis.sock") == "unix:///run/redis.sock"


def test_through_the_orchestrator_an_outage_fails_only_what_needs_the_store(own_redis: RedisServer,
                                                                          cluster: Cluster) -> None:
    """Redis killed mid-conversation: the follow-up is a 503 in OpenAI's shape, chat and a new conversation are
    served, and once Redis is back (its append-only file replayed) the conversation goes on where it was."""
    config = parse_config({"context_servers": {"urls": [cluster.ctx.url]},
                           "generation_servers": {"urls": [cluster.gen.url]},
                           "response_store": {"backend": "redis", "url": own_redis.url, "timeout_s": 2}})
    metrics = Metrics()
    with running(create_orchestrator_app(config, metrics)) as url, \
            openai.OpenAI(base_url=url + "/v1", api_key="test", max_retries=0, timeout=30) as client:
        first = client.responses.create(model=MODEL, input="Hello", max_output_tokens=2)
        own_redis.kill()
        with pytest.raises(openai.InternalServerError) as caught:
            client.responses.create(model=MODEL, input="And then?", previous_response_id=first.id)
        assert (caught.value.status_code, caught.value.code) == (503, "response_store_unavailable")
        assert caught.value.response.headers["retry-after"] == "1"
        with pytest.raises(openai.InternalServerError):
            client.responses.retrieve(first.id)
        chat = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "hi"}], max_tokens=2)
        assert chat.choices[0].message.content
        unstored = client.responses.create(model=MODEL, input="Not to keep", store=False, max_output_tokens=2)
        assert unstored.output_text
        unkept = client.responses.create(model=MODEL, input="A new one", max_output_tokens=2)  # answered, not kept
        assert unkept.output_text
        # Chat and a store: false turn never called Redis; the follow-up and GET read it, the last turn wrote.
        assert [sample(metrics, "disagg_response_store_errors_total", operation=op)
                for op in ("get", "put", "delete")] == [2, 1, 0]
        own_redis.start()

        def continues() -> bool:
            try:
                client.responses.retrieve(first.id)
            except openai.InternalServerError:
                return False
            return True

        assert eventually(continues)
        second = client.responses.create(model=MODEL, input="And then?", previous_response_id=first.id,
                                         max_output_tokens=2)
        assert second.usage is not None and first.usage is not None
        assert second.usage.input_tokens > first.usage.input_tokens
        with pytest.raises(openai.NotFoundError):
            client.responses.retrieve(unkept.id)


async def test_a_byte_total_left_behind_by_hand_made_deletions_heals_instead_of_refusing_every_write(
    redis_server: RedisServer, redis_url: str, stores: StoreFactory
) -> None:
    store = stores(redis_url, max_bytes=100)
    await store.put("a", b"x" * 10, b"")
    with redis_server.client() as client:  # an operator deletes the index by hand, not the total
        client.delete("{disagg:responses}:use", "{disagg:responses}:sizes")
        client.set("{disagg:responses}:bytes", 1000)
    assert await store.put("b", b"x" * 10, b"")
    assert await store.get("b") is not None


async def test_at_redis_memory_limit_a_store_is_refused_whole_while_reads_and_deletes_go_on(
    own_redis: RedisServer, stores: StoreFactory
) -> None:
    store = stores(own_redis.url, max_bytes=1 << 30)
    await store.put("kept", b'{"id":"kept"}', b"[]")
    with own_redis.client() as client:
        used = int(client.info("memory")["used_memory"])
        client.config_set("maxmemory-policy", "noeviction")
        client.config_set("maxmemory", used + 256 * 1024)
    try:
        with pytest.raises(ResponseStoreUnavailableError):
            for n in range(20):  # 64 KiB each: the limit is reached within a few
                await store.put(f"big{n}", b"x" * 65536, b"[]")
        entry = await store.get("kept")  # a read still moves it in the LRU
        assert entry is not None and entry.response == b'{"id":"kept"}'
        with own_redis.client() as client:  # nothing half-written: every entry whole, the total exact
            sizes = {k.decode(): int(v) for k, v in client.hgetall("{disagg:responses}:sizes").items()}
            entries = {k.decode().rsplit(":r:", 1)[1] for k in client.scan_iter("{disagg:responses}:r:*")}
            assert set(sizes) == entries
            assert int(client.get("{disagg:responses}:bytes") or 0) == sum(sizes.values())
        assert await store.delete("kept")  # a delete frees memory, so it runs even now
    finally:
        with own_redis.client() as client:
            client.config_set("maxmemory", 0)


async def test_a_store_that_cannot_be_reached_at_start_up_says_so_once_and_serves_later(
    own_redis: RedisServer, stores: StoreFactory, caplog: pytest.LogCaptureFixture
) -> None:
    metrics = Metrics()
    store = stores(own_redis.url, metrics)
    assert sample(metrics, "disagg_response_store_up") == 0  # not known to answer before it has
    own_redis.kill()
    caplog.set_level(logging.WARNING, logger="orchestrator.response_store_redis")
    await store.start()
    assert [r.levelname for r in caplog.records] == ["ERROR"]
    assert sample(metrics, "disagg_response_store_up") == 0
    own_redis.start()
    assert await eventually_async(lambda: _answers(store))
    assert sample(metrics, "disagg_response_store_up") == 1

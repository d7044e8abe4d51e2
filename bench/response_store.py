"""What keeping a Responses conversation costs: a store's ``put`` and ``get`` on this process's memory and on a real
Redis (loopback, the server started here), by the size of the stored conversation.

A turn that continues a stored conversation waits for one ``get`` before it runs, and a kept answer for one ``put``
before its final event reaches the client; nothing else waits on the store. The figures are the median and p99 of
each call, one at a time, on an otherwise idle store with ``max_entries`` entries already in it.

    python -m bench.response_store [--sizes 2048,65536,1048576] [--calls 300]
"""

from __future__ import annotations

import argparse
import asyncio
import tempfile
import time
from pathlib import Path
from typing import Any

from bench.driver.redis_server import RedisMissingError, redis_running
from entrypoints.bench.statistics import percentile
from frontend.config import ResponseStoreConfig
from orchestrator.response_store import MemoryResponseStore, ResponseStore
from orchestrator.response_store_redis import RedisResponseStore

DEFAULT_SIZES = (2_048, 65_536, 1_048_576)
RESPONSE = b'{"id":"resp_x","object":"response","output":[]}'


async def _timed(store: ResponseStore, size: int, calls: int, resident: int) -> dict[str, dict[str, float]]:
    conversation = b"[" + b"x" * (size - 2) + b"]"
    for n in range(resident):  # a store in use: its bookkeeping holds entries
        await store.put(f"resp_resident_{n}", RESPONSE, b"[]")
    times: dict[str, list[float]] = {"put": [], "get": []}
    for n in range(calls):
        response_id = f"resp_{size}_{n}"
        started = time.perf_counter()
        await store.put(response_id, RESPONSE, conversation)
        times["put"].append(time.perf_counter() - started)
        started = time.perf_counter()
        entry = await store.get(response_id)
        times["get"].append(time.perf_counter() - started)
        assert entry is not None and entry.conversation == conversation
    return {op: {"p50_ms": percentile(values, 50) * 1000, "p99_ms": percentile(values, 99) * 1000}
            for op, values in times.items()}


async def _measure(url: str | None, sizes: tuple[int, ...], calls: int, resident: int) -> dict[str, Any]:
    results: dict[str, Any] = {}
    for size in sizes:
        limits = ResponseStoreConfig(max_bytes=1 << 30, max_entries=resident + calls + 1)
        memory = MemoryResponseStore(limits)
        results.setdefault("memory", {})[size] = await _timed(memory, size, calls, resident)
        if url is not None:
            redis_store = RedisResponseStore(limits.model_copy(update={"backend": "redis", "url": url,
                                                                        "key_prefix": f"bench-{size}"}))
            try:
                results.setdefault("redis", {})[size] = await _timed(redis_store, size, calls, resident)
            finally:
                await redis_store.aclose()
    return results


def run(sizes: tuple[int, ...] = DEFAULT_SIZES, calls: int = 300, resident: int = 1_000) -> dict[str, Any]:
    """Both stores' call times by size; Redis is left out, with the reason, where its server is not installed."""
    with tempfile.TemporaryDirectory(prefix="disagg-bench-redis-") as directory:
        try:
            with redis_running(Path(directory)) as server:
                stores = asyncio.run(_measure(server.url, sizes, calls, resident))
                skipped = None
        except RedisMissingError as exc:
            stores = asyncio.run(_measure(None, sizes, calls, resident))
            skipped = str(exc)
    return {"sizes": list(sizes), "calls": calls, "resident": resident, "stores": stores, "redis_skipped": skipped}


def table(result: dict[str, Any]) -> str:
    lines = ["| conversation | store | put p50 | put p99 | get p50 | get p99 |",
             "| --- | --- | --- | --- | --- | --- |"]
    for size in result["sizes"]:
        for name, by_size in result["stores"].items():
            timing = by_size[size]
            lines.append(f"| {size:,} B | {name} | {timing['put']['p50_ms']:.3f} ms | {timing['put']['p99_ms']:.3f} ms "
                         f"| {timing['get']['p50_ms']:.3f} ms | {timing['get']['p99_ms']:.3f} ms |")
    if result["redis_skipped"]:
        lines.append(f"\nRedis not measured: {result['redis_skipped']}")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sizes", default=",".join(map(str, DEFAULT_SIZES)),
                        help="stored conversation sizes in bytes, comma-separated")
    parser.add_argument("--calls", type=int, default=300, help="put + get pairs per size and store")
    parser.add_argument("--resident", type=int, default=1_000, help="entries in the store before measuring")
    args = parser.parse_args()
    result = run(tuple(int(s) for s in args.sizes.split(",")), args.calls, args.resident)
    print(table(result))


if __name__ == "__main__":
    main()

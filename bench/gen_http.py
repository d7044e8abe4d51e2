"""A real GEN worker over HTTP: whole-process CPU seconds per request, the prompt as a list, as b64 or absent.

``python -m bench.gen_http``: the worker (synthetic engine) as a subprocess, one keep-alive connection, one request
at a time; the figure is the worker's utime + stime over a batch divided by its size (everything the process spends
on a request). Method: docs/benchmarks.md, "A GEN worker over HTTP".
"""

from __future__ import annotations

import http.client
import statistics
import sys
import time
from typing import Any

import orjson

from bench.driver.bodies import GEN_KINDS, gen_body, random_tokens
from bench.driver.common import LOOPBACK, Processes, arguments, free_port, wait_healthy, worker_args
from bench.driver.machine import cpu_seconds
from bench.driver.report import fmt, markdown_table, print_and_save
from entrypoints.bench.statistics import ratio

SIZES = (40_000, 131_072, 290_000)
TARGET_SIZE = 131_072


class Connection:
    """One keep-alive connection; the client's own cost is not what is measured, the worker's is."""

    def __init__(self, port: int) -> None:
        self.port = port
        self.connection = http.client.HTTPConnection(LOOPBACK, port, timeout=60)

    def post(self, path: str, body: bytes) -> tuple[int, bytes]:
        self.connection.request("POST", path, body=body, headers={"Content-Type": "application/json"})
        response = self.connection.getresponse()
        return response.status, response.read()

    def close(self) -> None:
        self.connection.close()


def check_answer(status: int, content: bytes) -> None:
    if status != 200:
        raise RuntimeError(f"GEN answered {status}: {content[:300]!r}")
    answer = orjson.loads(content)
    # With max_tokens 1 the synthetic GEN answers CTX's first token plus one of its own (2 tokens); the
    # orchestrator never sends GEN max_tokens 1 (CTX finishes such a request), so only a finished answer matters.
    if answer["choices"][0]["finish_reason"] is None or answer["usage"]["completion_tokens"] < 1:
        raise RuntimeError(f"unexpected GEN answer: {content[:300]!r}")


def measure(connection: Connection, pid: int, body: bytes, batches: int, min_batch_s: float,
            warmups: int) -> dict[str, Any]:
    for _ in range(warmups):
        check_answer(*connection.post("/v1/completions", body))
    per_request: list[float] = []
    wall_per_request: list[float] = []
    total_cpu, total_requests = 0.0, 0
    for _ in range(batches):
        count = 0
        cpu0, wall0 = cpu_seconds(pid), time.perf_counter()
        while True:
            status, content = connection.post("/v1/completions", body)
            count += 1
            if count == 1:
                check_answer(status, content)
            elif status != 200:
                raise RuntimeError(f"GEN answered {status}")
            if time.perf_counter() - wall0 >= min_batch_s and count >= 3:
                break
        wall1, cpu1 = time.perf_counter(), cpu_seconds(pid)
        per_request.append((cpu1 - cpu0) / count)
        wall_per_request.append((wall1 - wall0) / count)
        total_cpu += cpu1 - cpu0
        total_requests += count
    return {
        "cpu_ms": total_cpu / total_requests * 1e3,
        "cpu_ms_median_batch": statistics.median(per_request) * 1e3,
        "cpu_ms_batches": [x * 1e3 for x in per_request],
        "wall_ms": statistics.median(wall_per_request) * 1e3,
        "requests": total_requests,
        "body_bytes": len(body),
    }


def run(sizes: tuple[int, ...] = SIZES, batches: int = 5, min_batch_s: float = 0.5, warmups: int = 5,
        startup_timeout_s: float = 60.0) -> dict[str, Any]:
    port = free_port()
    results: list[dict[str, Any]] = []
    with Processes() as processes:
        gen = processes.disagg_serve("gen", worker_args("generation", "synthetic", port), port)
        wait_healthy([gen], startup_timeout_s)
        connection = Connection(port)
        try:
            for size in sizes:
                tokens = random_tokens(size, seed=size)
                row: dict[str, Any] = {"tokens": size}
                for kind in GEN_KINDS:
                    row[kind] = measure(connection, gen.pid, gen_body(tokens, kind), batches, min_batch_s, warmups)
                row["list_over_array"] = ratio(row["list"]["cpu_ms"], row["array"]["cpu_ms"])
                row["array_over_metadata"] = ratio(row["array"]["cpu_ms"], row["metadata"]["cpu_ms"])
                results.append(row)
        finally:
            connection.close()
    return {
        "benchmark": "gen_http",
        "method": {"batches": batches, "min_batch_s": min_batch_s, "warmups": warmups, "max_tokens": 1,
                   "endpoint": "/v1/completions", "cpu": "utime+stime of the worker process"},
        "sizes": results,
    }


def targets(result: dict[str, Any]) -> list[dict[str, Any]]:
    at = next((s for s in result["sizes"] if s["tokens"] == TARGET_SIZE), None)
    if at is None:
        return []
    ratio = at["list_over_array"] or 0.0
    return [{"target": "GEN worker (whole process, over HTTP): array path >= 15x cheaper than the list path at "
                       "131,072 tokens (DESIGN aim)",
             "measured": f"{ratio:.1f}x ({at['list']['cpu_ms']:.2f} vs {at['array']['cpu_ms']:.2f} ms CPU)",
             "met": None, "aim_met": ratio >= 15}]


def tables(result: dict[str, Any]) -> str:
    rows = []
    for s in result["sizes"]:
        rows.append([
            f"{s['tokens']:,}",
            fmt(s["list"]["cpu_ms"]), fmt(s["array"]["cpu_ms"]), fmt(s["metadata"]["cpu_ms"]),
            fmt(s["list_over_array"], 1) + "x", fmt(s["array_over_metadata"]) + "x",
            fmt(s["list"]["wall_ms"]), fmt(s["array"]["wall_ms"]), fmt(s["metadata"]["wall_ms"]),
            f"{s['list']['body_bytes']:,} / {s['array']['body_bytes']:,} / {s['metadata']['body_bytes']:,}",
        ])
    return markdown_table(
        ["prompt tokens", "list CPU ms/req", "b64 CPU ms/req", "metadata-only CPU ms/req", "list/b64",
         "b64/metadata", "list wall ms", "b64 wall ms", "metadata wall ms", "body bytes (list / b64 / meta)"],
        rows)


def main(argv: list[str] | None = None) -> int:
    parser = arguments(__doc__)
    parser.add_argument("--sizes", type=int, nargs="+", default=list(SIZES))
    parser.add_argument("--batches", type=int, default=5)
    parser.add_argument("--json", default=None)
    args = parser.parse_args(argv)
    result = run(tuple(args.sizes), batches=args.batches)
    return print_and_save(result, tables, args.json)


if __name__ == "__main__":
    sys.exit(main())

"""``disagg-serve bench``: put load on any OpenAI-compatible server and report what its clients saw.

    disagg-serve bench --url http://127.0.0.1:8000 [--model M] [--endpoint completions|chat]
        [--prompt-tokens 512 | --prompts FILE.jsonl] [--output-tokens 128] [--num-requests 200]
        [--concurrency 16 | --request-rate 8] [--out result.json] [--plot ttft_itl.png]
"""

from __future__ import annotations

import argparse
import asyncio
import functools
import random
import sys
import time
from pathlib import Path
from typing import Any

import httpx
import orjson

from entrypoints.bench.load import Record, poisson_arrivals, post_streamed, run_client, send
from entrypoints.bench.prompts import PATHS, Prompt, jsonl_prompts, request_body, synthetic_prompts
from entrypoints.bench.results import Progress, per_request, summary, table
from entrypoints.bench.statistics import finite


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--url", required=True, help="the server's base URL (its /v1 routes are used)")
    parser.add_argument("--model", default=None, help="the model to ask for (default: the server's first)")
    parser.add_argument("--api-key", default=None, help="sent as 'Authorization: Bearer KEY'")
    parser.add_argument("--endpoint", choices=list(PATHS), default="completions")
    prompts = parser.add_mutually_exclusive_group()
    prompts.add_argument("--prompt-tokens", type=int, default=256,
                         help="synthetic prompts of about this many tokens (default 256)")
    prompts.add_argument("--prompts", type=Path, default=None, metavar="FILE.jsonl",
                         help='one JSON object a line: {"prompt": ...} or {"messages": [...]}, optional max_tokens')
    parser.add_argument("--output-tokens", type=int, default=128, help="max_tokens of each request (default 128)")
    parser.add_argument("--num-requests", type=int, default=100)
    load = parser.add_mutually_exclusive_group()
    load.add_argument("--concurrency", type=int, default=None,
                      help="closed loop: this many requests in flight at all times (default 8)")
    load.add_argument("--request-rate", type=float, default=None, metavar="REQ_PER_S",
                      help="open loop: requests arrive as a Poisson process of this rate")
    parser.add_argument("--extra-body", default="{}", metavar="JSON",
                        help='fields added to every body, e.g. \'{"temperature": 0, "ignore_eos": true}\'')
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--timeout-s", type=float, default=600.0, help="per request (default 600)")
    parser.add_argument("--out", type=Path, default=None, help="write the summary and every request as JSON")
    parser.add_argument("--plot", type=Path, default=None, metavar="PNG",
                        help="write the TTFT and inter-token latency distributions (needs matplotlib)")


def run_bench(args: argparse.Namespace) -> int:
    try:
        extra = orjson.loads(args.extra_body)
        if not isinstance(extra, dict):
            raise ValueError("--extra-body must be a JSON object")
        prompts = jsonl_prompts(args.prompts) if args.prompts else None
    except (ValueError, OSError) as exc:  # PromptFileError and orjson's error are ValueErrors
        print(f"disagg-serve bench: {exc}", file=sys.stderr)
        return 2
    try:
        result = asyncio.run(_run(args, extra, prompts))
    except _Unreachable as exc:
        print(f"disagg-serve bench: {exc}", file=sys.stderr)
        return 1
    print(table(result["summary"]))
    if args.out is not None:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_bytes(orjson.dumps(finite(result), option=orjson.OPT_INDENT_2))
        print(f"wrote {args.out}")
    if args.plot is not None:
        from entrypoints.bench.plot import distributions_png

        title = f"{args.url} {result['config']['load']}, {result['summary']['ok']} requests"
        print(f"wrote {distributions_png(result['summary'], result['requests'], args.plot, title)}")
    return 0 if result["summary"]["ok"] else 1


class _Unreachable(Exception):
    pass


async def _run(args: argparse.Namespace, extra: dict[str, Any], prompts: list[Prompt] | None) -> dict[str, Any]:
    headers = {"Content-Type": "application/json"}
    if args.api_key:
        headers["Authorization"] = f"Bearer {args.api_key}"
    base = args.url.rstrip("/").removesuffix("/v1")
    concurrency = args.concurrency or (None if args.request_rate else 8)
    pool = (concurrency or 64) * 2 + 8
    limits = httpx.Limits(max_connections=None if args.request_rate else pool, max_keepalive_connections=pool)
    async with httpx.AsyncClient(timeout=httpx.Timeout(args.timeout_s, connect=10.0), limits=limits) as client:
        model = args.model or await _first_model(client, base, headers)
        chosen = prompts or synthetic_prompts(args.num_requests, args.prompt_tokens, args.seed)
        bodies = [request_body(args.endpoint, model, chosen[i % len(chosen)], args.output_tokens, extra)
                  for i in range(args.num_requests)]
        url = base + PATHS[args.endpoint]
        records: list[Record] = []
        progress = Progress(len(bodies))
        started = time.perf_counter()
        try:
            if args.request_rate:
                await _open_loop(client, url, bodies, headers, args.request_rate, args.seed, records, progress)
            else:
                await _closed_loop(client, url, bodies, headers, concurrency or 8, records, progress)
        finally:
            progress.close()
        duration = max(r.ended or started for r in records) - started if records else 0.0
    load = f"request rate {args.request_rate}/s (Poisson)" if args.request_rate else f"concurrency {concurrency}"
    return {
        "config": {"url": args.url, "model": model, "endpoint": args.endpoint, "load": load,
                   "num_requests": args.num_requests, "prompt_tokens": None if prompts else args.prompt_tokens,
                   "prompts_file": str(args.prompts) if args.prompts else None, "output_tokens": args.output_tokens,
                   "extra_body": extra},
        "summary": summary(records, duration),
        "requests": per_request(records, started),
    }


async def _first_model(client: httpx.AsyncClient, base: str, headers: dict[str, str]) -> str:
    try:
        reply = await client.get(base + "/v1/models", headers=headers)
        return str(reply.json()["data"][0]["id"])
    except (httpx.HTTPError, ValueError, KeyError, IndexError, TypeError) as exc:
        raise _Unreachable(f"cannot read the model from {base}/v1/models ({type(exc).__name__}); "
                           "give --model") from exc


async def _closed_loop(client: httpx.AsyncClient, url: str, bodies: list[bytes], headers: dict[str, str],
                       concurrency: int, records: list[Record], progress: Progress) -> None:
    queue = iter(bodies)
    next_body: list[bytes] = []

    def take() -> bool:
        body = next(queue, None)
        if body is None:
            return False
        next_body.append(body)
        return True

    def new_record() -> Record:
        record = Record(time.perf_counter())
        records.append(record)
        return record

    async def request(record: Record) -> None:
        await post_streamed(client, url, next_body.pop(), record, detail=True, headers=headers)

    await asyncio.gather(*(run_client(take, new_record, request, progress.update) for _ in range(concurrency)))


async def _open_loop(client: httpx.AsyncClient, url: str, bodies: list[bytes], headers: dict[str, str],
                     rate: float, seed: int, records: list[Record], progress: Progress) -> None:
    async def request(body: bytes, record: Record) -> None:
        await post_streamed(client, url, body, record, detail=True, headers=headers)

    tasks = []
    async for index in poisson_arrivals(rate, len(bodies), random.Random(seed)):
        record = Record(time.perf_counter())
        records.append(record)
        tasks.append(asyncio.create_task(send(functools.partial(request, bodies[index]), record, progress.update)))
    await asyncio.gather(*tasks)

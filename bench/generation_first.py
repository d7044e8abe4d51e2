"""TTFT of generation-first against context-first scheduling, our orchestrator to our reference-engine workers over
TensorRT-LLM's protocol.

    python -m bench.generation_first [--quick] [--out bench-results/generation_first.json]

One CTX + GEN pair per lifecycle protocol (v0, v1), two orchestrators in front of each (one per schedule), the
schedules interleaved round by round; every answer must be the same text under both. Figures: docs/interop.md.
"""

from __future__ import annotations

import asyncio
import sys
import time
from typing import Any

import orjson
from openai import AsyncOpenAI

from bench.driver import common, report
from bench.driver.common import Processes, Server, arguments
from bench.driver.report import fmt
from bench.reference import prompt_of
from entrypoints.bench.statistics import percentile, ratio

MODES = ("context_first", "generation_first")
PROMPT_WORDS = (64, 1_024)
MAX_TOKENS = 8


def start_pair(processes: Processes, lifecycle: str, extra: list[str], timeout_s: float) -> dict[str, Server]:
    """CTX + GEN answering lifecycle ``lifecycle`` and one trtllm-protocol orchestrator per schedule in front."""
    flags = [*extra, "--lifecycle-protocol-version", "1"] if lifecycle == "v1" else extra
    workers = []
    for role in ("context", "generation"):
        port = common.free_port()
        args = common.worker_args(role, "reference", port, *flags)
        workers.append(processes.disagg_serve(f"{lifecycle}-{role}", args, port))
    common.wait_healthy(workers, timeout_s)
    ctx, gen = workers
    orchestrators = {}
    for mode in MODES:
        port = common.free_port()
        config = common.orchestrator_config(
            processes.log_dir / f"{lifecycle}-{mode}.yaml", port, [ctx.url], [gen.url],
            context_servers={"urls": [ctx.url], "protocol": "trtllm"},
            generation_servers={"urls": [gen.url], "protocol": "trtllm"},
            trtllm={"schedule_style": mode, "lifecycle_protocol": "auto"})
        orchestrators[mode] = processes.disagg_serve(f"{lifecycle}-{mode}", ["orchestrator", "--config",
                                                                             str(config)], port)
    common.wait_healthy(list(orchestrators.values()), timeout_s)
    return orchestrators


async def stream_chat(client: AsyncOpenAI, model: str, prompt: str, max_tokens: int) -> dict[str, Any]:
    """One streamed chat request: TTFT (sent -> first content delta), the text, the prompt's token count."""
    started = time.perf_counter()
    ttft, parts, prompt_tokens = None, [], 0
    stream = await client.chat.completions.create(
        model=model, messages=[{"role": "user", "content": prompt}], max_tokens=max_tokens, temperature=0,
        stream=True, stream_options={"include_usage": True}, extra_body={"ignore_eos": True})
    async for chunk in stream:
        if chunk.usage is not None:
            prompt_tokens = chunk.usage.prompt_tokens
        for choice in chunk.choices:
            if choice.delta.content:
                ttft = ttft if ttft is not None else (time.perf_counter() - started) * 1e3
                parts.append(choice.delta.content)
    if ttft is None:
        raise RuntimeError("the stream carried no content")
    return {"ttft_ms": ttft, "text": "".join(parts), "prompt_tokens": prompt_tokens}


def lifecycle_events(orchestrator: Server) -> dict[str, float]:
    """The orchestrator's ``disagg_trtllm_lifecycle_events_total`` by event (proof that v1 was spoken)."""
    events: dict[str, float] = {}
    for line in common.http_get(orchestrator.url, "/metrics", timeout_s=10)[1].decode().splitlines():
        if line.startswith("disagg_trtllm_lifecycle_events_total{"):
            name = line.split('event="', 1)[1].split('"', 1)[0]
            events[name] = events.get(name, 0.0) + float(line.split()[-1])
    return events


async def measure(orchestrators: dict[str, Server], model: str, words: int, concurrency: int, rounds: int,
                  max_tokens: int) -> dict[str, Any]:
    prompt = prompt_of(words)
    samples: dict[str, list[dict[str, Any]]] = {mode: [] for mode in MODES}
    clients = {mode: AsyncOpenAI(base_url=server.url + "/v1", api_key="none", timeout=600.0, max_retries=0)
               for mode, server in orchestrators.items()}
    try:
        for mode in MODES:  # warm-up at this length: first-call costs are not the figure
            await stream_chat(clients[mode], model, prompt, max_tokens)
        for n in range(rounds):
            for mode in (MODES if n % 2 == 0 else MODES[::-1]):
                samples[mode] += await asyncio.gather(*(stream_chat(clients[mode], model, prompt, max_tokens)
                                                        for _ in range(concurrency)))
    finally:
        for client in clients.values():
            await client.close()
    point: dict[str, Any] = {"prompt_words": words, "concurrency": concurrency,
                             "prompt_tokens": samples[MODES[0]][0]["prompt_tokens"]}
    for mode, runs in samples.items():
        ttfts = [r["ttft_ms"] for r in runs]
        point[mode] = {"ttft_ms_p50": percentile(ttfts, 50), "ttft_ms_p90": percentile(ttfts, 90),
                       "ttft_ms": ttfts}
    point["p50_ratio"] = ratio(point["generation_first"]["ttft_ms_p50"], point["context_first"]["ttft_ms_p50"])
    point["p90_ratio"] = ratio(point["generation_first"]["ttft_ms_p90"], point["context_first"]["ttft_ms_p90"])
    texts = {r["text"] for runs in samples.values() for r in runs}
    point["identical_output"] = len(texts) == 1
    point["text"] = sorted(texts)[0]
    return point


def run(prompt_words: tuple[int, ...] = PROMPT_WORDS, concurrency: tuple[int, ...] = (1, 4), rounds: int = 5,
        max_tokens: int = MAX_TOKENS, lifecycles: tuple[str, ...] = ("v0", "v1"),
        startup_timeout_s: float = 300.0, model_path: str | None = None) -> dict[str, Any]:
    """``model_path`` None serves the default model (the figures); the smoke test passes a tiny random GGUF."""
    extra = ["--blas-threads", "1", *(["--model", model_path] if model_path else [])]
    points: list[dict[str, Any]] = []
    events: dict[str, dict[str, dict[str, float]]] = {}
    with Processes() as processes:
        for lifecycle in lifecycles:
            orchestrators = start_pair(processes, lifecycle, extra, startup_timeout_s)
            models = orjson.loads(common.http_get(orchestrators["context_first"].url, "/v1/models")[1])
            model = str(models["data"][0]["id"])
            for words in prompt_words:
                for level in concurrency:
                    point = {"lifecycle": lifecycle, **asyncio.run(measure(orchestrators, model, words, level,
                                                                           rounds, max_tokens))}
                    points.append(point)
                    print(f"[generation_first] {lifecycle} {point['prompt_tokens']} tokens x{level}: TTFT p50 "
                          f"ctx-first {point['context_first']['ttft_ms_p50']:.0f} ms, gen-first "
                          f"{point['generation_first']['ttft_ms_p50']:.0f} ms, identical "
                          f"{point['identical_output']}", file=sys.stderr, flush=True)
            events[lifecycle] = {mode: lifecycle_events(server) for mode, server in orchestrators.items()}
            processes.stop()  # one pair at a time on the machine
    return {
        "benchmark": "generation_first",
        "method": {"rounds": rounds, "max_tokens": max_tokens, "prompt_words": list(prompt_words),
                   "concurrency": list(concurrency), "lifecycles": list(lifecycles), "blas_threads": 1,
                   "temperature": 0, "ignore_eos": True, "endpoint": "/v1/chat/completions (streamed)",
                   "statistic": "p50 / p90 over rounds x concurrency requests, after one warm-up per schedule"},
        "points": points,
        "lifecycle_events": events,
        "all_identical": all(p["identical_output"] for p in points),
    }


def tables(result: dict[str, Any]) -> str:
    rows = [[p["lifecycle"], p["prompt_tokens"], p["concurrency"],
             fmt(p["context_first"]["ttft_ms_p50"], 0), fmt(p["context_first"]["ttft_ms_p90"], 0),
             fmt(p["generation_first"]["ttft_ms_p50"], 0), fmt(p["generation_first"]["ttft_ms_p90"], 0),
             f"{fmt(p['p50_ratio'])}x", f"{fmt(p['p90_ratio'])}x", "yes" if p["identical_output"] else "**no**"]
            for p in result["points"]]
    return report.markdown_table(["lifecycle", "prompt tokens", "concurrency", "ctx-first p50 ms", "ctx-first p90 ms",
                           "gen-first p50 ms", "gen-first p90 ms", "p50 gen/ctx", "p90 gen/ctx",
                           "same answers"], rows)


def main(argv: list[str] | None = None) -> int:
    parser = arguments(__doc__)
    parser.add_argument("--quick", action="store_true", help="concurrency 1 only, 3 rounds")
    parser.add_argument("--v0-only", action="store_true", help="leave out the lifecycle-v1 pair")
    parser.add_argument("--out", default=None, help="write the JSON here (e.g. bench-results/generation_first.json)")
    args = parser.parse_args(argv)
    lifecycles = ("v0",) if args.v0_only else ("v0", "v1")
    result = run(concurrency=(1,) if args.quick else (1, 4), rounds=3 if args.quick else 5, lifecycles=lifecycles)
    code = report.print_and_save(result, tables, args.out)
    return code if result["all_identical"] else 1


if __name__ == "__main__":
    sys.exit(main())

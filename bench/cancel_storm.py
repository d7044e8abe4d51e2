"""Benchmark: a cancel storm on the reference engine, then one short request; its TTFT against an idle system.

Ten streamed completions with long prompts (~2,000 tokens each) are sent at once and abandoned after 100 ms (the
client closes its TCP connection: no request is finished, no ``[DONE]`` read). Right after, one short streamed
request (~50 tokens) follows and its time to first token is measured. If no abort reaches the engine, that request
queues behind twenty thousand tokens of prefill nobody will read; if every abort lands within one scheduling step,
it is served almost as fast as on an idle system. Measured once on one aggregated (``both``) worker and once on the
disaggregated path (orchestrator + CTX + GEN, each its own process), every worker with ``--blas-threads 1``.

    python -m bench.cancel_storm [--json PATH] [--rounds N]
"""

from __future__ import annotations

import argparse
import statistics
import time
from typing import Any

import httpx

from bench.common import (
    Processes,
    Server,
    fmt,
    http_get,
    markdown_table,
    open_raw_post,
    print_and_save,
    ratio,
)
from bench.reference import prompt_of, start_reference_system, stream_once

STORM_REQUESTS = 10
LONG_WORDS = 2_000
SHORT_WORDS = 50
CANCEL_AFTER_S = 0.1
SHORT_MAX_TOKENS = 4
TARGET_RATIO = 2.0



def storm(url: str, model: str, requests: int, long_words: int, cancel_after_s: float) -> None:
    body = {"model": model, "prompt": prompt_of(long_words), "max_tokens": 64, "temperature": 0,
            "ignore_eos": True, "stream": True}
    sockets = [open_raw_post(url, "/v1/completions", body) for _ in range(requests)]
    time.sleep(cancel_after_s)  # the scenario itself: the clients give up after this long
    for sock in sockets:
        sock.close()


def _wait_idle(server: Server, timeout_s: float = 300.0) -> float:
    """Seconds until the worker reports nothing in flight (requests the storm left behind run to their end)."""
    started = time.monotonic()
    while time.monotonic() - started < timeout_s:
        text = http_get(server.url, "/metrics", timeout_s=10)[1].decode()
        inflight = sum(float(line.split()[-1]) for line in text.splitlines()
                       if line.startswith("disagg_engine_inflight_requests{"))
        if inflight == 0:
            return time.monotonic() - started
        time.sleep(0.05)
    raise RuntimeError(f"{server.name} still busy after {timeout_s:.0f} s")


def measure(url: str, model: str, workers: list[Server], rounds: int, requests: int, long_words: int,
            short_words: int, cancel_after_s: float) -> dict[str, Any]:
    short = prompt_of(short_words)
    idle: list[float] = []
    after: list[float] = []
    drain: list[float] = []
    with httpx.Client(timeout=httpx.Timeout(600.0, connect=10.0)) as client:
        stream_once(client, url, model, short, SHORT_MAX_TOKENS)  # warm-up
        for _ in range(rounds):
            idle.append(stream_once(client, url, model, short, SHORT_MAX_TOKENS)["ttft_ms"])
            storm(url, model, requests, long_words, cancel_after_s)
            after.append(stream_once(client, url, model, short, SHORT_MAX_TOKENS)["ttft_ms"])
            drain.append(max(_wait_idle(worker) for worker in workers))
    idle_ms, after_ms = statistics.median(idle), statistics.median(after)
    return {"idle_ttft_ms": idle_ms, "after_storm_ttft_ms": after_ms, "ratio": ratio(after_ms, idle_ms),
            "drain_after_short_s": statistics.median(drain), "idle_runs_ms": idle, "after_runs_ms": after}


def run(rounds: int = 3, requests: int = STORM_REQUESTS, long_words: int = LONG_WORDS,
        short_words: int = SHORT_WORDS, cancel_after_s: float = CANCEL_AFTER_S,
        startup_timeout_s: float = 300.0, model_path: str | None = None) -> dict[str, Any]:
    extra = ["--blas-threads", "1", *(["--model", model_path] if model_path else [])]
    setups: dict[str, dict[str, Any]] = {}
    with Processes() as processes:
        system = start_reference_system(processes, extra, startup_timeout_s)
        model = system.model
        both, ctx, gen, orchestrator = system.both, system.ctx, system.gen, system.orchestrator
        for name, url, workers in (("aggregated", both.url, [both]),
                                   ("disaggregated", orchestrator.url, [ctx, gen])):
            setups[name] = measure(url, model, workers, rounds, requests, long_words, short_words, cancel_after_s)
    return {
        "benchmark": "cancel_storm",
        "method": {"rounds": rounds, "storm_requests": requests, "long_prompt_words": long_words,
                   "short_prompt_words": short_words, "cancel_after_s": cancel_after_s,
                   "short_max_tokens": SHORT_MAX_TOKENS, "statistic": "median of rounds", "blas_threads": 1,
                   "target_ratio": TARGET_RATIO},
        "setups": setups,
    }


def tables(result: dict[str, Any]) -> str:
    method = result["method"]
    rows = [[name, fmt(s["idle_ttft_ms"], 0), fmt(s["after_storm_ttft_ms"], 0), f"{fmt(s['ratio'], 1)}x",
             "yes" if s["ratio"] <= method["target_ratio"] else "no", fmt(s["drain_after_short_s"], 2)]
            for name, s in result["setups"].items()]
    header = (f"Cancel storm: {method['storm_requests']} streamed requests of ~{method['long_prompt_words']} prompt "
              f"tokens abandoned after {method['cancel_after_s'] * 1000:.0f} ms, then one ~"
              f"{method['short_prompt_words']}-token request (median of {method['rounds']} rounds)\n\n")
    return header + markdown_table(
        ["setup", "idle TTFT ms", "TTFT after storm ms", "ratio", f"within {method['target_ratio']:g}x",
         "busy after short request s"], rows)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--json", default="bench-results/cancel_storm.json", help="write the result here")
    args = parser.parse_args(argv)
    return print_and_save(run(rounds=args.rounds), tables, args.json)


if __name__ == "__main__":
    raise SystemExit(main())

"""A cancel storm on the reference engine, then one short request: its TTFT against an idle system, as a
distribution over rounds.

    python -m bench.cancel_storm [--json PATH] [--rounds N]

Ten long streamed completions are abandoned 100 ms in, then one short request follows: if no abort reaches the
engine it queues behind their prefill. Measured on one aggregated worker and on the disaggregated path; p50, p90 and
max per set-up (a median alone hides the tail a user meets one request in ten).
"""

from __future__ import annotations

import time
from typing import Any

import httpx

from bench.driver.common import Processes, Server, arguments, http_get, open_raw_post
from bench.driver.machine import loadavg
from bench.driver.report import fmt, markdown_table, print_and_save
from bench.reference import prompt_of, start_reference_system, stream_once
from entrypoints.bench.statistics import percentile, ratio

STORM_REQUESTS = 10
LONG_WORDS = 2_000
SHORT_WORDS = 50
CANCEL_AFTER_S = 0.1
SHORT_MAX_TOKENS = 4
ROUNDS = 10
TARGET_RATIO = 1.5  # the p90 of TTFT after a storm against the p90 of idle TTFT


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


def distribution(values: list[float]) -> dict[str, float]:
    return {"p50": percentile(values, 50), "p90": percentile(values, 90), "max": max(values)}


def measure(url: str, model: str, workers: list[Server], rounds: int, requests: int, long_words: int,
            short_words: int, cancel_after_s: float) -> dict[str, Any]:
    short = prompt_of(short_words)
    runs: list[dict[str, Any]] = []
    with httpx.Client(timeout=httpx.Timeout(600.0, connect=10.0)) as client:
        stream_once(client, url, model, short, SHORT_MAX_TOKENS)  # warm-up
        for _ in range(rounds):
            idle = stream_once(client, url, model, short, SHORT_MAX_TOKENS)["ttft_ms"]
            storm(url, model, requests, long_words, cancel_after_s)
            after = stream_once(client, url, model, short, SHORT_MAX_TOKENS)["ttft_ms"]
            drain = max(_wait_idle(worker) for worker in workers)
            load = loadavg()
            runs.append({"idle_ttft_ms": idle, "after_storm_ttft_ms": after, "ratio": ratio(after, idle),
                         "drain_after_short_s": drain, "loadavg_1m": load[0] if load else None})
    idle_ms = distribution([r["idle_ttft_ms"] for r in runs])
    after_ms = distribution([r["after_storm_ttft_ms"] for r in runs])
    p90_ratio = ratio(after_ms["p90"], idle_ms["p90"])
    return {"idle_ttft_ms": idle_ms, "after_storm_ttft_ms": after_ms,
            "p50_ratio": ratio(after_ms["p50"], idle_ms["p50"]), "p90_ratio": p90_ratio,
            "within_target": p90_ratio <= TARGET_RATIO,
            "drain_after_short_s": distribution([r["drain_after_short_s"] for r in runs]), "rounds": runs}


def run(rounds: int = ROUNDS, requests: int = STORM_REQUESTS, long_words: int = LONG_WORDS,
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
                   "short_max_tokens": SHORT_MAX_TOKENS, "blas_threads": 1,
                   "statistic": "p50 / p90 / max over rounds; ratio of p90s", "target_p90_ratio": TARGET_RATIO},
        "setups": setups,
    }


def tables(result: dict[str, Any]) -> str:
    method = result["method"]
    rows = []
    for name, s in result["setups"].items():
        idle, after = s["idle_ttft_ms"], s["after_storm_ttft_ms"]
        rows.append([name, fmt(idle["p50"], 0), fmt(idle["p90"], 0), fmt(idle["max"], 0), fmt(after["p50"], 0),
                     fmt(after["p90"], 0), fmt(after["max"], 0), f"{fmt(s['p50_ratio'], 2)}x",
                     f"{fmt(s['p90_ratio'], 2)}x", "yes" if s["within_target"] else "no",
                     fmt(s["drain_after_short_s"]["max"], 2)])
    header = (f"Cancel storm: {method['storm_requests']} streamed requests of ~{method['long_prompt_words']} prompt "
              f"tokens abandoned after {method['cancel_after_s'] * 1000:.0f} ms, then one ~"
              f"{method['short_prompt_words']}-token request ({method['rounds']} rounds)\n\n")
    return header + markdown_table(
        ["setup", "idle p50 ms", "idle p90 ms", "idle max ms", "after p50 ms", "after p90 ms", "after max ms",
         "p50 ratio", "p90 ratio", f"p90 within {method['target_p90_ratio']:g}x", "busy after short, max s"], rows)


def main(argv: list[str] | None = None) -> int:
    parser = arguments(__doc__)
    parser.add_argument("--rounds", type=int, default=ROUNDS)
    parser.add_argument("--json", default="bench-results/cancel_storm.json", help="write the result here")
    args = parser.parse_args(argv)
    return print_and_save(run(rounds=args.rounds), tables, args.json)


if __name__ == "__main__":
    raise SystemExit(main())

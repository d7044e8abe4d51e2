"""The whole system under load on the synthetic engine: the orchestrator's added latency and CPU.

``python -m bench.system_load``: orchestrator + CTX + GEN as ``disagg-serve`` subprocesses, the load generator and
the event-loop prober as processes of their own. Each prompt size and concurrency runs through the orchestrator and
with a client that calls CTX then GEN itself; the difference is the orchestrator's added latency, and the worst
point runs again under py-spy. ``--tokenizer reference`` and ``--tokenize-compare`` make CTX pay real tokenization.
Method: docs/benchmarks.md, "The system under load".
"""

from __future__ import annotations

import json
import sys
import time
from dataclasses import dataclass, field, replace
from typing import Any

from bench.driver import py_spy
from bench.driver.bodies import corpus_text, prompt_text
from bench.driver.common import (
    TOKENIZE_SETUPS,
    Processes,
    Server,
    arguments,
    chars_per_token,
    free_port,
    orchestrator_config,
    orchestrator_help,
    wait_healthy,
    worker_args,
)
from bench.driver.load_point import Phases, lag_in_window, run_loadgen, start_prober, stop_prober
from bench.driver.machine import wait_for_quiet
from bench.driver.report import print_and_save
from bench.system_load.report import TARGET_PROMPT, tables

PROMPTS = (1_024, 40_000, 131_072)
CONCURRENCY = (1, 16, 64, 256)
MAX_TOKENS = 8


FULL = Phases()
QUICK = Phases(warmup_s=0.5, max_warmup_s=8.0, measure_s=2.0, max_measure_s=6.0, tail_s=15.0, max_total_s=35.0,
               quiet_wait_s=0.0)


@dataclass(frozen=True)
class Tokenization:
    """How the workers tokenize: ``--tokenizer``, more worker flags (a --tokenize-compare set-up's), the prompts'
    text (the load generator's ``words`` or, for a real tokenizer, real text: ``corpus``) and its characters per
    token of a prompt's size."""

    tokenizer: str = "byte"
    worker_flags: tuple[str, ...] = ()
    chars_per_token: float = 1.0
    distinct_prompts: bool = False  # each request a prompt of its own (the load generator's distinct_body)
    text: str = "words"

    @classmethod
    def measured(cls, tokenizer: str) -> Tokenization:
        if tokenizer == "byte":
            return cls(tokenizer, (), chars_per_token(prompt_text(40_000), tokenizer))
        # on a few repeated words a BPE's word cache answers nearly every word: real text costs what it costs
        return cls(tokenizer, (), chars_per_token(corpus_text(200_000, seed=1), tokenizer), text="corpus")

    def flags(self) -> list[str]:
        return (["--tokenizer", self.tokenizer] if self.tokenizer != "byte" else []) + list(self.worker_flags)

    def chars(self, tokens: int) -> int:
        return round(tokens * self.chars_per_token)


@dataclass
class Cluster:
    ctx: Server
    gen: Server
    orchestrator: Server
    tokenization: Tokenization = field(default_factory=Tokenization)

    @property
    def pids(self) -> dict[str, int]:
        return {"orchestrator": self.orchestrator.pid, "ctx": self.ctx.pid, "gen": self.gen.pid}

    @property
    def urls(self) -> dict[str, str]:
        return {"orchestrator": self.orchestrator.url, "ctx": self.ctx.url, "gen": self.gen.url}


def start_cluster(processes: Processes, orchestrator_args: list[str] | None = None,
                  startup_timeout_s: float = 60.0, tokenization: Tokenization | None = None) -> Cluster:
    tokenization = tokenization or Tokenization()
    flags = tokenization.flags()
    ctx_port, gen_port = free_port(), free_port()
    ctx = processes.disagg_serve("ctx", worker_args("context", "synthetic", ctx_port, *flags), ctx_port)
    gen = processes.disagg_serve("gen", worker_args("generation", "synthetic", gen_port, *flags), gen_port)
    wait_healthy([ctx, gen], startup_timeout_s)
    orchestrator = start_orchestrator(processes, ctx, gen, "orchestrator", orchestrator_args or [],
                                      startup_timeout_s)
    return Cluster(ctx, gen, orchestrator, tokenization)


def start_orchestrator(processes: Processes, ctx: Server, gen: Server, name: str, args: list[str],
                       startup_timeout_s: float = 60.0, **options: Any) -> Server:
    port = free_port()
    config = orchestrator_config(processes.log_dir / f"{name}-{port}.yaml", port, [ctx.url], [gen.url], **options)
    orchestrator = processes.disagg_serve(name, ["orchestrator", "--config", str(config), *args], port)
    wait_healthy([orchestrator], startup_timeout_s)
    return orchestrator


def run_cell(processes: Processes, cluster: Cluster, mode: str, prompt: int, concurrency: int,
             phases: Phases) -> dict[str, Any]:
    config = {"mode": mode, "url": cluster.orchestrator.url, "ctx_url": cluster.ctx.url, "gen_url": cluster.gen.url,
              "prompt_chars": cluster.tokenization.chars(prompt), "prompt_tokens": prompt, "max_tokens": MAX_TOKENS,
              "concurrency": concurrency, "pids": cluster.pids,
              "distinct_prompts": cluster.tokenization.distinct_prompts, "text": cluster.tokenization.text,
              **phases.loadgen(concurrency)}
    out = processes.log_dir / f"probe-{mode}-{prompt}-{concurrency}-{time.monotonic_ns()}.json"
    quiet = wait_for_quiet(phases.quiet_wait_s)
    prober = start_prober(processes, cluster.urls, out, phases.max_total_s + 90)
    try:
        result = run_loadgen(processes, config)
    finally:
        samples = stop_prober(processes, prober, out)
    window = (result["window_wall"][0], result["window_wall"][1])
    result["event_loop_lag_ms"] = lag_in_window(samples, window)
    result["machine_before"] = quiet
    print(f"[system_load] {mode:>12} prompt {prompt:>7,} c={concurrency:<3} {result['requests_per_s']:8.1f} req/s "
          f"TTFT p50 {result['ttft_ms']['p50']:8.1f} ms p99 {result['ttft_ms']['p99']:8.1f} ms "
          f"errors {result['errors']}", file=sys.stderr, flush=True)
    return result


def idle_probe(processes: Processes, cluster: Cluster, seconds: float) -> dict[str, Any]:
    """``seconds`` worth of probes (one every 20 ms) on the idle system, counted rather than timed: on a busy
    machine the window stretches instead of coming back empty."""
    out = processes.log_dir / "probe-idle.json"
    count = max(1, round(seconds / 0.020))
    prober = start_prober(processes, cluster.urls, out, seconds + 300, samples=count)
    prober.process.wait(timeout=seconds + 300)
    samples = stop_prober(processes, prober, out)
    return lag_in_window(samples, (0.0, float("inf")))


def profile_cell(processes: Processes, cluster: Cluster, prompt: int, concurrency: int,
                 phases: Phases) -> dict[str, Any]:
    raw = processes.log_dir / f"py-spy-{prompt}-{concurrency}.txt"
    summary, result = py_spy.profile(processes, cluster.orchestrator.pid, raw, int(phases.max_total_s),
                                     lambda: run_cell(processes, cluster, "orchestrator", prompt, concurrency, phases))
    if result is None or not summary["available"]:
        return summary
    summary.update({"prompt_tokens": prompt, "concurrency": concurrency,
                    "requests_per_s": result["requests_per_s"], "ttft_ms": result["ttft_ms"],
                    "cpu_ms_per_request": result["cpu_ms_per_request"]})
    return summary


# -- the whole benchmark -----------------------------------------------------------------------------------------
def run(prompts: tuple[int, ...] = PROMPTS, concurrency: tuple[int, ...] = CONCURRENCY, phases: Phases = FULL,
        profile: bool = True, api_workers: bool = True, idle_s: float = 2.0, tokenizer: str = "byte",
        tokenize_compare: bool = False, distinct_prompts: bool = False) -> dict[str, Any]:
    tokenization = replace(Tokenization.measured("reference" if tokenize_compare else tokenizer),
                           distinct_prompts=distinct_prompts)
    result: dict[str, Any] = {
        "benchmark": "system_load",
        "method": {"max_tokens": MAX_TOKENS, "endpoint": "/v1/completions", "stream": True,
                   "phases": phases.__dict__, "prober_interval_ms": 20, "engine": "synthetic (TTFT 0, ITL 0)",
                   "tokenizer": tokenization.tokenizer, "chars_per_token": tokenization.chars_per_token,
                   "distinct_prompts": distinct_prompts, "text": tokenization.text},
        "cells": [],
    }
    with Processes() as processes:
        cluster = start_cluster(processes, tokenization=tokenization)
        result["idle_probe_ms"] = idle_probe(processes, cluster, idle_s)
        for prompt in prompts:
            for level in concurrency:
                for mode in ("orchestrator", "direct"):
                    wait_healthy([cluster.ctx, cluster.gen, cluster.orchestrator], 30)
                    result["cells"].append(run_cell(processes, cluster, mode, prompt, level, phases))
        result["metadata_only"] = metadata_only_scenario(processes, cluster, prompts, concurrency, phases)
        worst = worst_cell(result["cells"])
        if profile and worst is not None:
            result["profile"] = profile_cell(processes, cluster, worst["prompt_tokens"], worst["concurrency"],
                                             phases)
            target = (TARGET_PROMPT if TARGET_PROMPT in prompts else max(prompts), min(concurrency))
            if target != (worst["prompt_tokens"], worst["concurrency"]):
                result["profile_at_target"] = profile_cell(processes, cluster, *target, phases)
        processes.stop()
        if api_workers:
            result["api_workers"] = api_workers_scenario(prompts, concurrency, phases, tokenization)
    if tokenize_compare:
        result["tokenize_compare"] = tokenize_compare_scenario(prompts, concurrency, phases, tokenization)
    return result


def worst_cell(cells: list[dict[str, Any]]) -> dict[str, Any] | None:
    """The orchestrator-mode point with the worst time to first token (p99) as clients see it."""
    candidates = [c for c in cells if c["mode"] == "orchestrator"]
    if not candidates:
        return None
    return max(candidates, key=lambda c: c["ttft_ms"].get("p99") or 0.0)


def ctx_reply_cost(ctx: Server, prompt_chars: int, with_b64: bool, seconds: float = 1.0,
                   text: str = "words") -> dict[str, float]:
    """CTX's answer for one prompt of ``prompt_chars`` characters with and without the b64 prompt: its size, and
    CTX's CPU per request (one request at a time over a keep-alive connection, utime + stime of the CTX process)."""
    import http.client

    from bench.driver.loadgen import client_body
    from bench.driver.machine import cpu_seconds

    body = client_body("completions", prompt_chars, MAX_TOKENS, stream=False, text=text)
    body["disaggregated_params"] = {"request_type": "context_only", "disagg_request_id": 1,
                                    "return_prompt_token_ids_b64": with_b64,
                                    "native_extensions": True}  # the answer our orchestrator reads
    payload = json.dumps(body).encode()
    host, _, port = ctx.url.removeprefix("http://").partition(":")
    connection = http.client.HTTPConnection(host, int(port), timeout=60)
    count, size = 0, 0
    try:
        def post() -> int:
            connection.request("POST", "/v1/completions", body=payload, headers={"Content-Type": "application/json"})
            response = connection.getresponse()
            content = response.read()
            if response.status != 200:
                raise RuntimeError(f"CTX answered {response.status}: {content[:200]!r}")
            return len(content)

        for _ in range(3):
            size = post()
        cpu0, wall0 = cpu_seconds(ctx.pid), time.perf_counter()
        while time.perf_counter() - wall0 < seconds or count < 5:
            post()
            count += 1
        cpu1, wall1 = cpu_seconds(ctx.pid), time.perf_counter()
    finally:
        connection.close()
    return {"bytes": size, "cpu_ms": (cpu1 - cpu0) * 1e3 / count, "wall_ms": (wall1 - wall0) * 1e3 / count}


def metadata_only_scenario(processes: Processes, cluster: Cluster, prompts: tuple[int, ...],
                           concurrency: tuple[int, ...], phases: Phases) -> dict[str, Any]:
    """The same load through a second orchestrator with ``gen_tokids_metadata_only: true`` (GEN gets prompt_len,
    not the b64 prompt; the synthetic engine's hand-off has no tokens, so the prompt text still travels)."""
    prompt = TARGET_PROMPT if TARGET_PROMPT in prompts else max(prompts)
    levels = [c for c in concurrency if c <= 16][:2] or [min(concurrency)]
    meta = start_orchestrator(processes, cluster.ctx, cluster.gen, "orchestrator-metadata-only", [],
                              gen_tokids_metadata_only=True)
    meta_cluster = Cluster(cluster.ctx, cluster.gen, meta, cluster.tokenization)
    runs = []
    try:
        for level in levels:
            cell = run_cell(processes, meta_cluster, "orchestrator", prompt, level, phases)
            cell["variant"] = "metadata_only"
            runs.append(cell)
    finally:
        processes.stop([meta])
    seconds = 1.0 if phases.measure_s >= FULL.measure_s else 0.3
    chars, text = cluster.tokenization.chars(prompt), cluster.tokenization.text
    return {"prompt_tokens": prompt, "runs": runs,
            "ctx_reply": {"with_b64": ctx_reply_cost(cluster.ctx, chars, True, seconds, text),
                          "without_b64": ctx_reply_cost(cluster.ctx, chars, False, seconds, text)}}


def api_workers_scenario(prompts: tuple[int, ...], concurrency: tuple[int, ...], phases: Phases,
                         tokenization: Tokenization | None = None) -> dict[str, Any]:
    if "--api-workers" not in orchestrator_help():
        return {"available": False,
                "note": "`disagg-serve orchestrator --api-workers N` does not exist yet; the scenario runs as soon "
                        "as it does"}
    prompt = TARGET_PROMPT if TARGET_PROMPT in prompts else max(prompts)
    levels = [c for c in concurrency if c >= 16][:2] or [max(concurrency)]
    runs = []
    for workers in (1, 2):
        with Processes() as processes:
            cluster = start_cluster(processes, ["--api-workers", str(workers)], tokenization=tokenization)
            for level in levels:
                cell = run_cell(processes, cluster, "orchestrator", prompt, level, phases)
                cell["api_workers"] = workers
                runs.append(cell)
    return {"available": True, "prompt_tokens": prompt, "runs": runs}


def tokenize_compare_scenario(prompts: tuple[int, ...], concurrency: tuple[int, ...], phases: Phases,
                              tokenization: Tokenization) -> dict[str, Any]:
    """The orchestrator's load at the target prompt (concurrency up to 16) on fresh workers once per tokenization
    set-up (TOKENIZE_SETUPS: a full `tokenizers` encode of every prompt, then the defaults), one after another."""
    prompt = TARGET_PROMPT if TARGET_PROMPT in prompts else max(prompts)
    levels = [c for c in concurrency if c <= 16] or [min(concurrency)]
    runs = []
    for setup, flags in TOKENIZE_SETUPS.items():
        with Processes() as processes:
            cluster = start_cluster(processes, tokenization=replace(tokenization, worker_flags=flags))
            for level in levels:
                cell = run_cell(processes, cluster, "orchestrator", prompt, level, phases)
                cell["tokenize"] = setup
                runs.append(cell)
    return {"prompt_tokens": prompt, "setups": {name: list(flags) for name, flags in TOKENIZE_SETUPS.items()},
            "runs": runs}


def main(argv: list[str] | None = None) -> int:
    parser = arguments(__doc__)
    parser.add_argument("--prompts", type=int, nargs="+", default=list(PROMPTS))
    parser.add_argument("--concurrency", type=int, nargs="+", default=list(CONCURRENCY))
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--no-profile", action="store_true")
    parser.add_argument("--tokenizer", choices=("byte", "reference"), default="byte",
                        help="the workers' tokenizer: byte (free) or the reference model's real one (default byte)")
    parser.add_argument("--tokenize-compare", action="store_true",
                        help="with the reference tokenizer, also run the target prompt on a full `tokenizers` "
                             "encode of every prompt (--tokenize-cache-mb 0 --tokenizer-backend tokenizers) and on "
                             "the defaults, side by side")
    parser.add_argument("--distinct-prompts", action="store_true",
                        help="each request opens its prompt with its own number (a new prompt every time, which no "
                             "cache holds), instead of every request of a point sending the same prompt")
    parser.add_argument("--json", default=None)
    args = parser.parse_args(argv)
    result = run(tuple(args.prompts), tuple(args.concurrency), QUICK if args.quick else FULL,
                 profile=not args.no_profile, tokenizer=args.tokenizer, tokenize_compare=args.tokenize_compare,
                 distinct_prompts=args.distinct_prompts)
    return print_and_save(result, tables, args.json)

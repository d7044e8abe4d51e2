"""What the orchestrator process costs per request, beside a plain pass-through proxy and the Rust gateways moving
the same requests.

``python -m bench.orchestrator_cost [--quick] [--docs] [--endpoint chat|completions|both] [--no-gateways]``. Every
set-up stands in front of mock workers (``bench.peers.mock_workers``), each load point taking its turn; the load
generator runs in its own process and CPU per request is the proxy's process tree's over the window. Method:
docs/benchmarks.md, "The orchestrator's own cost".
"""

from __future__ import annotations

import os
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from bench.driver import py_spy, report
from bench.driver.common import (
    PYTHON,
    Processes,
    Server,
    StartupError,
    add_docs_flag,
    arguments,
    free_port,
    orchestrator_config,
    wait_healthy,
)
from bench.driver.load_point import Phases, run_loadgen
from bench.driver.loadgen import PATHS
from bench.driver.machine import machine_info, tree_cpu_seconds, wait_for_quiet
from bench.driver.report import fmt
from bench.orchestrator_cost.report import (
    BASELINE,
    ENDPOINTS,
    MAX_TOKENS,
    METADATA_ONLY,
    generated_block,
    method_note,
    plot,
    tables,
    targets_table,
)
from bench.peers import rust_gateways

PROMPTS = (1_024, 40_000, 131_072)
CONCURRENCY = (1, 16, 64)
CHARS_PER_TOKEN = 4
TARGET_PROMPT = 131_072
FRAME_GAP_MS = 1.0  # between GEN's streamed frames

FULL = Phases(warmup_s=0.5, max_warmup_s=10.0, measure_s=2.5, max_measure_s=12.0, tail_s=20.0, max_total_s=45.0,
              quiet_wait_s=5.0)
QUICK = Phases(warmup_s=0.2, max_warmup_s=5.0, measure_s=0.8, max_measure_s=5.0, tail_s=10.0, max_total_s=25.0,
               quiet_wait_s=0.0)


# The orchestrator set-ups measured beside the baseline: name -> extra orchestrator config.
ORCHESTRATORS: dict[str, dict[str, Any]] = {"orchestrator": {}}
API_WORKERS = "api_workers"  # a set-up's front-end processes (``--api-workers``): a flag, not a config key
CTX_ROUTER = "ctx_router"  # a set-up's CTX router type (context_servers.router.type), written into its config
ROUND_ROBIN = "orchestrator, round_robin"  # --compare-router: beside the default (cache_aware), the prefix
# chain's cost (one CRC-32 pass over the prompt) shows as the difference


def api_workers_setup(count: int) -> tuple[str, dict[str, Any]]:
    """The orchestrator with ``count`` front-end processes sharing its port, measured at the highest concurrency
    only (its target: req/s there against one process)."""
    return f"orchestrator x{count}", {API_WORKERS: count}


# -- the processes ------------------------------------------------------------------------------------------------
@dataclass
class Mocks:
    ctx: Server  # in our wire (TensorRT-LLM's): the orchestrator, the pass-through proxy and the direct client
    gen: Server  # every set-up's GEN
    flavoured: dict[str, Server] = field(default_factory=dict)  # a gateway's P/D wire -> its CTX


def start_mocks(processes: Processes, prompt: int, frame_gap_ms: float = FRAME_GAP_MS,
                flavours: tuple[str, ...] = (), tokens: int = MAX_TOKENS) -> Mocks:
    def mock(role: str, *extra: str) -> Server:
        port = free_port()
        return processes.spawn(f"mock-{role}-{prompt}", [
            PYTHON, "-m", "bench.peers.mock_workers", "--role", role.split("-")[0], "--port", str(port),
            "--prompt-tokens", str(prompt), "--tokens", str(tokens), *extra], f"http://127.0.0.1:{port}")

    mocks = Mocks(mock("ctx"), mock("gen", "--frame-gap-ms", str(frame_gap_ms)),
                  {flavour: mock(f"ctx-{flavour}", "--flavour", flavour) for flavour in flavours})
    wait_healthy([mocks.ctx, mocks.gen, *mocks.flavoured.values()], 60)
    return mocks


def start_proxies(processes: Processes, ctx: Server, gen: Server, setups: dict[str, dict[str, Any]]
                  ) -> dict[str, Server]:
    proxies: dict[str, Server] = {}
    for name, options in setups.items():
        port = free_port()
        config_options = {k: v for k, v in options.items() if k not in (API_WORKERS, CTX_ROUTER)}
        if CTX_ROUTER in options:
            config_options["context_servers"] = {"urls": [ctx.url], "router": {"type": options[CTX_ROUTER]}}
        config = orchestrator_config(processes.log_dir / f"{name}-{port}.yaml", port, [ctx.url], [gen.url],
                                     **config_options)
        front_ends = ["--api-workers", str(options[API_WORKERS])] if API_WORKERS in options else []
        proxies[name] = processes.disagg_serve(name, ["orchestrator", "--config", str(config), *front_ends], port)
    port = free_port()
    proxies[BASELINE] = processes.spawn(BASELINE, [PYTHON, "-m", "bench.peers.passthrough_proxy", "--port", str(port),
                                                   "--ctx", ctx.url, "--gen", gen.url], f"http://127.0.0.1:{port}")
    wait_healthy(list(proxies.values()), 60)
    return proxies


def start_gateways(processes: Processes, mocks: Mocks, gateways: dict[str, rust_gateways.Gateway], venv: Path,
                   policy: str, failed: dict[str, str]) -> dict[str, Server]:
    """Each gateway in front of its own CTX mock and the shared GEN, once a request has streamed through it; one
    that does not start is left out (``failed`` says why), not the benchmark."""
    started: dict[str, Server] = {}
    for name, gateway in gateways.items():
        try:
            server = rust_gateways.start(processes, gateway, mocks.flavoured[gateway.flavour].url, mocks.gen.url,
                                         venv, policy)
            rust_gateways.wait_ready(server)
        except (StartupError, RuntimeError, OSError) as exc:
            failed[name] = f"did not start: {str(exc)[:600]}"
            print(f"[orchestrator_cost] skipping {name}: {failed[name]}", file=sys.stderr, flush=True)
            continue
        started[name] = server
    return started


def idle_cpu_ms_per_s(servers: dict[str, Server], seconds: float, settle_s: float = 3.0) -> dict[str, float]:
    """CPU each process burns per second with no request at all (health checks, background loops), measured from
    ``settle_s`` after they answer their health checks: a set-up of several front ends answers as soon as one of
    them does, while the others may still be importing."""
    time.sleep(settle_s)
    start = {name: tree_cpu_seconds(s.pid) for name, s in servers.items()}
    started = time.monotonic()
    time.sleep(seconds)
    elapsed = time.monotonic() - started
    return {name: (tree_cpu_seconds(s.pid) - start[name]) * 1e3 / elapsed for name, s in servers.items()}


def measure(processes: Processes, setup: str, url: str, pid: int | None, ctx: Server, gen: Server, prompt: int,
            concurrency: int, phases: Phases, endpoint: str = "completions",
            legs: tuple[Server, Server] | None = None, tokens: int = MAX_TOKENS) -> dict[str, Any]:
    """One cell: ``concurrency`` clients streaming ``endpoint`` through ``url`` (or directly, when ``pid`` is None).
    ``legs``, the CTX and GEN mocks the proxy calls, are asked how many POSTs they answered meanwhile."""
    mode = "direct" if pid is None else "orchestrator"
    config = {"mode": mode, "url": url, "ctx_url": ctx.url, "gen_url": gen.url, "endpoint": endpoint,
              "prompt_chars": prompt * CHARS_PER_TOKEN, "max_tokens": tokens, "concurrency": concurrency,
              "pids": {"proxy": pid} if pid is not None else {}, "client": "aiohttp",
              **phases.loadgen(concurrency)}
    legs = legs or (ctx, gen)
    wait_for_quiet(phases.quiet_wait_s)
    before = [rust_gateways.mock_posts(leg) for leg in legs]
    cell = run_loadgen(processes, config)
    after = [rust_gateways.mock_posts(leg) for leg in legs]
    cell.update({"setup": setup, "prompt_tokens": prompt, "endpoint": endpoint,
                 "legs": {"ctx_posts": after[0] - before[0], "gen_posts": after[1] - before[1]}})
    print(f"[orchestrator_cost] {setup:>18} {endpoint:>11} prompt {prompt:>7,} c={concurrency:<3} "
          f"CPU {fmt(cell['cpu_ms_per_request'].get('proxy'))} ms/req  TTFT p50 {fmt(cell['ttft_ms']['p50'])} ms  "
          f"{cell['requests_per_s']:7.1f} req/s  errors {cell['errors']}", file=sys.stderr, flush=True)
    return cell


# -- the benchmark -------------------------------------------------------------------------------------------------
def run(prompts: tuple[int, ...] = PROMPTS, concurrency: tuple[int, ...] = CONCURRENCY, phases: Phases = FULL,
        idle_s: float = 10.0, metadata_only: bool = True, profile: bool = False,
        setups: dict[str, dict[str, Any]] | None = None, endpoints: tuple[str, ...] = ENDPOINTS,
        gateways: bool = True, frame_gap_ms: float = FRAME_GAP_MS, gateways_venv: Path = rust_gateways.VENV_DIR,
        install: bool = True, gateway_policy: str = "round_robin", tokens: int = MAX_TOKENS) -> dict[str, Any]:
    setups = dict(setups or ORCHESTRATORS)
    largest = max(prompts)
    found = rust_gateways.prepare(gateways_venv, install) if gateways else {}
    usable = {name: a.gateway for name, a in found.items() if a.available}
    failed: dict[str, str] = {}
    result: dict[str, Any] = {
        "benchmark": "orchestrator_cost",
        "method": {"max_tokens": tokens, "endpoints": {e: PATHS[e] for e in endpoints}, "stream": True,
                   "chars_per_token": CHARS_PER_TOKEN, "frame_gap_ms": frame_gap_ms, "phases": phases.__dict__,
                   "baseline": BASELINE, "setups": setups, "gateway_policy": gateway_policy},
        "gateways": {name: a.as_dict() for name, a in found.items()},
        "cells": [], "idle_cpu_ms_per_s": {}, "machine": machine_info(),
    }
    flavours = tuple(sorted({g.flavour for g in usable.values()}))
    for prompt in prompts:
        with Processes() as processes:
            mocks = start_mocks(processes, prompt, frame_gap_ms, flavours, tokens)
            chosen = dict(setups)
            if metadata_only and prompt == largest:
                chosen[METADATA_ONLY] = {"gen_tokids_metadata_only": True}
            proxies = start_proxies(processes, mocks.ctx, mocks.gen, chosen)
            gateway_servers = start_gateways(processes, mocks, {n: g for n, g in usable.items() if n not in failed},
                                             gateways_venv, gateway_policy, failed)
            proxies.update(gateway_servers)
            legs = {name: (mocks.flavoured[usable[name].flavour], mocks.gen) for name in gateway_servers}
            if not result["idle_cpu_ms_per_s"]:
                result["idle_cpu_ms_per_s"] = idle_cpu_ms_per_s(proxies, idle_s, settle_s=min(3.0, idle_s))
            for level in concurrency:
                for endpoint in endpoints:
                    for name, proxy in proxies.items():
                        if name == METADATA_ONLY and level not in (min(concurrency), max(concurrency)):
                            continue
                        if API_WORKERS in chosen.get(name, {}) and level != max(concurrency):
                            continue
                        result["cells"].append(measure(processes, name, proxy.url, proxy.pid, mocks.ctx, mocks.gen,
                                                       prompt, level, phases, endpoint, legs.get(name),
                                                       tokens=tokens))
                    if level == 1:
                        result["cells"].append(measure(processes, "direct", "", None, mocks.ctx, mocks.gen, prompt,
                                                       level, phases, endpoint, tokens=tokens))
            if profile and prompt == largest:
                result["profile"] = profile_orchestrator(processes, proxies["orchestrator"], mocks.ctx, mocks.gen,
                                                         prompt, phases, endpoints[0], tokens=tokens)
    for name, why in failed.items():
        result["gateways"][name].update({"available": False, "note": why})
    return result


def profile_orchestrator(processes: Processes, orchestrator: Server, ctx: Server, gen: Server, prompt: int,
                         phases: Phases, endpoint: str = "completions", tokens: int = MAX_TOKENS) -> dict[str, Any]:
    raw = processes.log_dir / f"py-spy-cost-{prompt}.txt"
    summary, cell = py_spy.profile(processes, orchestrator.pid, raw, int(phases.max_total_s),
                                   lambda: measure(processes, "orchestrator", orchestrator.url, orchestrator.pid, ctx,
                                                   gen, prompt, 1, phases, endpoint, tokens=tokens))
    if cell is None or not summary["available"]:
        return summary
    summary.update({"prompt_tokens": prompt, "concurrency": 1, "endpoint": endpoint,
                    "cpu_ms_per_request": cell["cpu_ms_per_request"].get("proxy")})
    return summary


def scaling_command(api_workers: int, levels: tuple[int, ...], prompts: tuple[int, ...]) -> dict[str, Any]:
    """What a machine with a core for each front end (beside the mocks and the load generator) should run to check
    that ``--api-workers`` scales throughput, which a machine without spare cores cannot show."""
    level = max(*levels, *CONCURRENCY)  # many clients at once: one process alone must be the bottleneck
    command = (f"python -m bench.orchestrator_cost --prompts {min(prompts)} --concurrency {level} "
               f"--endpoint both --no-gateways --api-workers {api_workers}")
    return {"command": command, "cores_needed": api_workers + 3, "cores_here": os.cpu_count(),
            "note": f"needs {api_workers + 3} or more idle cores: {api_workers} front ends, the two mocks and the load "
                    f"generator (this machine has {os.cpu_count()}); its target row \"req/s of `orchestrator "
                    f"x{api_workers}` >= 1.7x one process\" is the check"}


def main(argv: list[str] | None = None) -> int:
    parser = arguments(__doc__)
    parser.add_argument("--prompts", type=int, nargs="+", default=list(PROMPTS))
    parser.add_argument("--concurrency", type=int, nargs="+", default=list(CONCURRENCY))
    parser.add_argument("--endpoint", choices=("chat", "completions", "both"), default="both",
                        help="what the clients stream: /v1/chat/completions, /v1/completions, or each in turn")
    parser.add_argument("--quick", action="store_true", help="short measurement windows")
    parser.add_argument("--profile", action="store_true", help="also py-spy the orchestrator (largest prompt, c=1)")
    parser.add_argument("--api-workers", type=int, default=1,
                        help="also measure the orchestrator with this many front-end processes (--api-workers), at "
                             "the highest concurrency, and print the throughput check for a machine with spare cores")
    parser.add_argument("--compare-router", action="store_true",
                        help="also measure the orchestrator with the CTX router round_robin (no prefix chain)")
    parser.add_argument("--no-gateways", action="store_true",
                        help="leave out the Rust gateways (vLLM's router, SGLang's Model Gateway)")
    parser.add_argument("--no-install", action="store_true",
                        help="measure the Rust gateways only if already in the side venv (install nothing)")
    parser.add_argument("--gateways-venv", type=Path, default=rust_gateways.VENV_DIR,
                        help="the side venv the Rust gateways are installed into")
    parser.add_argument("--gateway-policy", default="round_robin",
                        help="the Rust gateways' --policy (round_robin: each one's cheapest)")
    parser.add_argument("--frame-gap-ms", type=float, default=FRAME_GAP_MS,
                        help="milliseconds between GEN's streamed frames (0: the whole stream in one burst)")
    parser.add_argument("--tokens", type=int, default=MAX_TOKENS,
                        help="tokens GEN streams per request, one frame each: a run with more, beside one with the "
                             "default, gives each setup's cost per relayed token")
    add_docs_flag(parser, "orchestrator_cost")
    args = parser.parse_args(argv)
    if args.tokens < 2:
        parser.error("--tokens must be at least 2: CTX computes the first token, GEN streams the rest")
    setups = dict(ORCHESTRATORS)
    if args.compare_router:
        setups[ROUND_ROBIN] = {CTX_ROUTER: "round_robin"}
    if args.api_workers > 1:
        name, options = api_workers_setup(args.api_workers)
        setups[name] = options
    endpoints = ENDPOINTS if args.endpoint == "both" else (args.endpoint,)
    result = run(tuple(args.prompts), tuple(args.concurrency), QUICK if args.quick else FULL,
                 profile=args.profile, setups=setups, endpoints=endpoints, gateways=not args.no_gateways,
                 frame_gap_ms=args.frame_gap_ms, tokens=args.tokens, gateways_venv=args.gateways_venv,
                 install=not args.no_install, gateway_policy=args.gateway_policy)
    result["mode"] = "quick" if args.quick else "full"
    if args.api_workers > 1:
        result["scaling_check"] = scaling_command(args.api_workers, tuple(args.concurrency), tuple(args.prompts))
    print(method_note(result) + "\n\n" + targets_table(result) + "\n\n" + tables(result))
    if "scaling_check" in result:
        check = result["scaling_check"]
        print(f"\nThroughput scaling of --api-workers {args.api_workers} is left to a machine with spare cores "
              f"({check['note']}):\n\n    {check['command']}")
    if args.docs:
        report.publish("orchestrator_cost", result, generated_block, plot)
    return 0

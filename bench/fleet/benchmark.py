"""Routers side by side on the same simulated work, against the best any cache could do (the fleet's oracle).

``python -m bench.fleet [--quick] [--docs] [--routers NAME ...] [--workloads NAME ...] [--tokenizer reference]
[--tokenize-compare]``. 8 CTX and 4 GEN simulated workers in one host process (``bench.fleet.host``), one
orchestrator per (router, workload) run on fresh workers, the same seeded work for every router (``work``); hit
ratios from the workers' ``/metrics``, the oracle from the host's ledger (``ledger``). Method: docs/benchmarks.md,
"Routers on a simulated fleet".
"""

from __future__ import annotations

import asyncio
import math
import random
import sys
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Any

import orjson

from bench.driver import report
from bench.driver.bodies import corpus_text
from bench.driver.common import (
    LOOPBACK,
    PYTHON,
    TOKENIZE_SETUPS,
    Processes,
    Server,
    StartupError,
    add_docs_flag,
    arguments,
    chars_per_token,
    free_port,
    http_get,
    wait_healthy,
)
from bench.driver.machine import machine_busy_seconds, machine_info, wait_for_quiet
from bench.driver.report import fmt, write_json
from bench.fleet.client import Record, drive
from bench.fleet.metrics import orchestrator_counters, worker_counters
from bench.fleet.report import generated_block, plot, tables, targets_table
from bench.fleet.work import AGENT, CHAT, MODEL, UNRELATED, WORKLOADS, Session, Workload, sessions, text
from bench.peers.rust_gateways import SMG, VLLM_ROUTER, Gateway, prepare, start_in_front_of, wait_ready
from entrypoints.bench.statistics import percentile

# Each router is one entry: a name for the tables and the CTX pool's router section (another is one more line).
ROUTERS: dict[str, dict[str, Any]] = {
    "round_robin": {"type": "round_robin"},
    "least_loaded": {"type": "least_loaded", "load_metric": "prompt_tokens"},
    "prefix_affinity": {"type": "prefix_affinity"},
    "cache_aware": {"type": "cache_aware"},
    # The same router, and a follow-up that a GEN worker holds all but 512 estimated tokens of is prefilled
    # there (conditional disaggregation on what is cached: docs/routing.md).
    "cache_aware+skip": {"type": "cache_aware", "max_local_prefill_length": 512},
}
_ORCHESTRATOR_KEYS = ("max_local_prefill_length",)  # keys of a ROUTERS entry that are the orchestrator's own
# The Rust gateways (bench.peers.rust_gateways), each in its regular mode in front of the CTX workers, at its
# cache-aware policy: they route whole requests, which the simulated workers serve (prefill, then decode), so what
# is compared is where each puts the prefill work, on the same fleet and work. They read no KV events: they run on
# the fleet that publishes none only. Installed from PyPI into a side venv; one that cannot be had is skipped.
@dataclass(frozen=True)
class GatewayRun:
    gateway: Gateway
    policy: str
    # Fields it adds to a request for its own engines, which our workers refuse as unknown: the fleet's host
    # removes them (vLLM's router sends SGLang's sampling fields with their defaults: no_stop_trim, ...).
    drop_fields: tuple[str, ...] = ()


GATEWAYS: dict[str, GatewayRun] = {
    "sglang_gateway": GatewayRun(SMG, "cache_aware"),
    "vllm_router": GatewayRun(VLLM_ROUTER, "cache_aware", (
        "continue_final_message", "ignore_eos", "include_reasoning", "no_stop_trim", "return_hidden_states",
        "separate_reasoning", "skip_special_tokens", "stream_reasoning")),
}
_SETTLE_S = 1.0  # after the orchestrator is healthy: its first health round and KV-event subscriptions
_METRICS_SETTLE_S = 0.3  # after the last answer, before reading the counters
LONG_PROMPT_TOKENS = 100_000  # follow-ups at least this long are tabled on their own too


@dataclass(frozen=True)
class Engine:
    """The simulated engine of every worker: misses cost ``tokens / prefill_tokens_per_s``."""

    prefill_base_ms: float = 5.0
    prefill_tokens_per_s: float = 40_000.0
    # Per worker. The fleet's 1M tokens hold the chat work's live conversations (~300k), so the oracle (one
    # unbounded cache) is a yardstick routing can be held to; --cache-tokens 32768 shows routing under pressure.
    cache_tokens: int = 131_072
    itl_ms: float = 10.0
    tokenizer: str = "byte"  # the workers' --tokenizer
    worker_flags: tuple[str, ...] = ()  # more flags for every worker (a --tokenize-compare set-up's)
    # Whether the workers publish KV events. Off, they are the fleets most deployments run (vLLM's own servers,
    # trtllm-serve, --api-workers above 1): the orchestrator sees only what it sent where and what answers say.
    kv_events: bool = True

    def flags(self) -> list[str]:
        tokenizer = ["--tokenizer", self.tokenizer] if self.tokenizer != "byte" else []
        events = [] if self.kv_events else ["--kv-events-endpoint", "off"]
        return ["--engine", "simulated", "--served-model-name", MODEL,
                "--simulated-prefill-base-ms", str(self.prefill_base_ms),
                "--simulated-prefill-tokens-per-s", str(self.prefill_tokens_per_s),
                "--simulated-prefix-cache-tokens", str(self.cache_tokens), "--simulated-itl-ms", str(self.itl_ms),
                *tokenizer, *events, *self.worker_flags]


@dataclass(frozen=True)
class Settings:
    ctx_workers: int = 8
    gen_workers: int = 4
    engine: Engine = field(default_factory=Engine)
    workloads: tuple[Workload, ...] = ()
    seed: int = 7
    quiet_wait_s: float = 10.0
    startup_timeout_s: float = 120.0
    tokenize_setups: tuple[str, ...] = ()  # names in TOKENIZE_SETUPS: each run once per set-up; none: once
    events: tuple[bool, ...] = (True,)  # each router on a fleet whose workers publish KV events (True), or not


FULL = Settings(workloads=(CHAT, UNRELATED, AGENT))
QUICK = Settings(workloads=tuple(replace(w, window_s=w.window_s / 4) for w in (CHAT, UNRELATED, AGENT)),
                 quiet_wait_s=0.0)


# -- the processes ----------------------------------------------------------------------------------------------
@dataclass
class Fleet:
    host: Server
    ctx: list[str]
    gen: list[str]
    control: str


def start_fleet(processes: Processes, settings: Settings, name: str, drop_fields: tuple[str, ...] = ()) -> Fleet:
    control_port = free_port()
    argv = [PYTHON, "-m", "bench.fleet.host", "--control-port", str(control_port)]
    if drop_fields:
        argv += ["--drop-fields", *drop_fields]
    ports = {"context": [free_port() for _ in range(settings.ctx_workers)],
             "generation": [free_port() for _ in range(settings.gen_workers)]}
    for role, role_ports in ports.items():
        argv += [arg for port in role_ports for arg in ("--worker", f"{role}:{port}")]
    host = processes.spawn(f"fleet-{name}", [*argv, "--", *settings.engine.flags()],
                           f"http://{LOOPBACK}:{control_port}")
    wait_healthy([host], settings.startup_timeout_s)
    ctx = [f"http://{LOOPBACK}:{p}" for p in ports["context"]]
    gen = [f"http://{LOOPBACK}:{p}" for p in ports["generation"]]
    wait_healthy([Server(url, url, host.process, host.log_path) for url in ctx + gen], settings.startup_timeout_s)
    return Fleet(host, ctx, gen, host.url)


def start_orchestrator(processes: Processes, fleet: Fleet, router: str, name: str, timeout_s: float) -> Server:
    import yaml

    port = free_port()
    config = processes.log_dir / f"{name}.yaml"
    # The CTX pool's router is the one under test; GEN keeps its default (round robin).
    entry = ROUTERS[router]
    ctx_router = {k: v for k, v in entry.items() if k not in _ORCHESTRATOR_KEYS}
    config.write_text(yaml.safe_dump({"hostname": LOOPBACK, "port": port,
                                      "context_servers": {"urls": fleet.ctx, "router": ctx_router},
                                      "generation_servers": {"urls": fleet.gen},
                                      **{k: v for k, v in entry.items() if k in _ORCHESTRATOR_KEYS}}))
    orchestrator = processes.disagg_serve(name, ["orchestrator", "--config", str(config)], port)
    wait_healthy([orchestrator], timeout_s)
    return orchestrator


def start_gateway(processes: Processes, fleet: Fleet, router: str) -> Server:
    """The gateway ``router`` names in front of the CTX workers, once a request has streamed through it; a gateway
    that cannot be installed raises StartupError with the reason."""
    run = GATEWAYS[router]
    found = prepare(install=False, gateways=(run.gateway,), log=False)[run.gateway.name]
    if not found.available:
        raise StartupError(found.note)
    server = start_in_front_of(processes, run.gateway, fleet.ctx, run.policy)
    wait_ready(server, body={"model": MODEL, "messages": [{"role": "user", "content": "ready?"}], "max_tokens": 1,
                             "stream": True})
    return server


_NO_COUNTERS: dict[str, Any] = {"skipped_ctx": None, "prefill_placement": {}, "ctx_finished": None,
                                "routing_decisions": {}}


# -- one run ----------------------------------------------------------------------------------------------------
def run_one(settings: Settings, router: str, workload: Workload, work: Sequence[Session],
            setup: str | None = None, events: bool = True) -> dict[str, Any]:
    """One run on fresh workers; ``setup``: the TOKENIZE_SETUPS entry whose flags every worker gets; ``events``:
    whether they publish KV events."""
    name = f"{router}-{workload.name}" + ("" if events else "-no-events")
    settings = replace(settings, engine=replace(settings.engine, kv_events=events))
    if setup is not None:
        name += "-" + setup.replace(" ", "-")
        settings = replace(settings, engine=replace(settings.engine, worker_flags=TOKENIZE_SETUPS[setup]))
    quiet = wait_for_quiet(settings.quiet_wait_s)
    with Processes() as processes:
        try:
            drop = GATEWAYS[router].drop_fields if router in GATEWAYS else ()
            fleet = start_fleet(processes, settings, name, drop)
        except StartupError as exc:
            # Ports are chosen before the host binds them, and a worker's KV-event sockets take any free port
            # meanwhile: a rare collision stops the host. Once more, on new ports.
            print(f"[fleet] {name}: the worker host did not start ({str(exc).splitlines()[0][:160]}); again",
                  file=sys.stderr, flush=True)
            fleet = start_fleet(processes, settings, f"{name}-again", drop)
        try:
            if router in GATEWAYS:
                orchestrator = start_gateway(processes, fleet, router)
            else:
                orchestrator = start_orchestrator(processes, fleet, router, f"orchestrator-{name}",
                                                  settings.startup_timeout_s)
        except (StartupError, RuntimeError) as exc:
            note = str(exc).strip().splitlines()
            # A gateway's error says what failed first, its log's tail after; the orchestrator's last line.
            lines = note if router in GATEWAYS else list(reversed(note))
            reason = next((line for line in lines if line.strip()), "did not start")
            print(f"[fleet] {router}: the orchestrator refused it at start-up, skipped ({reason[:200]})",
                  file=sys.stderr, flush=True)
            return {"router": router, "workload": workload.name, "events": events, "skipped": reason[:500]}
        time.sleep(_SETTLE_S)
        busy0 = machine_busy_seconds()
        records, elapsed = asyncio.run(drive(orchestrator.url, workload, work))
        busy_cores = (machine_busy_seconds() - busy0) / max(elapsed, 1e-9)
        time.sleep(_METRICS_SETTLE_S)
        ctx = [worker_counters(url) for url in fleet.ctx]
        gen = [worker_counters(url) for url in fleet.gen]
        ledger = orjson.loads(http_get(fleet.control, "/ledger")[1])
        orch = orchestrator_counters(orchestrator.url) if router not in GATEWAYS else _NO_COUNTERS
    cell = summarize_run(router, workload, records, elapsed, ctx, gen, ledger, orch)
    cell["machine_before"], cell["busy_cores"], cell["events"] = quiet, busy_cores, events
    if setup is not None:
        cell["tokenize"] = setup
    label = router if setup is None else f"{router} [{setup}]"
    label += "" if events else ", no events"
    print(f"[fleet] {workload.name:>9} {label:>15}: {cell['requests']} requests ({cell['errors']} errors) in "
          f"{elapsed:.1f} s, hit {fmt(cell['hit_ratio'], 3)} / oracle {fmt(cell['oracle_hit_ratio'], 3)}, "
          f"TTFT p50 {fmt(cell['ttft_ms']['p50'], 0)} p99 {fmt(cell['ttft_ms']['p99'], 0)} ms, follow-ups "
          f"p50 {fmt(cell['followup_ttft_ms']['p50'], 0)} ms, longest prompt {cell['prompt_tokens_max']:,} tokens",
          file=sys.stderr, flush=True)
    return cell


def _ttft(records: Sequence[Record]) -> dict[str, float]:
    ttft = [r.ttft_s * 1e3 for r in records if r.ok and r.ttft_s is not None]
    return {"p50": percentile(ttft, 50), "p99": percentile(ttft, 99), "n": len(ttft)}


def summarize_run(router: str, workload: Workload, records: list[Record], elapsed: float,
                  ctx: list[dict[str, float]], gen: list[dict[str, float]], ledger: dict[str, int],
                  orch: dict[str, Any]) -> dict[str, Any]:
    ok = [r for r in records if r.ok]
    ttft = [r.ttft_s * 1e3 for r in ok if r.ttft_s is not None]
    queried = sum(w["queried"] for w in ctx + gen)
    hit = sum(w["hit"] for w in ctx + gen)
    errors: dict[str, int] = {}
    for r in records:
        if not r.ok:
            kind = (r.error or "unknown").split(":", 1)[0]
            errors[kind] = errors.get(kind, 0) + 1
    sends = [r.sent_s for r in records]
    span = (max(sends) - min(sends)) if len(sends) > 1 else math.nan

    def spread(key: str) -> dict[str, float]:
        values = [w[key] for w in ctx]
        return {"min": min(values), "max": max(values), "mean": sum(values) / len(values)}

    return {
        "router": router,
        "workload": workload.name,
        "requests": len(records),
        "ok": len(ok),
        "errors": len(records) - len(ok),
        "errors_by_kind": errors,
        "error_samples": [r.error for r in records if not r.ok][:5],
        "elapsed_s": elapsed,
        "requests_per_s": len(records) / span if span and span > 0 else math.nan,
        "queried_tokens": queried,
        "hit_tokens": hit,
        "hit_ratio": hit / queried if queried else math.nan,
        "oracle_hit_ratio": ledger["reachable_tokens"] / ledger["queried_tokens"] if ledger["queried_tokens"]
        else math.nan,
        "ledger": ledger,
        "ttft_ms": {"p50": percentile(ttft, 50), "p90": percentile(ttft, 90), "p99": percentile(ttft, 99),
                    "max": max(ttft) if ttft else math.nan, "n": len(ttft)},
        # Follow-up turns (every turn after a session's first), and those whose prompt is LONG_PROMPT_TOKENS or more
        "followup_ttft_ms": _ttft([r for r in records if r.turn > 0]),
        "followup_long_ttft_ms": _ttft([r for r in records
                                        if r.turn > 0 and (r.prompt_tokens or 0) >= LONG_PROMPT_TOKENS]),
        "prompt_tokens_max": max((r.prompt_tokens or 0 for r in records), default=0),
        "latency_ms_p50": percentile([r.latency_s * 1e3 for r in ok if r.latency_s is not None], 50),
        "ctx_workers": ctx,
        "gen_workers": gen,
        "ctx_prefills": spread("prefills"),
        "ctx_busy_s": spread("busy_s"),
        "gen_prefills": sum(w["prefills"] for w in gen),
        "orchestrator": orch,
    }


def run(settings: Settings = FULL, routers: Sequence[str] = tuple(ROUTERS)) -> dict[str, Any]:
    cells: list[dict[str, Any]] = []
    # Sizes are tokens of the workers' tokenizer, measured once on text of the work's own kind: real text for a real
    # tokenizer (on a few repeated words its word cache would answer nearly every word).
    real_text = settings.engine.tokenizer != "byte"
    sample = ("".join(corpus_text(40_000, seed=s) for s in range(10)) if real_text  # stretches, as the work takes
              else text(random.Random(0), 40_000))
    per_token = chars_per_token(sample, settings.engine.tokenizer)
    for workload in settings.workloads:
        work = sessions(workload, settings.seed, per_token, real_text)
        print(f"[fleet] {workload.name}: {len(work)} sessions, {sum(len(s.turns) for s in work)} requests, "
              f"~{workload.request_rate:.0f} req/s offered", file=sys.stderr, flush=True)
        for events in settings.events:  # a fleet that publishes KV events, and one that does not
            for router in routers:  # every router on the same work, one after another
                if router in GATEWAYS and events:
                    continue  # a gateway reads no events: on that fleet it would measure the same again
                for setup in settings.tokenize_setups or (None,):  # and every tokenization set-up
                    cells.append(run_one(settings, router, workload, work, setup, events))
    return {"settings": _settings_dict(settings, per_token), "routers": list(routers), "cells": cells}


def _settings_dict(settings: Settings, per_token: float = 1.0) -> dict[str, Any]:
    out = asdict(settings)
    out["router_configs"] = ROUTERS | {name: {"gateway": f"{g.gateway.package}=={g.gateway.version}",
                                              "policy": g.policy, "in front of": "the CTX workers, whole requests"}
                                       for name, g in GATEWAYS.items()}
    out["chars_per_token"] = per_token
    out["text"] = "words" if settings.engine.tokenizer == "byte" else "corpus (the Python standard library's source)"
    out["tokenize_setup_flags"] = {name: list(TOKENIZE_SETUPS[name]) for name in settings.tokenize_setups}
    return out


def main(argv: list[str] | None = None) -> int:
    parser = arguments(__doc__)
    parser.add_argument("--quick", action="store_true", help="a quarter of each workload's arrival window")
    parser.add_argument("--routers", nargs="+", choices=(*ROUTERS, *GATEWAYS), default=list(ROUTERS),
                        help="ours (the CTX pool's router) and the Rust gateways (sglang_gateway, vllm_router: on "
                             "the fleet without events); default: ours")
    parser.add_argument("--workloads", nargs="+", choices=tuple(WORKLOADS), default=None,
                        help="default: " + " ".join(w.name for w in FULL.workloads))
    parser.add_argument("--cache-tokens", type=int, default=None,
                        help=f"each worker's prefix cache (default {Engine().cache_tokens:,}; a huge one shows "
                             "what routing alone loses against the oracle)")
    parser.add_argument("--window-scale", type=float, default=1.0,
                        help="scale each workload's arrival window: longer runs make the fleet's warm-up (each "
                             "worker's first prefill of each shared prompt) a smaller share of the requests")
    parser.add_argument("--tokenizer", choices=("byte", "reference"), default="byte",
                        help="the workers' tokenizer: byte (free) or the reference model's real one (default byte)")
    parser.add_argument("--tokenize-compare", action="store_true",
                        help="with the reference tokenizer, run everything twice: a full `tokenizers` encode every "
                             "turn (--tokenize-cache-mb 0 --tokenizer-backend tokenizers), and the defaults")
    parser.add_argument("--events", nargs="+", choices=("on", "off"), default=["on", "off"],
                        help="the fleets: workers that publish KV events (on), workers that publish none (off, "
                             "as vLLM's own servers and trtllm-serve); default both, one after the other")
    parser.add_argument("--anonymous", action="store_true",
                        help="send no x-session-id: conversations as most clients send them, known to routing only "
                             "by their text")
    parser.add_argument("--json", default=None, help="also write the result here")
    add_docs_flag(parser, "fleet")
    args = parser.parse_args(argv)
    settings = QUICK if args.quick else FULL
    if args.cache_tokens is not None:
        settings = replace(settings, engine=replace(settings.engine, cache_tokens=args.cache_tokens))
    if args.workloads:
        scale = 0.25 if args.quick else 1.0  # what QUICK does to its workloads
        settings = replace(settings, workloads=tuple(replace(WORKLOADS[name],
                                                             window_s=WORKLOADS[name].window_s * scale)
                                                     for name in args.workloads))
    if args.tokenizer != "byte" or args.tokenize_compare:
        settings = replace(settings, engine=replace(settings.engine, tokenizer="reference"))
    if args.tokenize_compare:
        settings = replace(settings, tokenize_setups=tuple(TOKENIZE_SETUPS))
    settings = replace(settings, events=tuple(e == "on" for e in dict.fromkeys(args.events)))
    if args.anonymous:
        settings = replace(settings, workloads=tuple(replace(w, sessions_named=False) for w in settings.workloads))
    if args.window_scale != 1.0:
        settings = replace(settings, workloads=tuple(replace(w, window_s=w.window_s * args.window_scale)
                                                     for w in settings.workloads))
    if any(router in GATEWAYS for router in args.routers):
        prepare(gateways=tuple(GATEWAYS[r].gateway for r in args.routers if r in GATEWAYS))  # from PyPI, once
    machine = machine_info()  # the load average before the run
    started = time.perf_counter()
    result = run(settings, args.routers)
    result["mode"] = "quick" if args.quick else "full"
    result["duration_s"] = time.perf_counter() - started
    result["machine"] = machine
    print(targets_table(result) + "\n\n" + tables(result))
    if args.json:
        write_json(Path(args.json), result)
    if args.docs:
        report.publish("fleet", result, generated_block, plot)
    return 0

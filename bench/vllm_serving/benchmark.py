"""Serving on vLLM: vLLM's own server against our aggregated worker, our CTX + GEN pair and our orchestrator in
front of a vLLM P/D pair; GEN's CPU per request on the array path against the list path; the orchestrator's CPU.

``python -m bench.vllm_serving [--quick] [--docs]``, with vLLM installed (``flock /work/vllm.lock`` on a shared
machine). Four phases in turn, at most two vLLM instances alive (``bench.peers.vllm_processes``); the method is in
docs/benchmarks.md, "Serving on vLLM".
"""

from __future__ import annotations

import contextlib
import sys
import tempfile
import time
from collections.abc import Iterator
from dataclasses import asdict, replace
from pathlib import Path
from typing import Any

import orjson

from bench.driver import report
from bench.driver.common import Processes, Server, add_docs_flag, arguments, free_port, wait_healthy
from bench.driver.machine import loadavg, machine_info
from bench.driver.report import write_json
from bench.peers.vllm_processes import example_connector, our_worker, vllm_api_server, vllm_instances
from bench.vllm_serving.measure import (
    AGGREGATED,
    DISAGGREGATED,
    FULL,
    QUICK,
    VLLM,
    Settings,
    gen_bodies,
    gen_prompt_path_in_process,
    gen_worker_cpu,
    latency,
    orchestrator_cpu,
)
from bench.vllm_serving.report import generated_block, plot, tables


# -- the phases ------------------------------------------------------------------------------------------------------
@contextlib.contextmanager
def orchestrator_in_front(processes: Processes, ctx: Server, gen: Server, protocol: str | None) -> Iterator[Server]:
    import yaml

    port = free_port()
    groups: dict[str, Any] = {"context_servers": {"urls": [ctx.url]}, "generation_servers": {"urls": [gen.url]}}
    if protocol is not None:
        for group in groups.values():
            group["protocol"] = protocol
    config = processes.log_dir / f"orchestrator-{port}.yaml"
    config.write_text(yaml.safe_dump({"hostname": "127.0.0.1", "port": port, "request_timeout_s": 600, **groups}))
    orchestrator = processes.disagg_serve(f"orchestrator-{port}", ["orchestrator", "--config", str(config)], port)
    try:
        wait_healthy([orchestrator], 120)
        yield orchestrator
    finally:
        processes.stop([orchestrator])


def run_phase(setup: str, processes: Processes, checkpoint: Path, model: str, settings: Settings,
              kv_root: Path) -> dict[str, Any]:
    ports = {name: free_port() for name in ("one", "p", "d")}
    log_dir = processes.log_dir
    phase: dict[str, Any] = {"setup": setup, "loadavg_before": loadavg()}
    started = time.perf_counter()
    print(f"[vllm_serving] {setup}: starting (load average {phase['loadavg_before']}) ...", file=sys.stderr,
          flush=True)
    if setup in (VLLM, AGGREGATED):
        argv = (vllm_api_server(checkpoint, model, ports["one"], None) if setup == VLLM
                else our_worker("both", ports["one"], None))
        with vllm_instances({"one": argv}, ports, log_dir) as servers:
            phase["startup_s"] = time.perf_counter() - started
            phase["points"] = latency(servers["one"].url, settings)
    else:
        connector = example_connector(Path(tempfile.mkdtemp(prefix="kv-", dir=kv_root)))
        specs = ({"p": our_worker("context", ports["p"], connector), "d": our_worker("generation", ports["d"],
                                                                                    connector)}
                 if setup == DISAGGREGATED else
                 {"p": vllm_api_server(checkpoint, model, ports["p"], connector),
                  "d": vllm_api_server(checkpoint, model, ports["d"], connector)})
        with vllm_instances(specs, ports, log_dir) as servers, \
                orchestrator_in_front(processes, servers["p"], servers["d"],
                                      None if setup == DISAGGREGATED else "vllm") as orchestrator:
            phase["startup_s"] = time.perf_counter() - started
            phase["points"] = latency(orchestrator.url, settings)
            phase["orchestrator_cpu"] = orchestrator_cpu(orchestrator, settings)
            if setup == DISAGGREGATED:
                phase["gen_cpu"] = []
                for size in settings.prompts:
                    bodies = gen_bodies(servers["p"].url, size, model)
                    process = gen_worker_cpu(servers["d"], bodies, settings)
                    tokens = len(orjson.loads(bodies["list"])["prompt_token_ids"])
                    phase["gen_cpu"].append({"prompt_tokens": tokens, "process": process,
                                             "in_process": gen_prompt_path_in_process(bodies, settings)})
                    print(f"[vllm_serving]   GEN CPU at {tokens} tokens: list {process['list']['cpu_ms']:.2f} / "
                          f"array {process['array']['cpu_ms']:.2f} ms/req", file=sys.stderr, flush=True)
    phase["loadavg_after"] = loadavg()
    phase["duration_s"] = time.perf_counter() - started
    return phase


def run(settings: Settings = FULL, partial: Path | None = None) -> dict[str, Any]:
    """Every phase in turn; with ``partial``, the result so far is written there after each phase."""
    from workers.engines.vllm.served_model import resolve_model

    served = resolve_model(None, None)  # the packaged SmolLM2, converted once into a checkpoint folder
    checkpoint, model = served.folder, served.name
    result: dict[str, Any] = {"benchmark": "vllm_serving", "method": asdict(settings), "machine": machine_info(),
                              "phases": {}}
    started = time.perf_counter()
    with Processes() as processes, tempfile.TemporaryDirectory(prefix="vllm-bench-kv-") as kv_root:
        for setup in settings.setups:
            result["phases"][setup] = run_phase(setup, processes, checkpoint, model, settings, Path(kv_root))
            if partial is not None:
                write_json(partial, result)
    result["duration_s"] = time.perf_counter() - started
    result["loadavg_at_end"] = loadavg()
    return result


def main(argv: list[str] | None = None) -> int:
    parser = arguments(__doc__)
    parser.add_argument("--quick", action="store_true", help="511 tokens only, one run each (a check, ~6 min)")
    add_docs_flag(parser, "vllm_serving")
    parser.add_argument("--runs", type=int, default=None, help="requests per set-up and size (default 3)")
    parser.add_argument("--json", type=Path, default=None, help="also write the result here (and after each phase)")
    parser.add_argument("--from-json", type=Path, default=None,
                        help="run nothing: print (and with --docs, write) the tables and plot of an earlier result")
    args = parser.parse_args(argv)
    if args.from_json is not None:
        result = orjson.loads(args.from_json.read_bytes())
    else:
        from bench.peers.vllm_processes import vllm_missing_reason

        missing = vllm_missing_reason()
        if missing:
            print(f"[vllm_serving] {missing}", file=sys.stderr)
            return 2
        settings = QUICK if args.quick else FULL
        if args.runs is not None:
            settings = replace(settings, runs=args.runs)
        result = run(settings, args.json)
        result["mode"] = "quick" if args.quick else "full"
    print(tables(result))
    if args.json:
        write_json(args.json, result)
    if args.docs:
        report.publish("vllm_serving", result, generated_block, plot)
    return 0

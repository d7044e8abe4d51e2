"""Every benchmark, one command: ``.venv/bin/python -m bench.run_all [--quick] [--all] [--only NAME ...]``.

Full mode (8-15 minutes on 2 cores) runs the page's benchmarks (prompt_path, gen_http, system_load, reference,
generation_first), writes JSON and PNG plots to docs/benchmarks/ and replaces the generated block of
docs/benchmarks.md; ``--quick`` (< 2 minutes) runs smaller matrices and writes to a temporary folder unless
``--out`` says otherwise. Every table is also printed. ``--only NAME ...`` runs some benchmarks, any of those
``--list`` names, and keeps the page's others' results from the JSON already in the output folder; ``--all`` runs
every one in turn (about an hour on 2 cores, 15-30 minutes with ``--quick``; vllm_serving another ~16, ~6 with
``--quick``). A benchmark that cannot run here (vllm_serving without vLLM) is skipped with the reason printed.
One with a block of its own on the page (orchestrator_cost, fleet, vllm_serving) publishes it as its own
``--docs`` does when this run writes the page; the others' JSON goes to the output folder.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from bench import (
    cancel_storm,
    client_body_parse,
    ctx_prompt_path,
    dashboard_image,
    gen_http,
    generation_first,
    loopback_floor,
    overload,
    reference,
    response_store,
    tracing_overhead,
)
from bench.driver import plots, report
from bench.driver.common import REPO_ROOT, arguments
from bench.driver.machine import loadavg, machine_info, wait_for_quiet
from bench.driver.report import markdown_table, verdict, write_json
from bench.fleet import benchmark as fleet
from bench.fleet import report as fleet_report
from bench.orchestrator_cost import benchmark as orchestrator_cost
from bench.orchestrator_cost import report as orchestrator_cost_report
from bench.prompt_path import benchmark as prompt_path
from bench.prompt_path import report as prompt_path_report
from bench.soak import benchmark as soak
from bench.soak import report as soak_report
from bench.system_load import benchmark as system_load
from bench.system_load import report as system_load_report
from bench.vllm_serving import benchmark as vllm_serving
from bench.vllm_serving import measure as vllm_serving_measure
from bench.vllm_serving import report as vllm_serving_report

Result = dict[str, Any]


@dataclass(frozen=True)
class Mode:
    """What a benchmark is run with: its quick or its full settings, and where what it writes goes."""

    quick: bool
    out: Path
    docs: bool


@dataclass(frozen=True)
class Benchmark:
    """One benchmark as run_all runs it: ``run`` calls the module's own functions with its quick or full settings;
    ``tables`` reads the result back; ``publish`` is the block and plot its own ``--docs`` writes (None: its JSON
    goes to run_all's output folder); ``missing`` says why it cannot run here (None: it can)."""

    summary: str
    run: Callable[[Mode], Result]
    tables: Callable[[Result], str]
    publish: tuple[Callable[[Result, str], str], Callable[[Result, Path], Path]] | None = None
    missing: Callable[[], str | None] = lambda: None


def _dashboard(mode: Mode) -> Result:
    scrapes = dashboard_image.run(5.0 if mode.quick else 30.0, Path(tempfile.mkdtemp(prefix="disagg-dashboard-")))
    image = dashboard_image.draw(scrapes, (REPO_ROOT / "docs" / "images" if mode.docs else mode.out) / "dashboard.png")
    return {"benchmark": "dashboard_image", "scrapes": len(scrapes), "image": str(image)}


def _vllm_missing() -> str | None:
    from bench.peers.vllm_processes import vllm_missing_reason

    return vllm_missing_reason()


_SYSTEM_LOAD_QUICK = ((1_024, 131_072), (1, 16), system_load.QUICK)
_SYSTEM_LOAD_FULL = (system_load.PROMPTS, system_load.CONCURRENCY, system_load.FULL)

# Every benchmark with a command, in the order --all runs them: the page's first, tracing_overhead last (it leaves
# tracing configured in this process).
BENCHMARKS: dict[str, Benchmark] = {
    "prompt_path": Benchmark(
        "GEN's prompt path in-process: list vs array vs floor",
        lambda m: prompt_path.run(prompt_path.SIZES, warmups=2 if m.quick else 5, runs=3 if m.quick else 9,
                                  ops=5 if m.quick else 10),
        prompt_path_report.tables),
    "ctx_prompt_path": Benchmark(
        "CTX's prompt path in-process: a new and a follow-up turn, against one tokenizers encode every turn",
        lambda m: ctx_prompt_path.run((1_000, 40_000) if m.quick else ctx_prompt_path.SIZES,
                                      runs=2 if m.quick else 5),
        ctx_prompt_path.tables),
    "gen_http": Benchmark(
        "a GEN worker over HTTP: whole-process CPU per request",
        lambda m: gen_http.run(gen_http.SIZES, batches=2 if m.quick else 5, min_batch_s=0.2 if m.quick else 0.5,
                               warmups=2 if m.quick else 5),
        gen_http.tables),
    "system_load": Benchmark(
        "the whole system under load (synthetic engine, streaming)",
        lambda m: (system_load.run(*_SYSTEM_LOAD_QUICK, idle_s=1.0) if m.quick else
                   system_load.run(*_SYSTEM_LOAD_FULL)),
        system_load_report.tables),
    "reference": Benchmark(
        "the reference engine: disaggregated vs aggregated",
        lambda m: (reference.run((128,), runs=1, max_tokens=8) if m.quick else
                   reference.run(reference.PROMPT_TOKENS, runs=3, max_tokens=reference.MAX_TOKENS)),
        reference.tables),
    "generation_first": Benchmark(
        "generation first against context first (its page: docs/interop.md)",
        lambda m: (generation_first.run((64,), concurrency=(1,), rounds=2, lifecycles=("v0",)) if m.quick else
                   generation_first.run()),
        generation_first.tables),
    "orchestrator_cost": Benchmark(
        "the orchestrator against a pass-through proxy and the Rust gateways (those in the side venv)",
        lambda m: orchestrator_cost.run(phases=orchestrator_cost.QUICK if m.quick else orchestrator_cost.FULL,
                                        install=False),
        lambda r: "\n\n".join((orchestrator_cost_report.method_note(r), orchestrator_cost_report.targets_table(r),
                                orchestrator_cost_report.tables(r))),
        (orchestrator_cost_report.generated_block, orchestrator_cost_report.plot)),
    "fleet": Benchmark(
        "routers on a simulated fleet of 8 CTX and 4 GEN workers",
        lambda m: fleet.run(fleet.QUICK if m.quick else fleet.FULL),
        lambda r: fleet_report.targets_table(r) + "\n\n" + fleet_report.tables(r),
        (fleet_report.generated_block, fleet_report.plot)),
    "vllm_serving": Benchmark(
        "serving on vLLM: vLLM's server, our workers, our orchestrator in front of vLLM P/D",
        lambda m: vllm_serving.run(vllm_serving_measure.QUICK if m.quick else vllm_serving_measure.FULL),
        vllm_serving_report.tables,
        (vllm_serving_report.generated_block, vllm_serving_report.plot), _vllm_missing),
    "soak": Benchmark(
        "soak: a mixed load for minutes, GEN restarted midway",
        lambda m: soak.run(soak.settings(20.0, concurrency=16) if m.quick else soak.settings(180.0)),
        soak_report.table),
    "cancel_storm": Benchmark(
        "a cancel storm on the reference engine, then one short request's TTFT",
        lambda m: cancel_storm.run(rounds=2 if m.quick else cancel_storm.ROUNDS),
        cancel_storm.tables),
    "overload": Benchmark(
        "admission under a 5x burst of two tenants",
        lambda m: overload.run(overload.Settings(burst_s=5.0) if m.quick else overload.Settings()),
        overload.tables),
    "loopback_floor": Benchmark(
        "the floor: moving a request's bytes through loopback TCP",
        lambda m: loopback_floor.run(30 if m.quick else loopback_floor.ROUNDS),
        loopback_floor.tables),
    "client_body_parse": Benchmark(
        "reading a client's body: parsed whole against kept as bytes",
        lambda m: client_body_parse.run(rounds=20 if m.quick else client_body_parse.ROUNDS),
        client_body_parse.tables),
    "response_store": Benchmark(
        "the Responses store: put and get in memory and on Redis",
        lambda m: response_store.run(calls=50 if m.quick else 300),
        response_store.table),
    "dashboard_image": Benchmark(
        "the dashboard picture from a real run (docs/images/dashboard.png when this run writes the page)",
        _dashboard,
        lambda r: f"{r['scrapes']} scrapes; wrote {r['image']}"),
    "tracing_overhead": Benchmark(
        "tracing's cost per request: hooks off, no hooks, on",
        lambda m: tracing_overhead.run(20_000 if m.quick else tracing_overhead.REQUESTS),
        tracing_overhead.tables),
}
# Commands in bench/ that are not benchmarks (``python -m bench.<name>``): the pieces benchmarks start, and this
# command.
HELPERS = ("driver.loadgen", "driver.prober", "fleet.host", "peers.mock_workers", "peers.passthrough_proxy",
           "peers.rust_gateways", "run_all")
# The page's benchmarks: the default run, and the generated block of docs/benchmarks.md.
NAMES = ("prompt_path", "gen_http", "system_load", "reference", "generation_first")
DOCS_DIR = report.DOCS_DIR
DOC_PAGE = report.DOC_PAGE


def listing() -> str:
    """--list: every benchmark, one line each."""
    width = max(map(len, BENCHMARKS))
    return "\n".join(f"{name:<{width}}  {b.summary}" + ("  [default]" if name in NAMES else "")
                     for name, b in BENCHMARKS.items())


def make_plots(results: dict[str, dict[str, Any]], out: Path, note: str) -> list[Path]:
    written = []
    if "prompt_path" in results:
        written.append(plots.prompt_path_plot(results["prompt_path"], out / "prompt_path.png", note))
    if "gen_http" in results or "prompt_path" in results:
        written.append(plots.cpu_per_request_plot(results.get("gen_http"), results.get("prompt_path"),
                                                  out / "cpu_per_request.png", note))
    if "system_load" in results:
        written.append(plots.load_plot(results["system_load"], out / "load_latency.png", note))
    if "reference" in results:
        written.append(plots.reference_plot(results["reference"], out / "reference.png", note))
    return written


# -- the page's generated block ---------------------------------------------------------------------------------
def machine_section(machine: dict[str, Any], mode: str, elapsed_s: float | None) -> str:
    versions = ", ".join(f"{k} {v}" for k, v in machine.get("versions", {}).items())
    rows: list[list[Any]] = [
        ["CPU", machine.get("cpu_model")],
        ["cores (nproc)", machine.get("nproc")],
        ["memory", f"{machine.get('mem_gib')} GiB"],
        ["kernel", machine.get("kernel")],
        ["Python", f"{machine.get('python')} ({machine.get('python_impl')})"],
        ["libraries", versions],
        ["load average at start", machine.get("loadavg_at_start")],
        ["mode", mode + (f", {elapsed_s / 60:.1f} min in all" if elapsed_s else "")],
    ]
    return markdown_table(["", "this run"], rows)


def targets_section(results: dict[str, dict[str, Any]]) -> tuple[str, list[dict[str, Any]]]:
    collected: list[dict[str, Any]] = []
    modules = {"prompt_path": prompt_path_report, "gen_http": gen_http, "system_load": system_load_report}
    for name, module in modules.items():
        if name in results:
            collected += module.targets(results[name])

    rows = [[t["target"], t["measured"], verdict(t["met"]), verdict(t.get("aim_met"))] for t in collected]
    return markdown_table(["target", "measured", "verdict", "DESIGN aim"], rows), collected


# The page's sections, in order: benchmark, heading, its tables, the plot's alt text and file.
PAGE_SECTIONS: tuple[tuple[str, str, Callable[[dict[str, Any]], str], str, str], ...] = (
    ("prompt_path", "### The prompt path: list vs array vs floor (in-process)", prompt_path_report.tables,
     "list vs array vs floor", "prompt_path.png"),
    ("gen_http", "### A GEN worker over HTTP: whole-process CPU per request", gen_http.tables,
     "CPU per request vs prompt length", "cpu_per_request.png"),
    ("system_load", "### The whole system under load (synthetic engine, streaming)", system_load_report.tables,
     "latency vs concurrency", "load_latency.png"),
    ("reference", "### The reference engine: disaggregated vs aggregated (BLAS 1 thread)", reference.tables,
     "reference engine", "reference.png"),
)
# Benchmarks the generated block of docs/benchmarks.md leaves out: their tables are printed here (their page is
# their own: generation_first's is docs/interop.md; orchestrator_cost's, fleet's and vllm_serving's their own block).
OWN_PAGE_TABLES = {name: b.tables for name, b in BENCHMARKS.items() if name not in {s[0] for s in PAGE_SECTIONS}}


def generated_block(results: dict[str, dict[str, Any]], machine: dict[str, Any], mode: str,
                    elapsed_s: float | None, plot_dir: str) -> str:
    parts = [report.BEGIN, "", "### The machine", "", machine_section(machine, mode, elapsed_s), ""]
    targets_table, _ = targets_section(results)
    parts += ["### Targets", "", targets_table, ""]
    for name, heading, tables, alt, png in PAGE_SECTIONS:
        if name in results:
            parts += [heading, "", tables(results[name]), "", f"![{alt}]({plot_dir}/{png})", ""]
    parts.append(report.END)
    return "\n".join(parts)



def main(argv: list[str] | None = None) -> int:
    parser = arguments(__doc__)
    parser.add_argument("--quick", action="store_true", help="small matrices, under ~2 minutes")
    parser.add_argument("--out", type=Path, default=None,
                        help="folder for JSON and PNG (default: docs/benchmarks, or a temp folder with --quick)")
    parser.add_argument("--only", nargs="*", choices=tuple(BENCHMARKS), default=list(NAMES),
                        help="run only these (none: just redraw the plots and the page from the JSON)")
    parser.add_argument("--all", action="store_true",
                        help="run every benchmark --list names, in turn (about an hour; 15-30 min with --quick)")
    parser.add_argument("--list", action="store_true", help="name every benchmark, one line each, and run nothing")
    parser.add_argument("--docs", action=argparse.BooleanOptionalAction, default=None,
                        help="rewrite the generated block of docs/benchmarks.md, and the blocks of the benchmarks "
                             "run that have their own (default: on unless --quick)")
    args = parser.parse_args(argv)
    if args.list:
        print(listing())
        return 0
    only: list[str] = list(BENCHMARKS) if args.all else args.only
    out: Path = args.out or (Path(tempfile.mkdtemp(prefix="disagg-bench-quick-")) if args.quick else DOCS_DIR)
    update_docs = (not args.quick) if args.docs is None else args.docs
    mode = "quick" if args.quick else "full"
    machine = machine_info()
    cores = machine.get("nproc")
    note = f"\n({machine.get('cpu_model')}, {cores} cores, Python {machine.get('python')}, {mode} run)"

    results: dict[str, dict[str, Any]] = {}
    for name in NAMES:  # keep earlier results for the benchmarks not rerun now
        previous = out / f"{name}.json"
        if name not in only and previous.exists():
            results[name] = json.loads(previous.read_text())
    started = time.perf_counter()
    durations: dict[str, float] = {}
    skipped: dict[str, str] = {}
    settings = Mode(quick=args.quick, out=out, docs=update_docs)
    for name in only:
        benchmark = BENCHMARKS[name]
        missing = benchmark.missing()
        if missing:
            skipped[name] = missing
            print(f"[bench] skipping {name}: {missing}", file=sys.stderr, flush=True)
            continue
        quiet = wait_for_quiet(0.0 if args.quick else 60.0)
        waited = "" if args.quick else (f"; {quiet['busy_cores']:.2f} cores busy before it (waited "
                                        f"{quiet['waited_s']:.0f} s for a quiet machine)")
        print(f"[bench] running {name} ({mode}){waited} ...", file=sys.stderr, flush=True)
        t0 = time.perf_counter()
        result = benchmark.run(settings)
        durations[name] = time.perf_counter() - t0
        result["machine"] = machine
        result["mode"] = mode
        result["duration_s"] = durations[name]
        result["machine_before"] = quiet
        results[name] = result
        if benchmark.publish and update_docs:
            report.publish(name, result, *benchmark.publish)  # as its own --docs: docs/benchmarks/<name>.json
        else:
            write_json(out / f"{name}.json", result)
        print(f"[bench] {name}: {durations[name]:.1f} s", file=sys.stderr, flush=True)
    elapsed = time.perf_counter() - started

    written = make_plots(results, out, note)
    _targets_table, targets = targets_section(results)
    write_json(out / "summary.json", {"machine": machine, "mode": mode, "durations_s": durations,
                                      "elapsed_s": elapsed, "loadavg_at_end": loadavg(), "targets": targets,
                                      **({"skipped": skipped} if skipped else {})})
    block = generated_block(results, machine, mode, elapsed if set(only) == set(NAMES) else None,
                                   _relative(out, DOC_PAGE.parent))
    print(block.replace(report.BEGIN, "").replace(report.END, ""))
    for name, tables in OWN_PAGE_TABLES.items():
        if name in results:
            print(f"### {name}\n\n{tables(results[name])}\n")
    for name, why in skipped.items():
        print(f"### {name}\n\nskipped: {why}\n")
    if update_docs:
        report.update_docs(DOC_PAGE, block)
        print(f"[bench] updated {DOC_PAGE}", file=sys.stderr)
    print(f"[bench] wrote {len(written)} plots and the JSON to {out}; {elapsed:.1f} s in all", file=sys.stderr)
    return 0


def _relative(path: Path, base: Path) -> str:
    try:
        return str(path.resolve().relative_to(base.resolve()))
    except ValueError:
        return str(path.resolve())


if __name__ == "__main__":
    sys.exit(main())

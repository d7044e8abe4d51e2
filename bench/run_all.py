"""Every benchmark, one command: ``.venv/bin/python -m bench.run_all [--quick]``.

Full mode (8-15 minutes on 2 cores) writes JSON and PNG plots to docs/benchmarks/ and replaces the generated block
of docs/benchmarks.md; ``--quick`` (< 2 minutes) runs smaller matrices and writes to a temporary folder unless
``--out`` says otherwise. Every table is also printed. ``--only NAME ...`` reruns some benchmarks and keeps the
others' results from the JSON already in the output folder.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from bench import (
    gen_http,
    generation_first,
    plots,
    prompt_path,
    prompt_path_report,
    reference,
    report,
    system_load,
    system_load_report,
)
from bench.common import arguments
from bench.machine import loadavg, machine_info, wait_for_quiet
from bench.report import markdown_table, verdict, write_json

NAMES = ("prompt_path", "gen_http", "system_load", "reference", "generation_first")
# Benchmarks the generated block of docs/benchmarks.md leaves out: their tables are printed here (their page is
# their own: generation_first's is docs/interop.md).
OWN_PAGE_TABLES = {"generation_first": generation_first.tables}
DOCS_DIR = report.DOCS_DIR
DOC_PAGE = report.DOC_PAGE


def runners(quick: bool) -> dict[str, Callable[[], dict[str, Any]]]:
    if quick:
        return {
            "prompt_path": lambda: prompt_path.run(prompt_path.SIZES, warmups=2, runs=3, ops=5),
            "gen_http": lambda: gen_http.run(gen_http.SIZES, batches=2, min_batch_s=0.2, warmups=2),
            "system_load": lambda: system_load.run((1_024, 131_072), (1, 16), system_load.QUICK, idle_s=1.0),
            "reference": lambda: reference.run((128,), runs=1, max_tokens=8),
            "generation_first": lambda: generation_first.run((64,), concurrency=(1,), rounds=2, lifecycles=("v0",)),
        }
    return {
        "prompt_path": lambda: prompt_path.run(prompt_path.SIZES, warmups=5, runs=9, ops=10),
        "gen_http": lambda: gen_http.run(gen_http.SIZES, batches=5, min_batch_s=0.5, warmups=5),
        "system_load": lambda: system_load.run(system_load.PROMPTS, system_load.CONCURRENCY, system_load.FULL),
        "reference": lambda: reference.run(reference.PROMPT_TOKENS, runs=3, max_tokens=reference.MAX_TOKENS),
        "generation_first": generation_first.run,
    }


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
    return markdown_table(["target", "measured", "issue figure", "DESIGN aim"], rows), collected


# The page's sections, in order: benchmark, heading, its tables, the plot's alt text and file.
PAGE_SECTIONS: tuple[tuple[str, str, Callable[[dict[str, Any]], str], str, str], ...] = (
    ("prompt_path", "### 1. The prompt path: list vs array vs floor (in-process)", prompt_path_report.tables,
     "list vs array vs floor", "prompt_path.png"),
    ("gen_http", "### 2. A GEN worker over HTTP: whole-process CPU per request", gen_http.tables,
     "CPU per request vs prompt length", "cpu_per_request.png"),
    ("system_load", "### 3. The whole system under load (synthetic engine, streaming)", system_load_report.tables,
     "latency vs concurrency", "load_latency.png"),
    ("reference", "### 4. The reference engine: disaggregated vs aggregated (BLAS 1 thread)", reference.tables,
     "reference engine", "reference.png"),
)


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
    parser.add_argument("--only", nargs="*", choices=NAMES, default=list(NAMES),
                        help="run only these (none: just redraw the plots and the page from the JSON)")
    parser.add_argument("--docs", action=argparse.BooleanOptionalAction, default=None,
                        help="rewrite the generated block of docs/benchmarks.md (default: on unless --quick)")
    args = parser.parse_args(argv)
    out: Path = args.out or (Path(tempfile.mkdtemp(prefix="disagg-bench-quick-")) if args.quick else DOCS_DIR)
    update_docs = (not args.quick) if args.docs is None else args.docs
    mode = "quick" if args.quick else "full"
    machine = machine_info()
    cores = machine.get("nproc")
    note = f"\n({machine.get('cpu_model')}, {cores} cores, Python {machine.get('python')}, {mode} run)"

    results: dict[str, dict[str, Any]] = {}
    for name in NAMES:  # keep earlier results for the benchmarks not rerun now
        previous = out / f"{name}.json"
        if name not in args.only and previous.exists():
            results[name] = json.loads(previous.read_text())
    started = time.perf_counter()
    durations: dict[str, float] = {}
    selected = runners(args.quick)
    for name in args.only:
        quiet = wait_for_quiet(0.0 if args.quick else 60.0)
        waited = "" if args.quick else (f"; {quiet['busy_cores']:.2f} cores busy before it (waited "
                                        f"{quiet['waited_s']:.0f} s for a quiet machine)")
        print(f"[bench] running {name} ({mode}){waited} ...", file=sys.stderr, flush=True)
        t0 = time.perf_counter()
        result = selected[name]()
        durations[name] = time.perf_counter() - t0
        result["machine"] = machine
        result["mode"] = mode
        result["duration_s"] = durations[name]
        result["machine_before"] = quiet
        results[name] = result
        write_json(out / f"{name}.json", result)
        print(f"[bench] {name}: {durations[name]:.1f} s", file=sys.stderr, flush=True)
    elapsed = time.perf_counter() - started

    written = make_plots(results, out, note)
    _targets_table, targets = targets_section(results)
    write_json(out / "summary.json", {"machine": machine, "mode": mode, "durations_s": durations,
                                      "elapsed_s": elapsed, "loadavg_at_end": loadavg(), "targets": targets})
    block = generated_block(results, machine, mode, elapsed if set(args.only) == set(NAMES) else None,
                                   _relative(out, DOC_PAGE.parent))
    print(block.replace(report.BEGIN, "").replace(report.END, ""))
    for name, tables in OWN_PAGE_TABLES.items():
        if name in results:
            print(f"### {name}\n\n{tables(results[name])}\n")
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

"""Benchmark 3: the whole system under load on the synthetic engine.

Orchestrator + CTX + GEN run as ``disagg-serve`` subprocesses on loopback; the load generator (bench.loadgen) and
the event-loop prober (bench.prober) are processes of their own. For each prompt size and concurrency, the same
closed-loop streaming load runs twice: through the orchestrator, and with the client calling CTX then GEN itself
with the bodies the orchestrator would send. The difference is the orchestrator's added latency. The worst point
is then run once more under py-spy (sampling the orchestrator) to say where its time goes.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import shutil
import subprocess
import sys
import time
from collections import Counter
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from bench.common import (
    PYTHON,
    Processes,
    Server,
    child_env,
    free_port,
    orchestrator_config,
    orchestrator_help,
    wait_healthy,
    worker_args,
)
from bench.figures import summarize
from bench.machine import wait_for_quiet
from bench.report import fmt, markdown_table, print_and_save

PROMPTS = (1_024, 40_000, 131_072)
CONCURRENCY = (1, 16, 64, 256)
MAX_TOKENS = 8
TARGET_PROMPT = 131_072
_PROBER_START_S = 120.0  # a bound on a start-up that takes 0.2 s alone and seconds on a busy machine


@dataclass(frozen=True)
class Phases:
    warmup_s: float = 1.5
    max_warmup_s: float = 30.0
    measure_s: float = 6.0
    max_measure_s: float = 25.0
    tail_s: float = 60.0
    max_total_s: float = 110.0
    quiet_wait_s: float = 10.0  # before each point, wait this long at most for other users' load to go away

    def loadgen(self, concurrency: int) -> dict[str, Any]:
        return {"warmup_s": self.warmup_s, "max_warmup_s": self.max_warmup_s, "measure_s": self.measure_s,
                "min_requests": max(20, concurrency), "max_measure_s": self.max_measure_s,
                "tail_s": self.tail_s, "max_total_s": self.max_total_s}


FULL = Phases()
QUICK = Phases(warmup_s=0.5, max_warmup_s=8.0, measure_s=2.0, max_measure_s=6.0, tail_s=15.0, max_total_s=35.0,
               quiet_wait_s=0.0)


@dataclass
class Cluster:
    ctx: Server
    gen: Server
    orchestrator: Server

    @property
    def pids(self) -> dict[str, int]:
        return {"orchestrator": self.orchestrator.pid, "ctx": self.ctx.pid, "gen": self.gen.pid}

    @property
    def urls(self) -> dict[str, str]:
        return {"orchestrator": self.orchestrator.url, "ctx": self.ctx.url, "gen": self.gen.url}


def start_cluster(processes: Processes, orchestrator_args: list[str] | None = None,
                  startup_timeout_s: float = 60.0) -> Cluster:
    ctx_port, gen_port = free_port(), free_port()
    ctx = processes.disagg_serve("ctx", worker_args("context", "synthetic", ctx_port), ctx_port)
    gen = processes.disagg_serve("gen", worker_args("generation", "synthetic", gen_port), gen_port)
    wait_healthy([ctx, gen], startup_timeout_s)
    orchestrator = start_orchestrator(processes, ctx, gen, "orchestrator", orchestrator_args or [],
                                      startup_timeout_s)
    return Cluster(ctx, gen, orchestrator)


def start_orchestrator(processes: Processes, ctx: Server, gen: Server, name: str, args: list[str],
                       startup_timeout_s: float = 60.0, **options: Any) -> Server:
    port = free_port()
    config = orchestrator_config(processes.log_dir / f"{name}-{port}.yaml", port, [ctx.url], [gen.url], **options)
    orchestrator = processes.disagg_serve(name, ["orchestrator", "--config", str(config), *args], port)
    wait_healthy([orchestrator], startup_timeout_s)
    return orchestrator


def run_loadgen(processes: Processes, config: dict[str, Any]) -> dict[str, Any]:
    workdir = processes.log_dir
    stamp = f"{config['mode']}-{config['prompt_chars']}-{config['concurrency']}-{time.monotonic_ns()}"
    config_path, out_path = workdir / f"loadgen-{stamp}.json", workdir / f"loadgen-{stamp}.out.json"
    config_path.write_text(json.dumps(config))
    log_path = workdir / f"loadgen-{stamp}.log"
    with open(log_path, "wb") as log:
        try:
            subprocess.run([PYTHON, "-m", "bench.loadgen", "--config", str(config_path), "--out", str(out_path)],
                           stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, env=child_env(),
                           cwd=Path(__file__).resolve().parent.parent, timeout=config["max_total_s"] + 60,
                           check=True)
        except (subprocess.TimeoutExpired, subprocess.CalledProcessError) as exc:
            raise RuntimeError(f"the load generator failed ({exc}):\n{log_path.read_text()[-3000:]}") from exc
    result: dict[str, Any] = json.loads(out_path.read_text())
    return result


def start_prober(processes: Processes, targets: dict[str, str], out: Path, max_s: float,
                 samples: int | None = None) -> Server:
    """Start the prober and return once it is probing (it says so with a file), however slow its start-up."""
    ready = out.with_suffix(".ready")
    argv = [PYTHON, "-m", "bench.prober", "--out", str(out), "--interval-ms", "20", "--max-s", str(max_s),
            "--ready-file", str(ready)]
    if samples is not None:
        argv += ["--samples", str(samples)]
    for name, url in targets.items():
        argv += ["--target", f"{name}={url}"]
    prober = processes.spawn(f"prober-{out.stem}", argv)
    deadline = time.monotonic() + _PROBER_START_S
    while not ready.exists():
        if prober.process.poll() is not None or time.monotonic() > deadline:
            raise RuntimeError(f"the prober did not start:\n{prober.log_tail()}")
        time.sleep(0.01)
    return prober


def stop_prober(processes: Processes, prober: Server, out: Path) -> dict[str, list[list[float | None]]]:
    processes.stop([prober])
    samples: dict[str, list[list[float | None]]] = json.loads(out.read_text()) if out.exists() else {}
    return samples


def lag_in_window(samples: dict[str, list[list[float | None]]], window: tuple[float, float]) -> dict[str, Any]:
    stats: dict[str, Any] = {}
    for name, series in samples.items():
        inside = [s for s in series if window[0] <= (s[0] or 0) <= window[1]]
        values = [float(s[1]) for s in inside if s[1] is not None]
        stats[name] = {**summarize(values), "failed": sum(1 for s in inside if s[1] is None)}
    return stats


def run_cell(processes: Processes, cluster: Cluster, mode: str, prompt: int, concurrency: int,
             phases: Phases) -> dict[str, Any]:
    config = {"mode": mode, "url": cluster.orchestrator.url, "ctx_url": cluster.ctx.url, "gen_url": cluster.gen.url,
              "prompt_chars": prompt, "max_tokens": MAX_TOKENS, "concurrency": concurrency, "pids": cluster.pids,
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


# -- the profile -----------------------------------------------------------------------------------------------
def py_spy_path() -> str | None:
    beside = Path(PYTHON).parent / "py-spy"
    if beside.exists():
        return str(beside)
    return shutil.which("py-spy")


def profile_cell(processes: Processes, cluster: Cluster, prompt: int, concurrency: int,
                 phases: Phases) -> dict[str, Any]:
    tool = py_spy_path()
    if tool is None:
        return {"available": False, "note": "py-spy is not installed (pip install '.[bench]')"}
    raw = processes.log_dir / f"py-spy-{prompt}-{concurrency}.txt"
    with py_spy_recording(processes, tool, cluster.orchestrator.pid, raw, int(phases.max_total_s)) as spy:
        result = run_cell(processes, cluster, "orchestrator", prompt, concurrency, phases)
    if not raw.exists():
        return {"available": False, "note": f"py-spy wrote nothing: {spy.log_tail()}"}
    summary = summarize_profile(raw.read_text())
    summary.update({"available": True, "prompt_tokens": prompt, "concurrency": concurrency,
                    "requests_per_s": result["requests_per_s"], "ttft_ms": result["ttft_ms"],
                    "cpu_ms_per_request": result["cpu_ms_per_request"]})
    return summary


@contextlib.contextmanager
def py_spy_recording(processes: Processes, tool: str, pid: int, raw: Path, duration_s: int) -> Iterator[Server]:
    """py-spy samples ``pid`` at 250 Hz into ``raw`` (collapsed stacks) while the block runs."""
    spy = processes.spawn("py-spy", [tool, "record", "--pid", str(pid), "--rate", "250", "--nonblocking",
                                     "--format", "raw", "--output", str(raw), "--duration", str(duration_s)])
    time.sleep(1.0)  # let py-spy attach before the load starts
    try:
        yield spy
    finally:
        if spy.process.poll() is None:
            spy.process.send_signal(2)  # SIGINT: py-spy writes what it has and exits
            try:
                spy.process.wait(timeout=30)
            except subprocess.TimeoutExpired:
                processes.stop([spy])


_CATEGORIES = (
    ("orjson / json", ("orjson", "json/")),
    ("project: orchestrator/", ("orchestrator/",)),
    ("project: frontend/", ("frontend/",)),
    ("httpx / httpcore / h11 (client side)", ("httpx/", "httpcore/", "h11/")),
    ("uvicorn / httptools (server side)", ("uvicorn/", "httptools")),
    ("starlette / fastapi", ("starlette/", "fastapi/")),
    ("anyio", ("anyio/",)),
    ("asyncio / uvloop", ("asyncio/", "uvloop")),
    ("prometheus_client", ("prometheus_client/",)),
    ("pydantic", ("pydantic",)),
)


def _category(frame: str) -> str:
    for name, needles in _CATEGORIES:
        if any(needle in frame for needle in needles):
            return name
    return "other"


def summarize_profile(text: str, top: int = 15) -> dict[str, Any]:
    """py-spy's raw (collapsed) stacks -> shares of samples by leaf frame, by library, and inclusive."""
    leaf: Counter[str] = Counter()
    category: Counter[str] = Counter()
    inclusive: Counter[str] = Counter()
    total = 0
    for line in text.splitlines():
        stack, _, count_text = line.rstrip().rpartition(" ")
        if not stack or not count_text.isdigit():
            continue
        count = int(count_text)
        frames = [f for f in stack.split(";") if f and not f.startswith(("process ", "thread "))]
        if not frames:
            continue
        total += count
        leaf[frames[-1]] += count
        category[_category(frames[-1])] += count
        for frame in set(frames):
            inclusive[frame] += count
    share = (lambda n: 100.0 * n / total) if total else (lambda n: 0.0)
    project = [(f, n) for f, n in inclusive.most_common()
               if ("orchestrator/" in f or "frontend/" in f) and "entrypoints/cli.py" not in f]
    return {
        "samples": total,
        "by_library_pct": {name: share(n) for name, n in category.most_common()},
        "top_self_pct": [[frame, share(n)] for frame, n in leaf.most_common(top)],
        "top_project_inclusive_pct": [[frame, share(n)] for frame, n in project[:top]],
    }


# -- the whole benchmark -----------------------------------------------------------------------------------------
def run(prompts: tuple[int, ...] = PROMPTS, concurrency: tuple[int, ...] = CONCURRENCY, phases: Phases = FULL,
        profile: bool = True, api_workers: bool = True, idle_s: float = 2.0) -> dict[str, Any]:
    result: dict[str, Any] = {
        "benchmark": "system_load",
        "method": {"max_tokens": MAX_TOKENS, "endpoint": "/v1/completions", "stream": True,
                   "phases": phases.__dict__, "prober_interval_ms": 20, "engine": "synthetic (TTFT 0, ITL 0)"},
        "cells": [],
    }
    with Processes() as processes:
        cluster = start_cluster(processes)
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
            result["api_workers"] = api_workers_scenario(prompts, concurrency, phases)
    return result


def worst_cell(cells: list[dict[str, Any]]) -> dict[str, Any] | None:
    """The orchestrator-mode point with the worst time to first token (p99) as clients see it."""
    candidates = [c for c in cells if c["mode"] == "orchestrator"]
    if not candidates:
        return None
    return max(candidates, key=lambda c: c["ttft_ms"].get("p99") or 0.0)


def ctx_reply_cost(ctx: Server, prompt: int, with_b64: bool, seconds: float = 1.0) -> dict[str, float]:
    """CTX's answer for one prompt with and without the b64 prompt: its size, and CTX's CPU per request (one
    request at a time over a keep-alive connection, utime + stime of the CTX process)."""
    import http.client

    from bench.bodies import client_completion_body
    from bench.machine import cpu_seconds

    body = client_completion_body(prompt, MAX_TOKENS, stream=False)
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
    meta_cluster = Cluster(cluster.ctx, cluster.gen, meta)
    runs = []
    try:
        for level in levels:
            cell = run_cell(processes, meta_cluster, "orchestrator", prompt, level, phases)
            cell["variant"] = "metadata_only"
            runs.append(cell)
    finally:
        processes.stop([meta])
    seconds = 1.0 if phases.measure_s >= FULL.measure_s else 0.3
    return {"prompt_tokens": prompt, "runs": runs,
            "ctx_reply": {"with_b64": ctx_reply_cost(cluster.ctx, prompt, True, seconds),
                          "without_b64": ctx_reply_cost(cluster.ctx, prompt, False, seconds)}}


def api_workers_scenario(prompts: tuple[int, ...], concurrency: tuple[int, ...], phases: Phases) -> dict[str, Any]:
    if "--api-workers" not in orchestrator_help():
        return {"available": False,
                "note": "`disagg-serve orchestrator --api-workers N` does not exist yet; the scenario runs as soon "
                        "as it does"}
    prompt = TARGET_PROMPT if TARGET_PROMPT in prompts else max(prompts)
    levels = [c for c in concurrency if c >= 16][:2] or [max(concurrency)]
    runs = []
    for workers in (1, 2):
        with Processes() as processes:
            cluster = start_cluster(processes, ["--api-workers", str(workers)])
            for level in levels:
                cell = run_cell(processes, cluster, "orchestrator", prompt, level, phases)
                cell["api_workers"] = workers
                runs.append(cell)
    return {"available": True, "prompt_tokens": prompt, "runs": runs}


# -- reporting -----------------------------------------------------------------------------------------------------
def _pair(cells: list[dict[str, Any]], prompt: int, level: int) -> tuple[dict[str, Any] | None, dict[str, Any] | None]:
    orch = next((c for c in cells if c["mode"] == "orchestrator" and c["prompt_tokens"] == prompt
                 and c["concurrency"] == level), None)
    direct = next((c for c in cells if c["mode"] == "direct" and c["prompt_tokens"] == prompt
                   and c["concurrency"] == level), None)
    return orch, direct


# Above this the "direct" client (one process making both upstream calls with httpx) is itself the bottleneck,
# so the difference no longer measures the orchestrator.
ADDED_LATENCY_MAX_CONCURRENCY = 16


def added_latency_ms(cells: list[dict[str, Any]], prompt: int, level: int) -> float | None:
    orch, direct = _pair(cells, prompt, level)
    if orch is None or direct is None or level > ADDED_LATENCY_MAX_CONCURRENCY:
        return None
    value: float = orch["ttft_ms"]["p50"] - direct["ttft_ms"]["p50"]
    return value


def targets(result: dict[str, Any]) -> list[dict[str, Any]]:
    cells = result["cells"]
    prompts = sorted({c["prompt_tokens"] for c in cells})
    prompt = TARGET_PROMPT if TARGET_PROMPT in prompts else None
    if prompt is None or not any(c["concurrency"] == 1 for c in cells):
        return []
    orch, _ = _pair(cells, prompt, 1)
    added = added_latency_ms(cells, prompt, 1)
    out = []
    if orch is not None:
        cpu = orch["cpu_ms_per_request"].get("orchestrator")
        out.append({"target": "orchestrator CPU <= 3 ms per 131k-token request while relaying the b64 string",
                    "measured": f"{fmt(cpu)} ms (concurrency 1, whole process)",
                    "met": cpu is not None and cpu <= 3.0, "aim_met": None})
    if added is not None:
        out.append({"target": "orchestrator added latency <= 2 ms at concurrency 1 (131k-token prompt, TTFT p50)",
                    "measured": f"{added:.2f} ms", "met": added <= 2.0, "aim_met": None})
    return out


def tables(result: dict[str, Any]) -> str:
    cells = result["cells"]
    prompts = sorted({c["prompt_tokens"] for c in cells})
    levels = sorted({c["concurrency"] for c in cells})
    rows = []
    for prompt in prompts:
        for level in levels:
            orch, direct = _pair(cells, prompt, level)
            if orch is None:
                continue
            lag = orch["event_loop_lag_ms"]
            rows.append([
                f"{prompt:,}", level, fmt(orch["requests_per_s"], 1),
                fmt(orch["ttft_ms"]["p50"], 1), fmt(orch["ttft_ms"]["p99"], 1),
                fmt(direct["requests_per_s"], 1) if direct else None,
                fmt(direct["ttft_ms"]["p50"], 1) if direct else None,
                fmt(direct["ttft_ms"]["p99"], 1) if direct else None,
                fmt(added_latency_ms(cells, prompt, level), 2),
                fmt(lag.get("orchestrator", {}).get("p99"), 1), fmt(lag.get("ctx", {}).get("p99"), 1),
                fmt(lag.get("gen", {}).get("p99"), 1),
                orch["errors"] + (direct["errors"] if direct else 0),
            ])
    main = markdown_table(
        ["prompt tokens", "concurrency", "req/s", "TTFT p50 ms", "TTFT p99 ms", "direct req/s",
         "direct TTFT p50", "direct TTFT p99", "orchestrator added ms (p50, concurrency <= 16)", "orch loop lag p99 ms",
         "CTX lag p99 ms", "GEN lag p99 ms", "errors"], rows)
    cpu_rows = []
    for prompt in prompts:
        for level in levels:
            orch, direct = _pair(cells, prompt, level)
            if orch is None:
                continue
            cpu = orch["cpu_ms_per_request"]
            util = orch["cpu_utilisation"]
            cpu_rows.append([f"{prompt:,}", level, fmt(cpu.get("orchestrator")), fmt(cpu.get("ctx")),
                             fmt(cpu.get("gen")), fmt(cpu.get("loadgen")),
                             " / ".join(fmt(util.get(n), 2) for n in ("orchestrator", "ctx", "gen", "loadgen")),
                             fmt(util.get("other"), 2)])
    cpu_table = markdown_table(
        ["prompt tokens", "concurrency", "orchestrator CPU ms/req", "CTX CPU ms/req", "GEN CPU ms/req",
         "load generator CPU ms/req", "cores busy: orch / CTX / GEN / loadgen",
         "cores busy with anything else"], cpu_rows)
    idle = result.get("idle_probe_ms", {})
    idle_line = "Idle /health probe latency p50 / p99 (ms): " + ", ".join(
        f"{name} {fmt(s.get('p50'), 2)} / {fmt(s.get('p99'), 2)}" for name, s in idle.items())
    parts = [main, "", cpu_table, "", idle_line]
    for key, label in (("profile", "the worst point (highest TTFT p99)"), ("profile_at_target", "the target point")):
        profile = result.get(key)
        if profile and profile.get("available"):
            parts += ["", f"Profile of the orchestrator at {label}: py-spy, {profile['samples']} samples, prompt "
                          f"{profile['prompt_tokens']:,}, concurrency {profile['concurrency']}, "
                          f"{fmt(profile['cpu_ms_per_request'].get('orchestrator'))} ms orchestrator CPU per request:",
                      "", markdown_table(["where (leaf frame's library)", "% of samples"],
                                         [[k, fmt(v, 1)] for k, v in profile["by_library_pct"].items()]),
                      "", markdown_table(["leaf frame (self time)", "% of samples"],
                                         [[f"`{f}`", fmt(v, 1)] for f, v in profile["top_self_pct"][:12]]),
                      "", markdown_table(["project frame (inclusive)", "% of samples"],
                                         [[f"`{f}`", fmt(v, 1)]
                                          for f, v in profile["top_project_inclusive_pct"][:10]])]
        elif profile:
            parts += ["", f"Profile: {profile.get('note')}"]
    meta = result.get("metadata_only")
    if meta and meta.get("runs"):
        meta_rows = []
        for run in meta["runs"]:
            base, _ = _pair(cells, run["prompt_tokens"], run["concurrency"])
            for label, cell in (("b64 relay (default)", base), ("metadata-only", run)):
                if cell is None:
                    continue
                cpu = cell["cpu_ms_per_request"]
                meta_rows.append([label, f"{cell['prompt_tokens']:,}", cell["concurrency"],
                                  fmt(cell["requests_per_s"], 1), fmt(cell["ttft_ms"]["p50"], 1),
                                  fmt(cpu.get("orchestrator")), fmt(cpu.get("ctx")), fmt(cpu.get("gen"))])
        reply = meta["ctx_reply"]
        parts += ["", markdown_table(["orchestrator mode", "prompt tokens", "concurrency", "req/s", "TTFT p50 ms",
                                      "orchestrator CPU ms/req", "CTX CPU ms/req", "GEN CPU ms/req"], meta_rows),
                  "", markdown_table(
                      ["CTX answer (one request at a time)", "bytes", "CTX CPU ms/req", "wall ms/req"],
                      [[f"{label}, {meta['prompt_tokens']:,} tokens", f"{reply[key]['bytes']:,}",
                        fmt(reply[key]["cpu_ms"]), fmt(reply[key]["wall_ms"])]
                       for label, key in (("with prompt_token_ids_b64", "with_b64"),
                                          ("without", "without_b64"))])]
    api = result.get("api_workers")
    if api and api.get("available"):
        api_rows = [[r["api_workers"], f"{r['prompt_tokens']:,}", r["concurrency"], fmt(r["requests_per_s"], 1),
                     fmt(r["ttft_ms"]["p50"], 1), fmt(r["ttft_ms"]["p99"], 1)] for r in api["runs"]]
        parts += ["", markdown_table(["orchestrator processes", "prompt tokens", "concurrency", "req/s",
                                      "TTFT p50 ms", "TTFT p99 ms"], api_rows)]
    elif api:
        parts += ["", f"Orchestrator processes: {api.get('note')}"]
    return "\n".join(parts)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0] if __doc__ else None)
    parser.add_argument("--prompts", type=int, nargs="+", default=list(PROMPTS))
    parser.add_argument("--concurrency", type=int, nargs="+", default=list(CONCURRENCY))
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--no-profile", action="store_true")
    parser.add_argument("--json", default=None)
    args = parser.parse_args(argv)
    result = run(tuple(args.prompts), tuple(args.concurrency), QUICK if args.quick else FULL,
                 profile=not args.no_profile)
    return print_and_save(result, tables, args.json)


if __name__ == "__main__":
    sys.exit(main())


"""bench.vllm_serving's report: latency against vLLM's own server, GEN's CPU on the list and array paths, the
orchestrator's CPU, each phase's load; the generated block and the plot."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from bench.driver import report
from bench.driver.report import fmt, machine_note, markdown_table
from bench.vllm_serving.measure import DISAGGREGATED, PD, VLLM
from entrypoints.bench.statistics import ratio

BEGIN, END = report.markers("vllm_serving")


def point(result: dict[str, Any], setup: str, words: int) -> dict[str, Any] | None:
    phase = result["phases"].get(setup)
    return next((p for p in phase["points"] if p["prompt_words"] == words), None) if phase else None


def latency_table(result: dict[str, Any]) -> str:
    rows = []
    sizes = result["method"]["prompts"]
    for words in sizes:
        base = point(result, VLLM, words)
        for setup in result["phases"]:
            found = point(result, setup, words)
            if found is None:
                continue
            rows.append([found["prompt_tokens"], setup, fmt(found["ttft_ms"], 0),
                         "–" if setup == VLLM or base is None else f"{fmt(ratio(found['ttft_ms'], base['ttft_ms']))}x",
                         fmt(found["first_gap_ms"], 0), fmt(found["decode_tokens_per_s"], 1),
                         fmt(found["steady_decode_tokens_per_s"], 1), len(found["runs"])])
    return markdown_table(["prompt tokens", "set-up", "TTFT p50 ms", "TTFT / vLLM server", "token 1→2 gap ms",
                           "decode tok/s (after token 1)", "steady decode tok/s (after token 2)", "runs"], rows)


def gen_cpu_table(result: dict[str, Any]) -> str:
    phase = result["phases"].get(DISAGGREGATED) or {}
    rows = []
    for cell in phase.get("gen_cpu", []):
        process, inproc = cell["process"], cell["in_process"]
        rows.append([cell["prompt_tokens"], fmt(process["list"]["cpu_ms"]), fmt(process["array"]["cpu_ms"]),
                     fmt(process["list"]["cpu_ms"] - process["array"]["cpu_ms"]), process["array"]["requests"],
                     fmt(process["list"]["wall_ms"], 0), fmt(process["array"]["wall_ms"], 0),
                     f"{process['list']['body_bytes'] / 1e3:.1f} / {process['array']['body_bytes'] / 1e3:.1f}",
                     fmt(inproc["list"]["us"], 0), fmt(inproc["array"]["us"], 0), fmt(inproc["tolist"]["us"], 1)])
    return markdown_table(["prompt tokens", "GEN process CPU ms/req, list", "array", "list − array",
                           "requests each", "wall ms/req list", "array", "body KB list / array",
                           "in-process µs, list path", "array path", "the adapter's tolist() alone"], rows)


def orchestrator_table(result: dict[str, Any]) -> str:
    rows = []
    for setup in (DISAGGREGATED, PD):
        cell = (result["phases"].get(setup) or {}).get("orchestrator_cpu")
        if cell:
            # A request here lasts ~a second (mock workers: milliseconds), so the background loops' idle CPU
            # (health checks, the loop-lag monitor) lands in the per-request figure; also shown net of it.
            net = cell["cpu_ms_per_request"] - cell["idle_cpu_ms_per_s"] * cell["wall_ms_per_request"] / 1e3
            rows.append([f"our orchestrator → {'our CTX + GEN on vLLM' if setup == DISAGGREGATED else 'vLLM P + D'}"
                         " (this run)", cell["prompt_tokens"], fmt(cell["cpu_ms_per_request"]), fmt(net),
                         fmt(cell["wall_ms_per_request"], 0), fmt(cell["idle_cpu_ms_per_s"]), cell["requests"]])
    return markdown_table(["proxy", "prompt tokens", "CPU ms/req", "net of idle CPU ms/req", "wall ms/req",
                           "idle CPU ms/s", "requests"], rows)


def tables(result: dict[str, Any]) -> str:
    phases = result["phases"]
    loads = markdown_table(["phase", "load average before", "after", "start-up s", "phase s"],
                           [[s, p.get("loadavg_before"), p.get("loadavg_after"), fmt(p.get("startup_s"), 0),
                             fmt(p.get("duration_s"), 0)] for s, p in phases.items()])
    return "\n\n".join([latency_table(result), gen_cpu_table(result), orchestrator_table(result), loads])


def generated_block(result: dict[str, Any], plot: str) -> str:
    method = result["method"]
    note = (f"{machine_note(result)}, at end {result.get('loadavg_at_end')}; {result.get('mode', 'full')} "
            f"run, {fmt(result.get('duration_s', 0) / 60, 1)} min; {method['runs']} runs per point, "
            f"max_tokens {method['max_tokens']}, concurrency 1")
    return "\n".join([BEGIN, "", f"Measured on {note}.", "", tables(result), "", f"![vLLM serving]({plot})", "",
                      END])


def plot(result: dict[str, Any], path: Path) -> Path:
    from bench.driver import plots

    return plots.vllm_serving_plot(result, path)

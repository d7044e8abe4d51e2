"""bench.orchestrator_cost's report: CPU per request of each set-up against the pass-through baseline and the best
Rust gateway, added latency against the direct client, idle CPU, the gateways' legs, the profile, and the
targets."""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

from bench.driver import py_spy, report
from bench.driver.loadgen import PATHS
from bench.driver.report import fmt, machine_note, markdown_table, verdict
from bench.peers import rust_gateways
from entrypoints.bench.statistics import ratio

MAX_TOKENS = 8  # GEN's frames per answer (and what a result that does not say had)
BASELINE = "pass-through"
METADATA_ONLY = "metadata-only"
ENDPOINTS = ("chat", "completions")  # chat first: what clients send most
GATEWAYS = tuple(g.name for g in rust_gateways.GATEWAYS)
BEGIN, END = report.markers("orchestrator_cost")


def _endpoint(c: dict[str, Any]) -> str:
    return str(c.get("endpoint", "completions"))  # results from before chat was measured drove completions only


def cell(result: dict[str, Any], setup: str, prompt: int, level: int,
         endpoint: str | None = None) -> dict[str, Any] | None:
    """The cell of ``setup`` at ``prompt`` and ``level``, on ``endpoint`` (None: the first of any endpoint)."""
    return next((c for c in result["cells"] if c["setup"] == setup and c["prompt_tokens"] == prompt
                 and c["concurrency"] == level and (endpoint is None or _endpoint(c) == endpoint)), None)


def cpu_ms(result: dict[str, Any], setup: str, prompt: int, level: int, endpoint: str | None = None) -> float | None:
    found = cell(result, setup, prompt, level, endpoint)
    value = found["cpu_ms_per_request"].get("proxy") if found else None
    return float(value) if value is not None else None


def added_ms(result: dict[str, Any], setup: str, prompt: int, endpoint: str | None = None) -> float | None:
    through = cell(result, setup, prompt, 1, endpoint)
    direct = cell(result, "direct", prompt, 1, _endpoint(through) if through else endpoint)
    if through is None or direct is None:
        return None
    return float(through["ttft_ms"]["p50"] - direct["ttft_ms"]["p50"])


def best_gateway(result: dict[str, Any], prompt: int, level: int, endpoint: str) -> tuple[str, float] | None:
    """The Rust gateway with the least CPU per request at this point, and that CPU."""
    measured = [(name, value) for name in GATEWAYS
                if (value := cpu_ms(result, name, prompt, level, endpoint)) is not None and math.isfinite(value)]
    return min(measured, key=lambda pair: pair[1]) if measured else None


def setups_in(result: dict[str, Any]) -> list[str]:
    """Ours first, then the Rust gateways, the pass-through baseline last."""
    seen: list[str] = []
    for c in result["cells"]:
        if c["setup"] not in seen and c["setup"] != "direct":
            seen.append(c["setup"])
    ours = [s for s in seen if s != BASELINE and s not in GATEWAYS]
    return ours + [s for s in GATEWAYS if s in seen] + ([BASELINE] if BASELINE in seen else [])


def _sizes(result: dict[str, Any]) -> tuple[list[int], list[int]]:
    cells = result["cells"]
    return sorted({c["prompt_tokens"] for c in cells}), sorted({c["concurrency"] for c in cells})


def endpoints_in(result: dict[str, Any]) -> list[str]:
    found = {_endpoint(c) for c in result["cells"]}
    return [e for e in ENDPOINTS if e in found] + sorted(found - set(ENDPOINTS))


def _reference_endpoint(result: dict[str, Any]) -> str:
    """The endpoint the first targets were set on: completions, where they were measured."""
    found = endpoints_in(result)
    return "completions" if "completions" in found else (found[0] if found else "completions")


def tables(result: dict[str, Any]) -> str:
    prompts, levels = _sizes(result)
    rows = []
    for prompt in prompts:
        for endpoint in endpoints_in(result):
            for level in levels:
                base = cpu_ms(result, BASELINE, prompt, level, endpoint)
                best = best_gateway(result, prompt, level, endpoint)
                for setup in setups_in(result):
                    found = cell(result, setup, prompt, level, endpoint)
                    if found is None:
                        continue
                    ours = cpu_ms(result, setup, prompt, level, endpoint)
                    added = added_ms(result, setup, prompt, endpoint) if level == 1 else None
                    rows.append([f"{prompt:,}", endpoint, level, setup, fmt(ours),
                                 "–" if setup == BASELINE else f"{fmt(ratio(ours or 0.0, base or 0.0))}x",
                                 f"{fmt(ratio(ours or 0.0, best[1]))}x" if best else "–",
                                 fmt(found["requests_per_s"], 1), fmt(found["ttft_ms"]["p50"]), fmt(added),
                                 found["errors"]])
    main = markdown_table(["prompt tokens", "endpoint", "concurrency", "set-up", "CPU ms/req", "/ pass-through",
                           "/ best Rust gateway", "req/s", "TTFT p50 ms", "added TTFT p50 ms (vs direct)", "errors"],
                          rows)
    flat_rows = []
    for setup in setups_in(result):
        for endpoint in endpoints_in(result):
            for prompt in prompts:
                low = cpu_ms(result, setup, prompt, min(levels), endpoint)
                high = cpu_ms(result, setup, prompt, max(levels), endpoint)
                if low is not None and high is not None:
                    flat_rows.append([setup, endpoint, f"{prompt:,}", fmt(low), fmt(high),
                                      f"{fmt(ratio(high, low))}x"])
    flat = markdown_table(["set-up", "endpoint", "prompt tokens", f"CPU ms/req, c={min(levels)}", f"c={max(levels)}",
                           f"c={max(levels)} / c={min(levels)}"], flat_rows)
    idle = result.get("idle_cpu_ms_per_s", {})
    idle_table = markdown_table(["process (idle)", "CPU ms per second"],
                                [[name, fmt(value)] for name, value in idle.items()])
    parts = [main, "", flat, "", idle_table]
    gateways = result.get("gateways", {})
    if gateways:
        def legs(name: str) -> str:
            mine = [c["legs"] for c in result["cells"] if c["setup"] == name and "legs" in c]
            if not mine:
                return "–"
            return f"{sum(leg['ctx_posts'] for leg in mine):,} / {sum(leg['gen_posts'] for leg in mine):,}"

        parts += ["", markdown_table(["Rust gateway", "package", "measured", "POSTs its CTX / GEN answered", "note"], [
            [name, g["package"], "yes" if g["available"] else "**skipped**", legs(name), g["note"]]
            for name, g in gateways.items()])]
    profile = result.get("profile")
    if profile and profile.get("available"):
        parts += ["", f"py-spy, orchestrator, prompt {profile['prompt_tokens']:,}, "
                      f"{profile.get('endpoint', 'completions')}, concurrency 1, "
                      f"{profile['samples']} samples ({fmt(profile.get('cpu_ms_per_request'))} ms CPU per request):",
                  *py_spy.profile_tables(profile)]
    return "\n".join(parts)


def targets(result: dict[str, Any], setup: str = "orchestrator") -> list[dict[str, Any]]:
    """The targets for ``setup``, as measured in this run: against the pass-through proxy (on completions, where they
    were set), and CPU per request at most the best Rust gateway's at every size, concurrency and endpoint."""
    prompts, levels = _sizes(result)
    out: list[dict[str, Any]] = []

    def add(target: str, value: float | None, limit: float, unit: str = " ms", at_least: bool = False) -> None:
        met = None if value is None or not math.isfinite(value) else (value >= limit if at_least else value <= limit)
        out.append({"target": target, "measured": f"{fmt(value)}{unit}", "met": met})

    small, large = min(prompts), max(prompts)
    ref = _reference_endpoint(result)
    add(f"CPU/req <= 2.0 ms at {large:,} tokens (b64 relay), c=1, {ref}", cpu_ms(result, setup, large, 1, ref), 2.0)
    add(f"CPU/req <= 1.5 ms at {small:,} tokens, c=1, {ref}", cpu_ms(result, setup, small, 1, ref), 1.5)
    add(f"CPU/req <= 1.0 ms at {large:,} tokens, metadata-only + tokens beside the KV, c=1, {ref}",
        cpu_ms(result, METADATA_ONLY, large, 1, ref), 1.0)
    add(f"added TTFT p50 <= 1.5 ms at {large:,} tokens, c=1, {ref}", added_ms(result, setup, large, ref), 1.5)
    add(f"added TTFT p50 <= 0.7 ms at {small:,} tokens, c=1, {ref}", added_ms(result, setup, small, ref), 0.7)
    low, high = cpu_ms(result, setup, large, 1, ref), cpu_ms(result, setup, large, max(levels), ref)
    add(f"CPU/req at c={max(levels)} within 1.3x of c=1 ({large:,} tokens, {ref})",
        ratio(high, low) if low and high else None, 1.3, "x")
    add("idle CPU <= 2 ms per second", result.get("idle_cpu_ms_per_s", {}).get(setup), 2.0, " ms/s")
    scaled = next((name for name in setups_in(result) if name.startswith(f"{setup} x")), None)
    if scaled is not None:
        one, many = cell(result, setup, small, max(levels), ref), cell(result, scaled, small, max(levels), ref)
        add(f"req/s of `{scaled}` >= 1.7x one process at c={max(levels)} ({small:,} tokens, {ref}; needs a core "
            "per front end beside the mocks and the load generator)",
            ratio(many["requests_per_s"], one["requests_per_s"]) if one and many else None, 1.7, "x", at_least=True)
    if not any(c["setup"] in GATEWAYS for c in result["cells"]):
        skipped = "; ".join(f"{n}: {g['note']}" for n, g in result.get("gateways", {}).items() if not g["available"])
        out.append({"target": "CPU/req <= the best Rust gateway's: no Rust gateway measured"
                              + (f" ({skipped})" if skipped else " (--no-gateways)"), "measured": "–", "met": None})
        return out
    for endpoint in endpoints_in(result):
        for prompt in prompts:
            for level in levels:
                best = best_gateway(result, prompt, level, endpoint)
                ours = cpu_ms(result, setup, prompt, level, endpoint)
                value = ratio(ours, best[1]) if best and ours is not None else None
                add(f"CPU/req <= best Rust gateway's ({best[0] if best else '–'}) at {prompt:,} tokens, c={level}, "
                    f"{endpoint}", value, 1.0, "x")
    return out


def targets_table(result: dict[str, Any]) -> str:
    return markdown_table(["target", "measured", "verdict"],
                          [[t["target"], t["measured"], verdict(t["met"])] for t in targets(result)])


def method_note(result: dict[str, Any]) -> str:
    method = result.get("method", {})
    endpoints = ", ".join(f"`{path}`" for path in method.get("endpoints", {"completions": PATHS["completions"]})
                          .values())
    gap = method.get("frame_gap_ms")
    return (f"Clients stream {endpoints}; GEN's {method.get('max_tokens', MAX_TOKENS)} frames "
            + (f"{gap:g} ms apart" if gap else "in one burst")
            + (f"; the Rust gateways route with `--policy {method['gateway_policy']}`"
               if result.get("gateways") and "gateway_policy" in method else "") + ".")


def generated_block(result: dict[str, Any], plot: str) -> str:
    note = f"{machine_note(result)}, {result.get('mode', 'full')} run"
    return "\n".join([BEGIN, "", f"Measured on {note}. {method_note(result)}", "", targets_table(result), "",
                      tables(result), "", f"![orchestrator cost per request]({plot})", "", END])


def plot(result: dict[str, Any], path: Path) -> Path:
    """CPU per request against concurrency, on one endpoint (chat where it was measured: what clients send)."""
    from bench.driver import plots

    endpoint = endpoints_in(result)[0] if result["cells"] else "completions"
    view = {**result, "cells": [c for c in result["cells"] if _endpoint(c) == endpoint]}
    return plots.orchestrator_cost_plot(view, setups_in(view), path, machine_note=f" ({endpoint})")

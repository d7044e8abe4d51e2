"""bench.fleet's report: per workload and router the hit ratio against the oracle, TTFT, how evenly CTX was used,
the set-up, the targets, the generated block of docs/benchmarks.md and the plot."""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

import orjson

from bench.driver import report
from bench.driver.report import fmt, machine_note, markdown_table, verdict

BEGIN, END = report.markers("fleet")


def _cells(result: dict[str, Any]) -> list[dict[str, Any]]:
    return [c for c in result["cells"] if "skipped" not in c]


def _router(cell: dict[str, Any]) -> str:
    """The router, the tokenization set-up of a --tokenize-compare run, and whether the workers published no KV
    events."""
    name = cell["router"] if "tokenize" not in cell else f"{cell['router']} [{cell['tokenize']}]"
    return name if cell.get("events", True) else f"{name}, no events"


TOKENIZE_TARGET = 10.0  # the target: follow-up TTFT p50 this many times lower than a full encode every turn


def _ratio(base: dict[str, Any] | None, cell: dict[str, Any], key: str) -> float:
    """How many times lower ``cell``'s TTFT p50 under ``key`` is than ``base``'s (nan where unknown)."""
    if base is None or cell is base:
        return math.nan
    mine, theirs = cell.get(key, {}).get("p50", math.nan), base.get(key, {}).get("p50", math.nan)
    return float(theirs / mine) if mine and math.isfinite(mine) else math.nan


def _times(base: dict[str, Any] | None, cell: dict[str, Any], key: str) -> str:
    ratio = _ratio(base, cell, key)
    return f"{fmt(ratio, 1)}x" if math.isfinite(ratio) else "–"


def _target(base: dict[str, Any] | None, cell: dict[str, Any]) -> str:
    """Issue 43's end-to-end target, for a conversation that grew past 100k tokens: follow-up TTFT p50 at least
    TOKENIZE_TARGET times lower than the baseline's, in the same run."""
    ratio = _ratio(base, cell, "followup_ttft_ms")
    if not math.isfinite(ratio) or cell.get("prompt_tokens_max", 0) < 100_000:
        return "–"
    return verdict(ratio >= TOKENIZE_TARGET)


def tokenize_table(result: dict[str, Any]) -> str:
    """--tokenize-compare: per workload and router, TTFT of follow-up turns on each tokenization set-up, and the
    first set-up's (a full encode every turn) over each other's; '' when the run compared none."""
    setups = list(result["settings"].get("tokenize_setups") or ())
    if not setups:
        return ""
    by = {(c["workload"], c["router"], c.get("tokenize")): c for c in _cells(result)}
    rows = []
    for workload, router in dict.fromkeys((c["workload"], c["router"]) for c in _cells(result)):
        base = by.get((workload, router, setups[0]))
        for setup in setups:
            c = by.get((workload, router, setup))
            if c is None:
                continue
            follow, long = c.get("followup_ttft_ms", {}), c.get("followup_long_ttft_ms", {})
            rows.append([workload, router, setup, f"{c.get('prompt_tokens_max', 0):,}",
                         f"{fmt(follow.get('p50'), 0)} / {fmt(follow.get('p99'), 0)} ({follow.get('n', 0)})",
                         f"{fmt(long.get('p50'), 0)} / {fmt(long.get('p99'), 0)} ({long.get('n', 0)})",
                         _times(base, c, "followup_ttft_ms"), _times(base, c, "followup_long_ttft_ms"),
                         _target(base, c)])
    return markdown_table(["workload", "router", "tokenization", "longest prompt (tokens)",
                           "follow-up TTFT p50 / p99 ms (n)", "follow-ups ≥ 100k tokens: p50 / p99 ms (n)",
                           f"p50 {setups[0]} ÷ this", "≥ 100k: p50 ÷",
                           f"target: ≥ {TOKENIZE_TARGET:g}x past 100k tokens"], rows)


def tables(result: dict[str, Any]) -> str:
    rows = []
    for c in _cells(result):
        orch = c["orchestrator"]
        skipped = orch.get("skipped_ctx")
        rows.append([c["workload"], _router(c), f"{c['requests']} ({c['errors']})", fmt(c["requests_per_s"], 1),
                     fmt(c["hit_ratio"], 3), fmt(c["oracle_hit_ratio"], 3),
                     fmt(c["oracle_hit_ratio"] - c["hit_ratio"], 3), fmt(c["ttft_ms"]["p50"], 0),
                     fmt(c["ttft_ms"]["p99"], 0),
                     f"{c['ctx_prefills']['min']:.0f} / {c['ctx_prefills']['max']:.0f}",
                     f"{fmt(c['ctx_busy_s']['min'], 1)} / {fmt(c['ctx_busy_s']['max'], 1)}",
                     "–" if skipped is None else f"{skipped:.0f}", fmt(c.get("busy_cores"), 2)])
    main = markdown_table(["workload", "router", "requests (errors)", "req/s (mean)", "hit ratio", "oracle",
                           "oracle − hit", "TTFT p50 ms", "TTFT p99 ms", "CTX prefills min / max",
                           "CTX busy s min / max", "skipped CTX", "cores busy"], rows)
    compared = tokenize_table(result)
    parts = [compared, "", main] if compared else [main]
    decisions = [c for c in _cells(result) if any(c["orchestrator"].get("routing_decisions", {}).values())]
    if decisions:
        names = sorted({d for c in decisions for d in c["orchestrator"]["routing_decisions"]})
        parts += ["", markdown_table(["workload", "router", *(f"CTX routing: {n}" for n in names)],
                                     [[c["workload"], _router(c),
                                       *(f"{c['orchestrator']['routing_decisions'].get(n, 0):.0f}" for n in names)]
                                      for c in decisions])]
    skipped = [c for c in result["cells"] if "skipped" in c]
    if skipped:
        parts += ["", "Skipped (the orchestrator refused the router at start-up, or the gateway could not run):", ""]
        parts += [f"- {c['router']} ({c['workload']}): `{c['skipped'][:200]}`" for c in skipped]
    errors = [c for c in _cells(result) if c["errors"]]
    if errors:
        parts += ["", "Errors:", ""]
        parts += [f"- {_router(c)} ({c['workload']}): {c['errors_by_kind']}; e.g. `{(c['error_samples'] or [''])[0]}`"
                  for c in errors]
    parts += ["", parameters_table(result)]
    return "\n".join(parts)


def parameters_table(result: dict[str, Any]) -> str:
    s = result["settings"]
    e = s["engine"]
    rows = [["fleet", f"{s['ctx_workers']} CTX + {s['gen_workers']} GEN simulated workers (one host process), "
                      "one orchestrator per run, fresh workers for every run"],
            ["engine", f"prefill {e['prefill_base_ms']:g} ms + uncached tokens / {e['prefill_tokens_per_s']:,.0f} "
                       f"tok/s, one at a time; LRU prefix cache {e['cache_tokens']:,} tokens per worker (16-token "
                       f"blocks); decode {e['itl_ms']:g} ms/token"],
            ["tokenizer", "byte (one token per character, free)" if e.get("tokenizer", "byte") == "byte" else
                          f"{e['tokenizer']} (sizes in its tokens: {s.get('chars_per_token', 1.0):.2f} characters "
                          f"per token of the work's text, {s.get('text', 'words')})"]]
    for name, flags in s.get("tokenize_setup_flags", {}).items():
        rows.append([f"tokenization: {name}", f"`{' '.join(flags)}`" if flags else "the workers' defaults"])
    for w in s["workloads"]:
        shared = (f"{w['systems']} shared prompt(s) of {w['system_tokens']:,} tokens" if w["systems"]
                  else "nothing shared")
        rows.append([f"workload {w['name']}",
                     f"{shared}; sessions open-loop at {w['session_rate']:g}/s for {w['window_s']:g} s, "
                     f"{w['turns']} turn(s) of {w['turn_tokens'][0]:,}-{w['turn_tokens'][1]:,} tokens, think "
                     f"{w['think_mean_s']:g} s (mean); max_tokens {w['max_tokens']}; "
                     f"~{w['session_rate'] * w['turns']:.0f} req/s offered"])
    rows.append(["routers (CTX pool)", ", ".join(f"{name} `{orjson.dumps(cfg).decode()}`"
                                                  for name, cfg in s["router_configs"].items()
                                                  if name in result["routers"])])
    return markdown_table(["", "set-up"], rows)


def targets(result: dict[str, Any], router: str = "cache_aware") -> list[dict[str, Any]]:
    """The fleet aims for ``router``, per workload: a hit ratio within 0.02 of the oracle; on the chat work,
    TTFT p50 and p99 at least 1.3x better than round robin's and prefix_affinity's, same run."""
    out = []
    cells = _cells(result)
    by = {(c["workload"], c["router"], c.get("events", True)): c for c in cells}
    for c in cells:
        if c["router"] != router:
            continue
        name = _router(c)
        gap = c["oracle_hit_ratio"] - c["hit_ratio"]
        out.append({"target": f"{name}, {c['workload']}: hit ratio within 0.02 of the oracle",
                    "measured": f"{fmt(c['hit_ratio'], 3)} vs {fmt(c['oracle_hit_ratio'], 3)} "
                                f"(gap {fmt(gap, 3)})",
                    "met": bool(gap <= 0.02) if math.isfinite(gap) else None})
        if not c.get("events", True):
            out += _against_gateways(c, [g for g in cells if g["workload"] == c["workload"] and g["router"] in
                                         GATEWAY_ROUTERS])
        if c["workload"] != "chat":
            continue
        for other in ("round_robin", "prefix_affinity"):
            base = by.get((c["workload"], other, c.get("events", True)))
            if base is None:
                continue
            for q in ("p50", "p99"):
                mine, theirs = c["ttft_ms"][q], base["ttft_ms"][q]
                better = theirs / mine if mine else math.nan
                out.append({"target": f"{name}, chat: TTFT {q} >= 1.3x better than {_router(base)}",
                            "measured": f"{fmt(mine, 0)} vs {fmt(theirs, 0)} ms ({fmt(better, 2)}x)",
                            "met": bool(better >= 1.3) if math.isfinite(better) else None})
    return out


GATEWAY_ROUTERS = ("sglang_gateway", "vllm_router")  # bench.fleet.benchmark.GATEWAYS


def _against_gateways(cell: dict[str, Any], gateways: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Where workers publish no events: a hit ratio at least SGLang's gateway's, and TTFT p50 and p99 no worse
    than the best gateway's, in the same run."""
    out: list[dict[str, Any]] = []
    name = _router(cell)
    sglang = next((g for g in gateways if g["router"] == "sglang_gateway"), None)
    if sglang is not None:
        mine, theirs = cell["hit_ratio"], sglang["hit_ratio"]
        out.append({"target": f"{name}, {cell['workload']}: hit ratio at least sglang_gateway's",
                    "measured": f"{fmt(mine, 3)} vs {fmt(theirs, 3)}",
                    "met": bool(mine >= theirs) if math.isfinite(mine - theirs) else None})
    for q in ("p50", "p99"):
        best = min(gateways, key=lambda g: g["ttft_ms"][q], default=None)
        if best is None:
            continue
        mine, theirs = cell["ttft_ms"][q], best["ttft_ms"][q]
        out.append({"target": f"{name}, {cell['workload']}: TTFT {q} no worse than the best gateway's",
                    "measured": f"{fmt(mine, 0)} vs {fmt(theirs, 0)} ms ({best['router']})",
                    "met": bool(mine <= theirs) if math.isfinite(mine - theirs) else None})
    return out


def targets_table(result: dict[str, Any]) -> str:
    rows = [[t["target"], t["measured"], verdict(t["met"])] for t in targets(result)]
    if not rows:
        return "No cache_aware run in this result: the DESIGN's fleet target is not measured."
    return markdown_table(["target (DESIGN, fleet)", "measured", "verdict"], rows)


def generated_block(result: dict[str, Any], plot_path: str) -> str:
    note = (f"{machine_note(result)}, {result.get('mode', 'full')} run, "
            f"{result.get('duration_s', 0) / 60:.1f} min")
    images = [f"![routers on a simulated fleet]({plot_path})"]
    workloads = _workloads(_cells(result))
    if len(workloads) > 1:
        images = [f"![routers on a simulated fleet, {w}]({_workload_plot(Path(plot_path), w).as_posix()})"
                  for w in workloads]
    return "\n".join([BEGIN, "", f"Measured on {note}.", "", targets_table(result), "", tables(result), "",
                      *images, "", END])


def plot(result: dict[str, Any], path: Path) -> Path:
    from bench.driver import plots

    cells = _cells(result)
    if any("tokenize" in c or not c.get("events", True) for c in cells):
        # --tokenize-compare, or fleets with and without events: each (router, set-up) is a series of its own
        cells = [{**c, "router": _router(c)} for c in cells]
        result = {**result, "routers": list(dict.fromkeys(c["router"] for c in cells))}
    whole = plots.fleet_plot(result, cells, path)
    workloads = _workloads(cells)
    if len(workloads) > 1:  # and one per workload, where the routers of each are read without the others
        for workload in workloads:
            plots.fleet_plot(result, [c for c in cells if c["workload"] == workload], _workload_plot(path, workload))
    return whole


def _workloads(cells: list[dict[str, Any]]) -> list[str]:
    return list(dict.fromkeys(c["workload"] for c in cells))


def _workload_plot(path: Path, workload: str) -> Path:
    return path.with_name(f"{path.stem}-{workload}{path.suffix}")

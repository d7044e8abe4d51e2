"""bench.system_load's report: the orchestrator against the direct client at each point (its added latency), CPU
per request per process, the event-loop lag, the profiles and the two extra scenarios, and the targets."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

from bench.driver import py_spy
from bench.driver.report import fmt, markdown_table

TARGET_PROMPT = 131_072


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


def _measured_points(cells: list[dict[str, Any]], prompts: list[int], levels: list[int]
                     ) -> Iterator[tuple[int, int, dict[str, Any], dict[str, Any] | None]]:
    """Each (prompt, concurrency) the orchestrator was measured at, with its cell and the direct client's."""
    for prompt in prompts:
        for level in levels:
            orch, direct = _pair(cells, prompt, level)
            if orch is not None:
                yield prompt, level, orch, direct


def tables(result: dict[str, Any]) -> str:
    cells = result["cells"]
    prompts = sorted({c["prompt_tokens"] for c in cells})
    levels = sorted({c["concurrency"] for c in cells})
    points = list(_measured_points(cells, prompts, levels))
    rows = []
    for prompt, level, orch, direct in points:
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
    for prompt, level, orch, _direct in points:
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
    method = result.get("method", {})
    if method.get("tokenizer", "byte") != "byte":
        text = "real text (the Python standard library's source)" if method.get("text") == "corpus" else "words"
        parts += ["", f"Workers' tokenizer: {method['tokenizer']} (prompt sizes in its tokens: "
                      f"{method['chars_per_token']:.2f} characters per token of the prompts' {text})."]
    if method.get("distinct_prompts"):
        parts += ["", "Every request sent a prompt of its own (opened by its number): none was cached."]
    elif method.get("tokenizer", "byte") != "byte":
        parts += ["", "Every request of a point sent the same prompt: a worker that caches what it tokenized "
                      "encodes it once."]
    for key, label in (("profile", "the worst point (highest TTFT p99)"), ("profile_at_target", "the target point")):
        profile = result.get(key)
        if profile and profile.get("available"):
            parts += ["", f"Profile of the orchestrator at {label}: py-spy, {profile['samples']} samples, prompt "
                          f"{profile['prompt_tokens']:,}, concurrency {profile['concurrency']}, "
                          f"{fmt(profile['cpu_ms_per_request'].get('orchestrator'))} ms orchestrator CPU per request:",
                      *py_spy.profile_tables(profile),
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
    compare = result.get("tokenize_compare")
    if compare and compare.get("runs"):
        parts += ["", tokenize_compare_table(compare)]
    return "\n".join(parts)


def tokenize_compare_table(compare: dict[str, Any]) -> str:
    """--tokenize-compare: each tokenization set-up at each point, and the first set-up's TTFT p50 over each."""
    runs = compare["runs"]
    base = {r["concurrency"]: r for r in runs if r["tokenize"] == runs[0]["tokenize"]}
    rows = []
    for r in sorted(runs, key=lambda r: r["concurrency"]):
        first = base.get(r["concurrency"])
        ratio = (first["ttft_ms"]["p50"] / r["ttft_ms"]["p50"]
                 if first is not None and first is not r and r["ttft_ms"]["p50"] else None)
        rows.append([r["tokenize"], f"`{' '.join(compare['setups'][r['tokenize']]) or 'defaults'}`",
                     f"{r['prompt_tokens']:,}", r["concurrency"], fmt(r["requests_per_s"], 1),
                     fmt(r["ttft_ms"]["p50"], 1), fmt(r["ttft_ms"]["p99"], 1),
                     fmt(r["cpu_ms_per_request"].get("ctx")), "–" if ratio is None else f"{fmt(ratio, 1)}x",
                     r["errors"]])
    return markdown_table(["tokenization", "worker flags", "prompt tokens", "concurrency", "req/s", "TTFT p50 ms",
                           "TTFT p99 ms", "CTX CPU ms/req", f"TTFT p50: {runs[0]['tokenize']} ÷ this", "errors"],
                          rows)

"""PNG plots of the benchmark results (matplotlib, Agg backend: no display needed)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import matplotlib

matplotlib.use("Agg")

import matplotlib.pyplot as plt

from bench.driver.report import fmt

_COLOURS = {"list": "#d62728", "array": "#1f77b4", "floor": "#2ca02c", "metadata": "#9467bd"}


def _save(figure: Any, path: Path) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    figure.tight_layout()
    figure.savefig(path, dpi=110)
    plt.close(figure)
    return path


def prompt_path_plot(result: dict[str, Any], path: Path, machine_note: str = "") -> Path:
    """List vs array vs floor, ms per operation at each prompt size (log scale)."""
    sizes = result["sizes"]
    figure, axis = plt.subplots(figsize=(8, 4.8))
    width = 0.26
    for offset, name in enumerate(("list", "array", "floor")):
        xs = [i + (offset - 1) * width for i in range(len(sizes))]
        ys = [s["timing"][name]["ms"] for s in sizes]
        bars = axis.bar(xs, ys, width, label={"list": "list path (prompt_token_ids)",
                                              "array": "array path (prompt_token_ids_b64)",
                                              "floor": "floor (orjson + b64decode + frombuffer)"}[name],
                        color=_COLOURS[name])
        for bar, value in zip(bars, ys, strict=True):
            axis.annotate(f"{value:.2f}", (bar.get_x() + bar.get_width() / 2, value), ha="center", va="bottom",
                          fontsize=7)
    axis.set_xticks(range(len(sizes)))
    axis.set_xticklabels([f"{s['tokens']:,} tokens\nlist/array {fmt(s['speedup_list_over_array'], 0)}x, "
                          f"array/floor {fmt(s['array_over_floor'])}x" for s in sizes], fontsize=8)
    axis.set_yscale("log")
    axis.set_ylabel("ms per operation (median)")
    axis.set_title("GEN prompt path, in-process: list vs array vs floor" + machine_note, fontsize=10)
    axis.legend(fontsize=8)
    axis.grid(axis="y", which="both", alpha=0.3)
    return _save(figure, path)


def cpu_per_request_plot(gen_http: dict[str, Any] | None, prompt_path: dict[str, Any] | None, path: Path,
                         machine_note: str = "") -> Path:
    """CPU per request vs prompt length: the GEN worker over HTTP (whole process) and the in-process path."""
    figure, axis = plt.subplots(figsize=(8, 4.8))
    if gen_http:
        sizes = [s["tokens"] for s in gen_http["sizes"]]
        labels = {"list": "GEN worker, list body", "array": "GEN worker, b64 body",
                  "metadata": "GEN worker, metadata-only body"}
        for kind, label in labels.items():
            axis.plot(sizes, [s[kind]["cpu_ms"] for s in gen_http["sizes"]], marker="o", label=label,
                      color=_COLOURS[kind])
    if prompt_path:
        sizes = [s["tokens"] for s in prompt_path["sizes"]]
        labels = {"list": "in-process list path", "array": "in-process array path", "floor": "in-process floor"}
        for kind, label in labels.items():
            axis.plot(sizes, [s["timing"][kind]["cpu_ms"] for s in prompt_path["sizes"]], marker="x",
                      linestyle="--", label=label, color=_COLOURS[kind], alpha=0.7)
    axis.set_xscale("log")
    axis.set_yscale("log")
    ticks = sorted({s["tokens"] for r in (gen_http, prompt_path) if r for s in r["sizes"]})
    axis.set_xticks(ticks)
    axis.set_xticklabels([f"{t:,}" for t in ticks])
    axis.minorticks_off()
    axis.set_xlabel("prompt tokens")
    axis.set_ylabel("CPU ms per request")
    axis.set_title("CPU per request vs prompt length" + machine_note, fontsize=10)
    axis.grid(which="both", alpha=0.3)
    axis.legend(fontsize=8)
    return _save(figure, path)


def load_plot(result: dict[str, Any], path: Path, machine_note: str = "") -> Path:
    """TTFT p50/p99 and requests/s against concurrency, one line per prompt size."""
    cells = result["cells"]
    prompts = sorted({c["prompt_tokens"] for c in cells})
    figure, (latency, rate) = plt.subplots(1, 2, figsize=(11, 4.6))
    palette = plt.get_cmap("viridis")
    for index, prompt in enumerate(prompts):
        colour = palette(index / max(1, len(prompts) - 1) * 0.85)
        for mode, style in (("orchestrator", "-"), ("direct", ":")):
            points = sorted((c for c in cells if c["prompt_tokens"] == prompt and c["mode"] == mode),
                            key=lambda c: c["concurrency"])
            if not points:
                continue
            xs = [c["concurrency"] for c in points]
            label = f"{prompt:,} tok" + (" (direct CTX+GEN)" if mode == "direct" else "")
            latency.plot(xs, [c["ttft_ms"]["p50"] for c in points], marker="o", linestyle=style, color=colour,
                         label=label + " p50")
            if mode == "orchestrator":
                latency.plot(xs, [c["ttft_ms"]["p99"] for c in points], marker="^", linestyle="--", color=colour,
                             alpha=0.6, label=label + " p99")
            rate.plot(xs, [c["requests_per_s"] for c in points], marker="o", linestyle=style, color=colour,
                      label=label)
    levels = sorted({c["concurrency"] for c in cells})
    for axis in (latency, rate):
        axis.set_xscale("log", base=2)
        axis.set_xticks(levels)
        axis.set_xticklabels([str(level) for level in levels])
        axis.set_xlabel("concurrency (streaming clients)")
        axis.grid(which="both", alpha=0.3)
    latency.set_yscale("log")
    latency.set_ylabel("time to first token, ms (client)")
    latency.set_title("TTFT vs concurrency" + machine_note, fontsize=10)
    latency.legend(fontsize=7)
    rate.set_ylabel("requests/s")
    rate.set_title("throughput vs concurrency (synthetic engine)", fontsize=10)
    rate.legend(fontsize=7)
    return _save(figure, path)


def reference_plot(result: dict[str, Any], path: Path, machine_note: str = "") -> Path:
    points = result["points"]
    figure, (ttft, decode) = plt.subplots(1, 2, figsize=(10, 4.2))
    xs = [p["aggregated"]["prompt_tokens"] for p in points]
    for mode, colour in (("aggregated", "#1f77b4"), ("disaggregated", "#ff7f0e")):
        ttft.plot(xs, [p[mode]["ttft_ms"] for p in points], marker="o", color=colour, label=f"{mode}: TTFT")
        if any(p[mode].get("first_gap_ms") is not None for p in points):
            ttft.plot(xs, [p[mode].get("first_gap_ms") or 0 for p in points], marker="^", linestyle="--",
                      color=colour, label=f"{mode}: gap token 1→2")
        steady = [p[mode].get("steady_decode_tokens_per_s") for p in points]
        decode.plot(xs, [v if v is not None else p[mode]["decode_tokens_per_s"] or 0
                         for v, p in zip(steady, points, strict=True)], marker="o", color=colour,
                    label=f"{mode} (steady)")
        decode.plot(xs, [p[mode]["decode_tokens_per_s"] or 0 for p in points], marker="x", linestyle=":",
                    color=colour, label=f"{mode} (with the 1→2 gap)")
    ttft.set_xlabel("prompt tokens")
    ttft.set_ylabel("ms")
    ttft.set_title("reference engine: TTFT and the hand-off gap" + machine_note, fontsize=10)
    decode.set_xlabel("prompt tokens")
    decode.set_ylabel("decode tokens/s")
    decode.set_title("reference engine: decode rate (BLAS 1 thread)", fontsize=10)
    for axis in (ttft, decode):
        axis.grid(alpha=0.3)
        axis.legend(fontsize=8)
    return _save(figure, path)


def orchestrator_cost_plot(result: dict[str, Any], setups: list[str], path: Path, machine_note: str = "") -> Path:
    """CPU per request of each proxy set-up against concurrency, one panel per prompt size (bench.orchestrator_cost)."""
    cells = result["cells"]
    prompts = sorted({c["prompt_tokens"] for c in cells})
    figure, axes = plt.subplots(1, len(prompts), figsize=(4 * len(prompts), 4.2), sharey=True, squeeze=False)
    palette = plt.get_cmap("tab10")
    for axis, prompt in zip(axes[0], prompts, strict=True):
        for index, setup in enumerate(setups):
            points = sorted((c for c in cells if c["setup"] == setup and c["prompt_tokens"] == prompt),
                            key=lambda c: c["concurrency"])
            if points:
                axis.plot([c["concurrency"] for c in points],
                          [c["cpu_ms_per_request"].get("proxy") or 0.0 for c in points], marker="o",
                          linestyle=":" if setup == "pass-through" else "-", color=palette(index), label=setup)
        axis.set_xscale("log", base=2)
        levels = sorted({c["concurrency"] for c in cells})
        axis.set_xticks(levels)
        axis.set_xticklabels([str(level) for level in levels])
        axis.set_xlabel("concurrency (streaming clients)")
        axis.set_title(f"{prompt:,} prompt tokens", fontsize=10)
        axis.grid(alpha=0.3)
    axes[0][0].set_ylabel("proxy process CPU ms per request")
    axes[0][-1].legend(fontsize=8)  # the largest prompt has every set-up
    figure.suptitle("Orchestrator vs a pass-through proxy, mock workers" + machine_note, fontsize=10)
    return _save(figure, path)


def vllm_serving_plot(result: dict[str, Any], path: Path) -> Path:
    """TTFT p50 and decode tokens/s of each set-up at each prompt size; the orchestrator's CPU per request
    (bench.vllm_serving)."""
    phases = result["phases"]
    setups = list(phases)
    sizes = result["method"]["prompts"]
    figure, axes = plt.subplots(1, 3, figsize=(14, 4.4))
    palette = plt.get_cmap("tab10")
    width = 0.8 / max(len(setups), 1)
    for axis, key, label in ((axes[0], "ttft_ms", "TTFT p50 ms"),
                             (axes[1], "decode_tokens_per_s", "decode tok/s after token 1 (p50)")):
        for index, setup in enumerate(setups):
            points = {p["prompt_words"]: p for p in phases[setup]["points"]}
            xs = [i + (index - (len(setups) - 1) / 2) * width for i in range(len(sizes))]
            ys = [points[s][key] or 0.0 if s in points else 0.0 for s in sizes]
            bars = axis.bar(xs, ys, width, color=palette(index), label=setup)
            for bar, value in zip(bars, ys, strict=True):
                axis.annotate(f"{value:.0f}" if key == "ttft_ms" else f"{value:.1f}",
                              (bar.get_x() + bar.get_width() / 2, value), ha="center", va="bottom", fontsize=7)
        axis.set_xticks(range(len(sizes)))
        axis.set_xticklabels([f"{s:,} prompt tokens" for s in sizes])
        axis.set_title(label, fontsize=10)
        axis.grid(axis="y", alpha=0.3)
    axes[0].legend(fontsize=7)
    names: list[str] = []
    values: list[float] = []
    colours: list[Any] = []
    nets: list[float] = []
    for index, setup in enumerate(setups):
        cell = phases[setup].get("orchestrator_cpu")
        if cell:
            names.append("ours → " + ("CTX + GEN" if "CTX" in setup else "vLLM P/D") + "\n(this run)")
            values.append(cell["cpu_ms_per_request"])
            nets.append(cell["cpu_ms_per_request"] - cell["idle_cpu_ms_per_s"] * cell["wall_ms_per_request"] / 1e3)
            colours.append(palette(index))
    bars = axes[2].bar(range(len(names)), values, color=colours)
    axes[2].bar(range(len(nets)), nets, color="none", edgecolor="black", hatch="//",
                label="net of idle CPU x request time")
    axes[2].legend(fontsize=7)
    for bar, value in zip(bars, values, strict=True):
        axes[2].annotate(f"{value:.1f}", (bar.get_x() + bar.get_width() / 2, value), ha="center", va="bottom",
                         fontsize=7)
    axes[2].set_xticks(range(len(names)))
    axes[2].set_xticklabels(names, fontsize=7)
    axes[2].set_title("proxy CPU ms per request, ~1k-token chat, 8 tokens", fontsize=10)
    axes[2].grid(axis="y", alpha=0.3)
    machine = result.get("machine", {})
    figure.suptitle(f"vLLM (float32, 1 OMP thread per instance), concurrency 1 ({machine.get('cpu_model')}, "
                    f"{machine.get('nproc')} cores, load average {machine.get('loadavg_at_start')})", fontsize=10)
    return _save(figure, path)


def fleet_plot(result: dict[str, Any], cells: list[dict[str, Any]], path: Path) -> Path:
    """Hit ratio per router against the oracle, and TTFT p50 / p99, per workload (bench.fleet), over ``cells``: the
    measured ones (``bench.fleet.report`` leaves out the skipped)."""
    workloads = list(dict.fromkeys(c["workload"] for c in cells))
    routers = [r for r in result["routers"] if any(c["router"] == r for c in cells)]
    by = {(c["workload"], c["router"]): c for c in cells}
    figure, (hits, ttft) = plt.subplots(1, 2, figsize=(12, 4.8))
    width = 0.8 / max(1, len(routers))
    palette = plt.get_cmap("tab10")
    for r_index, router in enumerate(routers):
        xs, ratios, p50s, p99s = [], [], [], []
        for w_index, workload in enumerate(workloads):
            c = by.get((workload, router))
            if c is None:
                continue
            xs.append(w_index + (r_index - (len(routers) - 1) / 2) * width)
            ratios.append(c["hit_ratio"])
            p50s.append(c["ttft_ms"]["p50"])
            p99s.append(c["ttft_ms"]["p99"])
        colour = palette(r_index)
        hits.bar(xs, ratios, width, label=router, color=colour)
        ttft.bar(xs, p50s, width, label=f"{router} p50", color=colour)
        ttft.scatter(xs, p99s, marker="v", color=colour, edgecolors="black", zorder=3,
                     label=f"{router} p99")
    for w_index, workload in enumerate(workloads):
        oracle = next((by[(workload, r)]["oracle_hit_ratio"] for r in routers if (workload, r) in by), None)
        if oracle is not None:
            hits.hlines(oracle, w_index - 0.45, w_index + 0.45, colors="black", linestyles="--",
                        label="oracle (best any cache could do)" if w_index == 0 else None)
    for axis in (hits, ttft):
        axis.set_xticks(range(len(workloads)))
        axis.set_xticklabels(workloads)
        axis.grid(axis="y", alpha=0.3)
    hits.set_ylim(0, 1.2)
    hits.set_ylabel("prefix-cache hit ratio (fleet, token-weighted)")
    hits.set_title("hit ratio per router vs the oracle", fontsize=10)
    hits.legend(fontsize=7, loc="upper center", ncol=3)
    if any(c["ttft_ms"]["p50"] and c["ttft_ms"]["p50"] > 0 for c in cells):
        from matplotlib.ticker import ScalarFormatter

        ttft.set_yscale("log")
        ttft.yaxis.set_major_formatter(ScalarFormatter())
        ttft.yaxis.set_minor_formatter(ScalarFormatter())
    ttft.set_ylabel("TTFT ms (client): bar p50, marker p99")
    ttft.set_title("time to first token", fontsize=10)
    ttft.legend(fontsize=6, ncol=2)
    machine = result.get("machine", {})
    figure.suptitle(f"Routers on a simulated fleet ({result['settings']['ctx_workers']} CTX + "
                    f"{result['settings']['gen_workers']} GEN; {machine.get('cpu_model')}, {machine.get('nproc')} "
                    f"cores, {result.get('mode', 'full')} run)", fontsize=10)
    return _save(figure, path)

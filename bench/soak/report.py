"""bench.soak's report: outcomes counted (an error overlapping GEN's restart is expected, any other is not), RSS
flat after warm-up, gauges back to 0, descriptors at start and end; its table."""

from __future__ import annotations

import statistics
from dataclasses import asdict
from typing import Any

from bench.soak.run import Run


def _quarter_median(samples: list[dict[str, Any]], role: str, low: float, high: float, length: float) -> float | None:
    values = [s["rss_mb"] for s in samples
              if s["role"] == role and s["rss_mb"] is not None and low * length <= s["t"] < high * length]
    return round(statistics.median(values), 1) if values else None


def summarize_run(run: Run, end_gauges: dict[str, dict[str, float]], fds_end: dict[str, int | None],
                  rss_end: dict[str, float | None], slack: float) -> dict[str, Any]:
    """The soak's result; an error that overlaps GEN's restart window (widened by ``slack`` seconds) is expected."""
    counts = {"ok": 0, "cancelled": 0, "expected_errors": 0, "unexpected_errors": 0}
    unexpected: list[str] = []
    unexpected_at: list[float] = []
    expected: list[str] = []
    for outcome in run.outcomes:
        if outcome.kind in ("ok", "cancelled"):
            counts[outcome.kind] += 1
        elif run.restart.covers(outcome.started, outcome.ended, slack) and not outcome.detail.startswith("wrong"):
            counts["expected_errors"] += 1
            expected.append(outcome.detail)
        else:
            counts["unexpected_errors"] += 1
            unexpected.append(outcome.detail)
            unexpected_at.append(round(outcome.started - run.load_started, 3))
    length = run.load_ended - run.load_started
    rss = {}
    for role in run.processes:
        q2 = _quarter_median(run.samples, role, 0.25, 0.5, length)
        q4 = _quarter_median(run.samples, role, 0.75, 1.01, length)
        growth = round(100 * (q4 - q2) / q2, 1) if q2 and q4 else None
        rss[role] = {"q2_median_mb": q2, "q4_median_mb": q4, "growth_pct": growth, "end_mb": rss_end[role]}
    fds: dict[str, dict[str, int | None]] = {}
    for role, proc in run.processes.items():
        start, end = proc.fds_at_start, fds_end[role]
        fds[role] = {"pid": proc.pid, "start": start, "end": end,
                     "growth": end - start if end is not None and start is not None else None}
    restart = asdict(run.restart)
    for key in ("sigterm_at", "healthy_at"):
        if restart[key] is not None:
            restart[key] = round(restart[key] - run.load_started, 3)
    return {
        "settings": asdict(run.settings),
        "duration_s": round(length, 2),
        "requests": len(run.outcomes),
        "requests_per_s": round(len(run.outcomes) / length, 1) if length else None,
        "streaming_share": round(sum(o.streaming for o in run.outcomes) / max(1, len(run.outcomes)), 3),
        **counts,
        "expected_error_samples": sorted(set(expected))[:10],
        "unexpected_error_samples": sorted(set(unexpected))[:10],
        "unexpected_error_times_s": sorted(unexpected_at)[:100],
        "gen_restart": restart,
        "end_gauges": end_gauges,
        "end_gauges_all_zero": all(v == 0 for g in end_gauges.values() for v in g.values()),
        "rss_mb": rss,
        "open_fds": fds,
        "samples": run.samples,
    }


def table(result: dict[str, Any]) -> str:
    lines = [
        f"soak: {result['duration_s']} s at concurrency {result['settings']['concurrency']}, "
        f"{result['requests']} requests ({result['requests_per_s']}/s, {result['streaming_share']:.0%} streamed)",
        "",
        "| outcome | count |", "| --- | --- |",
        *(f"| {k.replace('_', ' ')} | {result[k]} |"
          for k in ("ok", "cancelled", "expected_errors", "unexpected_errors")),
        "",
        "| process | RSS Q2 median MB | RSS Q4 median MB | growth % | fds start | fds end |",
        "| --- | --- | --- | --- | --- | --- |",
    ]
    for role, rss in result["rss_mb"].items():
        fds = result["open_fds"][role]
        lines.append(f"| {role} | {rss['q2_median_mb']} | {rss['q4_median_mb']} | {rss['growth_pct']} | "
                     f"{fds['start']} | {fds['end']} |")
    restart = result["gen_restart"]
    lines += ["", f"GEN restart: SIGTERM at {restart['sigterm_at']} s (exit {restart['exit_status']}), healthy again "
                  f"at {restart['healthy_at']} s (pid {restart['old_pid']} -> {restart['new_pid']})",
              "end gauges: " + ", ".join(f"{k} {v:g}" for g in result["end_gauges"].values() for k, v in g.items())]
    if result["unexpected_error_samples"]:
        lines += ["unexpected errors:", *(f"  {e}" for e in result["unexpected_error_samples"])]
    return "\n".join(lines)

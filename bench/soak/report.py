"""bench.soak's report: outcomes counted (an error overlapping a SIGKILL of a GEN is expected, any other is not),
what each kind of GEN stop cost the clients that met it, RSS flat after warm-up, gauges back to 0, descriptors at
start and end; its table."""

from __future__ import annotations

import math
import statistics
from dataclasses import asdict
from typing import Any

from bench.soak.load import Outcome
from bench.soak.run import Run


def _quarter_median(samples: list[dict[str, Any]], role: str, low: float, high: float, length: float) -> float | None:
    values = [s["rss_mb"] for s in samples
              if s["role"] == role and s["rss_mb"] is not None and low * length <= s["t"] < high * length]
    return round(statistics.median(values), 1) if values else None


def _percentile(values: list[float], q: float) -> float | None:
    """The nearest-rank ``q`` percentile of ``values``, in milliseconds (None for none)."""
    if not values:
        return None
    ordered = sorted(values)
    return round(1000 * ordered[min(len(ordered) - 1, max(0, math.ceil(q / 100 * len(ordered)) - 1))], 1)


def _cost(outcomes: list[Outcome]) -> dict[str, Any]:
    """How a group of requests went: counts, and its streams' time to first token and longest stall."""
    streams = [o for o in outcomes if o.kind == "ok" and o.streaming]
    ttft = [o.ttft_s for o in streams if o.ttft_s is not None]
    gaps = [o.max_gap_s for o in streams if o.max_gap_s is not None]
    return {"requests": len(outcomes), "ok": sum(o.kind == "ok" for o in outcomes),
            "errors": sum(o.kind == "error" for o in outcomes), "streams_ok": len(streams),
            "ttft_p50_ms": _percentile(ttft, 50), "ttft_p99_ms": _percentile(ttft, 99),
            "stall_p50_ms": _percentile(gaps, 50), "stall_p99_ms": _percentile(gaps, 99)}


def stop_costs(run: Run, slack: float) -> dict[str, dict[str, Any]]:
    """What GEN stops cost the clients, by signal: the requests in flight when it was sent (a drain lets them
    finish, a kill cuts them) and those that started before the GEN was back; and, to compare, every request that
    met no stop ("steady")."""
    costs: dict[str, dict[str, Any]] = {}
    steady = [o for o in run.outcomes if not any(e.covers(o.started, o.ended, slack) for e in run.events)]
    costs["steady"] = {"stops": 0, "in_flight": _cost(steady), "started_while_down": _cost([])}
    for kind in ("SIGTERM", "SIGKILL"):
        events = [e for e in run.events if e.kind == kind]
        if not events:
            continue
        in_flight = [o for o in run.outcomes if any(e.in_flight(o.started, o.ended) for e in events)]
        met = {id(o) for o in in_flight}
        later = [o for o in run.outcomes
                 if id(o) not in met and any(e.covers(o.started, o.ended, slack) for e in events)]
        costs[kind] = {"stops": len(events), "in_flight": _cost(in_flight), "started_while_down": _cost(later)}
    return costs


def summarize_run(run: Run, end_gauges: dict[str, dict[str, float]], fds_end: dict[str, int | None],
                  rss_end: dict[str, float | None], slack: float) -> dict[str, Any]:
    """The soak's result. An error that overlaps a SIGKILL of a GEN (its window widened by ``slack`` seconds) is
    expected until streams cut mid-way are continued elsewhere; a SIGTERM drains, so an error near one is not."""
    counts = {"ok": 0, "cancelled": 0, "expected_errors": 0, "unexpected_errors": 0}
    unexpected: list[str] = []
    unexpected_at: list[float] = []
    expected: list[str] = []
    kills = [e for e in run.events if e.kind == "SIGKILL"]
    for outcome in run.outcomes:
        if outcome.kind in ("ok", "cancelled"):
            counts[outcome.kind] += 1
        elif any(e.covers(outcome.started, outcome.ended, slack) for e in kills) \
                and not outcome.detail.startswith("wrong"):
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
    events = []
    for event in run.events:
        fields = asdict(event)
        for key in ("signal_at", "exited_at", "healthy_at"):
            if fields[key] is not None:
                fields[key] = round(fields[key] - run.load_started, 3)
        events.append(fields)
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
        "gen_events": events,
        "gen_restart": events[0] if events else None,
        "stop_costs": stop_costs(run, slack),
        "end_gauges": end_gauges,
        "end_gauges_all_zero": all(v == 0 for g in end_gauges.values() for v in g.values()),
        "rss_mb": rss,
        "open_fds": fds,
        "samples": run.samples,
    }


_STOPS = {"steady": "none near (steady)", "SIGTERM": "SIGTERM (drained, restarted)",
          "SIGKILL": "SIGKILL (killed, restarted)"}


def _ms(value: float | None) -> str:
    return "-" if value is None else f"{value:g}"


def stop_table(costs: dict[str, dict[str, Any]]) -> list[str]:
    """docs/reliability.md's table of GEN stops: what the clients that met one saw, beside those that met none."""
    lines = ["| GEN stop | stops | requests in flight at the signal: ok / errors | their streams' longest stall, "
             "p50 / p99 ms | requests started before it was back: ok / errors | their TTFT, p50 / p99 ms |",
             "| --- | --- | --- | --- | --- | --- |"]
    for kind, cost in costs.items():
        flight, later = cost["in_flight"], cost["started_while_down"]
        if kind == "steady":
            lines.append(f"| {_STOPS[kind]} | - | {flight['ok']} / {flight['errors']} | "
                         f"{_ms(flight['stall_p50_ms'])} / {_ms(flight['stall_p99_ms'])} | - | "
                         f"{_ms(flight['ttft_p50_ms'])} / {_ms(flight['ttft_p99_ms'])} |")
            continue
        lines.append(f"| {_STOPS[kind]} | {cost['stops']} | {flight['ok']} / {flight['errors']} | "
                     f"{_ms(flight['stall_p50_ms'])} / {_ms(flight['stall_p99_ms'])} | "
                     f"{later['ok']} / {later['errors']} | "
                     f"{_ms(later['ttft_p50_ms'])} / {_ms(later['ttft_p99_ms'])} |")
    return lines


_OUTCOMES = {"ok": "ok (text checked)", "cancelled": "cancelled by the client on purpose",
             "expected_errors": "errors near a SIGKILL", "unexpected_errors": "unexpected errors"}


def table(result: dict[str, Any]) -> str:
    lines = [
        f"soak: {result['duration_s']} s at concurrency {result['settings']['concurrency']}, "
        f"{result['requests']} requests ({result['requests_per_s']}/s, {result['streaming_share']:.0%} streamed)",
        "",
        "| outcome | count |", "| --- | --- |",
        *(f"| {_OUTCOMES[k]} | {result[k]} |" for k in _OUTCOMES),
        "",
        "| process | RSS Q2 median MB | RSS Q4 median MB | growth % | fds start | fds end |",
        "| --- | --- | --- | --- | --- | --- |",
    ]
    for role, rss in result["rss_mb"].items():
        fds = result["open_fds"][role]
        lines.append(f"| {role} | {rss['q2_median_mb']} | {rss['q4_median_mb']} | {rss['growth_pct']} | "
                     f"{fds['start']} | {fds['end']} |")
    lines += ["", *stop_table(result["stop_costs"]), ""]
    for event in result["gen_events"]:
        lines.append(f"{event['role']}: {event['kind']} at {event['signal_at']} s, exited {event['exited_at']} s "
                     f"(status {event['exit_status']}), healthy again {event['healthy_at']} s "
                     f"(pid {event['old_pid']} -> {event['new_pid']})")
    lines.append("end gauges: " + ", ".join(f"{k} {v:g}" for g in result["end_gauges"].values() for k, v in g.items()))
    if result["expected_error_samples"]:
        lines += ["errors near a SIGKILL (a cut stream is mid-stream migration's to continue):",
                  *(f"  {e}" for e in result["expected_error_samples"])]
    if result["unexpected_error_samples"]:
        lines += ["unexpected errors:", *(f"  {e}" for e in result["unexpected_error_samples"])]
    return "\n".join(lines)

"""bench.soak's report: which requests a GEN stop met (in flight at its signal, or started before the GEN was back),
what they saw (errors, time to first token, longest stall), beside the requests that met none."""

from __future__ import annotations

from bench.soak.benchmark import settings
from bench.soak.load import Outcome
from bench.soak.report import stop_costs, stop_table
from bench.soak.run import GenEvent, Run


def stream(started: float, ended: float, ttft_s: float, max_gap_s: float, kind: str = "ok") -> Outcome:
    return Outcome(started, ended, kind, streaming=True, ttft_s=ttft_s, max_gap_s=max_gap_s)


def test_a_stop_is_charged_with_the_requests_it_met_and_steady_ones_with_none() -> None:
    run = Run(settings(60.0), {})
    run.events = [GenEvent("SIGKILL", "gen0", signal_at=10.0, exited_at=10.01, healthy_at=11.0)]
    run.outcomes = [
        stream(1.0, 1.1, 0.010, 0.002),  # long before: steady
        stream(9.9, 10.4, 0.010, 0.300),  # in flight at the kill: continued after a 300 ms stall
        Outcome(9.95, 10.02, "error", "stream error event: the GEN stream broke", True),  # in flight, cut
        stream(10.5, 11.2, 0.600, 0.002),  # started while the GEN was down: waited for its first token
        stream(30.0, 30.1, 0.020, 0.004),  # long after: steady
    ]
    costs = stop_costs(run, slack=1.0)
    assert costs["steady"]["in_flight"] == {"requests": 2, "ok": 2, "errors": 0, "streams_ok": 2,
                                            "ttft_p50_ms": 10.0, "ttft_p99_ms": 20.0,
                                            "stall_p50_ms": 2.0, "stall_p99_ms": 4.0}
    kill = costs["SIGKILL"]
    assert kill["stops"] == 1
    assert (kill["in_flight"]["ok"], kill["in_flight"]["errors"], kill["in_flight"]["stall_p99_ms"]) == (1, 1, 300.0)
    assert (kill["started_while_down"]["requests"], kill["started_while_down"]["ttft_p50_ms"]) == (1, 600.0)
    assert "SIGTERM" not in costs  # no such stop in this run
    table = stop_table(costs)
    assert table[2].startswith("| none near (steady) | - | 2 / 0 | 2 / 4 |")
    assert table[3] == "| SIGKILL (killed, restarted) | 1 | 1 / 1 | 300 / 300 | 1 / 0 | 600 / 600 |"

"""A short soak (``python -m bench.soak``, 12 s at concurrency 16): real subprocesses on loopback, mixed streaming
and whole requests, ~10% clients hanging up early, the only GEN worker restarted midway with SIGTERM.

Asserted: no error at all (the GEN drains, and requests wait for it to come back), every in-flight and KV-store
gauge back to 0, and no process holding many more file descriptors at the end than at its start. The
RSS figures are reported by the script, not asserted here: 12 s is too short to judge a trend. 12 s, not more: the
GEN restart at 6 s still has load on both sides of it, and a leak of one descriptor per request would still be
hundreds, far above FD_BOUND; longer soaks are ``python -m bench.soak --minutes N``.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

from bench.soak.benchmark import schedule, settings

REPO_ROOT = Path(__file__).resolve().parents[3]
# The orchestrator keeps idle keep-alive connections to each worker for 30 s: up to one per concurrent client to
# CTX and one to GEN (2 x 16 here) may still be open at the end. A leak per request would be thousands.
FD_BOUND = 48


def test_a_short_soak_has_no_unexpected_errors_and_leaks_nothing(tmp_path: Path) -> None:
    out = tmp_path / "soak.json"
    done = subprocess.run(
        [sys.executable, "-m", "bench.soak", "--seconds", "12", "--concurrency", "16", "--settle-s", "6",
         "--json", str(out)],
        cwd=REPO_ROOT, capture_output=True, text=True, timeout=180,
    )
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    result = json.loads(out.read_text())
    assert result["unexpected_errors"] == 0, result["unexpected_error_samples"]
    assert result["expected_errors"] == 0  # (only a SIGKILL's are excused)
    # How many requests fit in 12 s depends on how busy the machine is, so no absolute count is asserted.
    assert result["ok"] > result["cancelled"]  # ~10% of clients hang up on purpose
    assert result["cancelled"] > 0  # the clients that hung up on purpose
    total = result["ok"] + result["cancelled"] + result["expected_errors"] + result["unexpected_errors"]
    assert total == result["requests"]
    [restart] = result["gen_events"]
    assert restart["kind"] == "SIGTERM" and restart["exit_status"] == -15  # drained, then exited by the signal
    assert restart["healthy_at"] is not None and restart["new_pid"] != restart["old_pid"]
    # Requests met the restart, and none failed: those that started before the GEN was back waited for it.
    met = result["stop_costs"]["SIGTERM"]
    assert met["started_while_down"]["requests"] > 0 and met["started_while_down"]["errors"] == 0
    assert result["end_gauges_all_zero"], result["end_gauges"]
    assert set(result["end_gauges"]) == {"ctx", "gen", "orchestrator"}
    for role, fds in result["open_fds"].items():
        assert fds["start"] is not None and fds["end"] is not None, role
        assert fds["end"] - fds["start"] <= FD_BOUND, (role, fds)
    for role, rss in result["rss_mb"].items():
        assert rss["q2_median_mb"] and rss["q4_median_mb"], role  # sampled over the whole run
    assert f"unexpected errors | {result['unexpected_errors']} |" in done.stdout  # the table was printed


def test_the_schedule_stops_the_gens_in_turn_every_period_or_once_midway() -> None:
    assert schedule(settings(60.0, gens=2, kill_every_s=20)) == [(20, "SIGKILL", 0), (40, "SIGKILL", 1)]
    assert schedule(settings(50.0, gens=3, roll_every_s=10, kill_every_s=25)) == [
        (10, "SIGTERM", 0), (20, "SIGTERM", 1), (25, "SIGKILL", 0), (30, "SIGTERM", 2), (40, "SIGTERM", 0)]
    assert schedule(settings(12.0)) == [(6.0, "SIGTERM", 0)]  # the default: the only GEN, midway
    assert schedule(settings(12.0, restart_at=0)) == []

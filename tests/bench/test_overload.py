"""A smoke run of ``bench.overload`` at a tiny size: it runs end to end, every request is answered once, the heavy
tenant is limited while the light one is served, and the table is made. Not timed: the figures come from a real
run (docs/admission.md)."""

from __future__ import annotations

from pathlib import Path

from bench import overload


def test_the_overload_benchmark_runs_and_admission_keeps_its_promises(tmp_path: Path) -> None:
    settings = overload.Settings(running=4, burst_factor=5, heavy_concurrent=8, burst_s=2.0, light_every_s=0.25,
                                 unloaded_requests=3, cost_requests=10, cost_rounds=2, prompt_words=20)
    result = overload.run(settings, log_dir=tmp_path)
    summary, burst = result["summary"], result["burst"]
    assert summary["lost"] == 0 and summary["duplicate_ids"] == 0
    assert burst["light_status"] == {"200": burst["sent"]["light"]}  # interactive: all served
    assert burst["heavy_outcomes"].get("429 tenant_rate_limited", 0) > 0  # 20 open, 8 allowed
    assert burst["heavy_outcomes"].get("200", 0) > 0
    assert len(summary["cpu_ratios"]) == 2 and summary["cpu_ms_per_request_plain"] > 0
    assert "| lost / answered twice | 0 / 0 |" in overload.tables(result)

"""The py-spy profile's summary of collapsed stacks."""

from __future__ import annotations

from bench.driver import py_spy


def test_profile_summary_reads_py_spy_collapsed_stacks() -> None:
    text = ("main (entrypoints/cli.py:1);run (orchestrator/disagg_flow.py:10);send (anyio/_backends/_asyncio.py:5) 3\n"
            "main (entrypoints/cli.py:1);loads (orchestrator/disagg_flow.py:12) 1\n")
    summary = py_spy.summarize_profile(text)
    assert summary["samples"] == 4
    assert summary["by_library_pct"] == {"anyio": 75.0, "project: orchestrator/": 25.0}
    assert summary["top_project_inclusive_pct"][0] == ["run (orchestrator/disagg_flow.py:10)", 75.0]

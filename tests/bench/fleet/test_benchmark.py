"""Smoke run of ``bench.fleet`` at a tiny size: 2 CTX and 1 GEN simulated workers in their host process, a real
orchestrator, a few streamed chat turns. It asserts only that the benchmark runs end to end and that its report
is well formed (and, since no cache can hit a block no prefill made, that the hit ratio never beats the oracle);
the figures come from ``python -m bench.fleet``."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest

from bench.driver import report
from bench.driver.common import TOKENIZE_SETUPS
from bench.fleet import benchmark as fleet
from bench.fleet import report as fleet_report
from bench.fleet import work as fleet_work

TINY_CHAT = replace(fleet_work.CHAT, system_tokens=1_500, session_rate=4.0, window_s=1.0, turns=2,
                    turn_tokens=(100, 300), think_mean_s=0.05, max_tokens=4)
TINY = fleet.Settings(ctx_workers=2, gen_workers=1, engine=fleet.Engine(cache_tokens=4_096), workloads=(TINY_CHAT,),
                      quiet_wait_s=0.0, seed=3)  # seed 3: three conversations in the window


@pytest.fixture(scope="module")
def result() -> dict[str, Any]:
    with pytest.MonkeyPatch.context() as patch:
        # A router the orchestrator's config refuses: the benchmark notes it and goes on.
        patch.setitem(fleet.ROUTERS, "refused", {"type": "no_such_router"})
        return fleet.run(TINY, ["round_robin", "refused"])


def test_one_router_measured_and_a_refused_one_skipped(result: dict[str, Any]) -> None:
    measured, refused = result["cells"]
    assert refused["router"] == "refused" and refused["skipped"]
    assert measured["router"] == "round_robin" and measured["workload"] == "chat"
    assert measured["errors"] == 0, measured["error_samples"]
    sessions = fleet_work.sessions(TINY_CHAT, TINY.seed)
    assert measured["requests"] == sum(len(s.turns) for s in sessions) >= 2
    assert measured["ttft_ms"]["p50"] > 0 and measured["ttft_ms"]["n"] == measured["requests"]
    assert len(measured["ctx_workers"]) == 2 and len(measured["gen_workers"]) == 1
    assert measured["ctx_prefills"]["min"] <= measured["ctx_prefills"]["max"]
    assert sum(w["prefills"] for w in measured["ctx_workers"]) + measured["gen_prefills"] == measured["requests"]
    # The ledger saw every prefill the workers counted, and no cache beat it.
    assert measured["ledger"]["queried_tokens"] == measured["queried_tokens"] > 0
    assert 0 <= measured["hit_ratio"] <= measured["oracle_hit_ratio"] <= 1
    assert measured["hit_ratio"] > 0  # every second turn repeats its first turn's prompt on a round robin of 2


def test_tables_targets_block_and_plot(result: dict[str, Any], tmp_path: Path) -> None:
    table = fleet_report.tables(result)
    assert "| chat | round_robin |" in table and "refused (chat)" in table
    assert fleet_report.targets(result) == []  # no cache_aware run here
    block = fleet_report.generated_block(result, "fleet.png")
    doc = tmp_path / "benchmarks.md"
    doc.write_text("intro\n" + report.BEGIN + "\nother benchmarks\n" + report.END + "\n")
    report.update_docs(doc, block, fleet_report.BEGIN, fleet_report.END)
    report.update_docs(doc, block, fleet_report.BEGIN, fleet_report.END)  # replaced, not appended
    text = doc.read_text()
    assert text.count(fleet_report.BEGIN) == 1 and "other benchmarks" in text
    assert fleet_report.plot(result, tmp_path / "fleet.png").read_bytes()[:4] == b"\x89PNG"


TINY_AGENT = replace(fleet_work.AGENT, system_tokens=600, session_rate=2.0, window_s=1.0, turns=2,
                     turn_tokens=(50, 150), think_mean_s=0.05, max_tokens=4)
TINY_COMPARE = replace(TINY, ctx_workers=1, engine=fleet.Engine(cache_tokens=4_096, tokenizer="reference"),
                       workloads=(TINY_AGENT,), seed=2, tokenize_setups=tuple(TOKENIZE_SETUPS))


def test_tokenize_compare_runs_the_work_on_each_setup_in_real_tokens(tmp_path: Path) -> None:
    result = fleet.run(TINY_COMPARE, ["cache_aware"])
    cells = result["cells"]
    assert [c["tokenize"] for c in cells] == list(TOKENIZE_SETUPS)
    per_token = result["settings"]["chars_per_token"]
    assert 2.5 < per_token < 5  # the reference BPE on real text, not one token per character
    work = fleet_work.sessions(TINY_AGENT, TINY_COMPARE.seed, per_token, real_text=True)
    for cell in cells:
        assert cell["errors"] == 0, cell["error_samples"]
        assert cell["followup_ttft_ms"]["n"] == len(work) and cell["followup_ttft_ms"]["p50"] > 0
        # the longest prompt: the system prompt, two turns and an answer, in the reference tokenizer's tokens (real
        # text's density varies from one stretch of it to the next: sizes hold on average, not per message)
        assert 0.6 * (600 + 2 * 50) < cell["prompt_tokens_max"] < 1.4 * (600 + 2 * 150) + 60
    assert cells[0]["prompt_tokens_max"] == cells[1]["prompt_tokens_max"]  # the same work, the same tokens
    table = fleet_report.tables(result)
    assert "| agent | cache_aware | full encode |" in table and "| agent | cache_aware | defaults |" in table
    assert "cache_aware [defaults]" in table and "--tokenize-cache-mb 0 --tokenizer-backend tokenizers" in table
    assert fleet_report.plot(result, tmp_path / "fleet.png").read_bytes()[:4] == b"\x89PNG"


def test_a_fleet_without_events_and_a_gateway_in_front_of_it(tmp_path: Path) -> None:
    """Workers that publish no KV events (the orchestrator routes by its model of their caches), and SGLang's
    gateway on the same fleet where it is installed (``python -m bench.peers.rust_gateways``), else skipped with
    the reason; no gateway runs on the fleet with events, which it would not read."""
    result = fleet.run(replace(TINY, events=(False, True)), ["cache_aware", "sglang_gateway"])
    cells = result["cells"]
    assert [(c["router"], c["events"]) for c in cells] == [("cache_aware", False), ("sglang_gateway", False),
                                                          ("cache_aware", True)]
    ours, gateway = cells[0], cells[1]
    assert ours["errors"] == 0 and 0 < ours["hit_ratio"] <= ours["oracle_hit_ratio"]
    if "skipped" in gateway:
        assert "not installed" in gateway["skipped"]
    else:
        assert gateway["errors"] == 0 and gateway["requests"] == ours["requests"]
        assert gateway["orchestrator"]["routing_decisions"] == {}
    table = fleet_report.tables(result)
    assert "| chat | cache_aware, no events |" in table and "| chat | cache_aware |" in table
    assert fleet_report.plot(result, tmp_path / "fleet.png").read_bytes()[:4] == b"\x89PNG"


def _cell(router: str, events: bool, hit: float, p50: float, p99: float) -> dict[str, Any]:
    return {"router": router, "workload": "chat", "events": events, "hit_ratio": hit, "oracle_hit_ratio": 0.85,
            "ttft_ms": {"p50": p50, "p99": p99}}


def test_without_events_cache_aware_is_held_to_the_gateways() -> None:
    """The fleet without events: cache_aware's hit ratio against SGLang's gateway's, its TTFT against the best
    gateway's; nothing against the gateways for the fleet with events, where none runs."""
    cells = [_cell("cache_aware", False, 0.84, 55, 190), _cell("sglang_gateway", False, 0.845, 54, 240),
             _cell("vllm_router", False, 0.66, 110, 180), _cell("cache_aware", True, 0.84, 50, 150)]
    found = {t["target"]: (t["measured"], t["met"]) for t in fleet_report.targets({"cells": cells})}
    assert found["cache_aware, no events, chat: hit ratio at least sglang_gateway's"] == ("0.840 vs 0.845", False)
    assert found["cache_aware, no events, chat: TTFT p50 no worse than the best gateway's"] == (
        "55 vs 54 ms (sglang_gateway)", False)
    assert found["cache_aware, no events, chat: TTFT p99 no worse than the best gateway's"] == (
        "190 vs 180 ms (vllm_router)", False)
    assert not any("gateway" in t and not t.startswith("cache_aware, no events") for t in found)

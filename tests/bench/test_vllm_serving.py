"""Smoke run of ``bench.vllm_serving`` at a tiny size on real vLLM processes (skipped, with the reason, where vLLM
is not installed), and its in-process and reporting parts, which need no vLLM. Only that the benchmark runs end to
end and returns well-formed results is asserted; the figures come from ``python -m bench.vllm_serving``."""

from __future__ import annotations

import dataclasses
import math
from pathlib import Path
from typing import Any

import pytest

from bench import report, vllm_serving, vllm_serving_measure, vllm_serving_report
from bench.bodies import gen_body, random_tokens
from bench.vllm_processes import vllm_missing_reason

TINY = vllm_serving_measure.Settings(prompts=(160,), runs=1, max_tokens=4, cost_requests=2, gen_cpu_rounds=1,
                             gen_cpu_batch=1, inprocess_runs=1, inprocess_ops=1)


def _positive(value: Any) -> bool:
    return isinstance(value, int | float) and math.isfinite(value) and value > 0


def _made_up_result() -> dict[str, Any]:
    def points(ttft: float) -> list[dict[str, Any]]:
        return [{"prompt_words": 512, "prompt_tokens": 512, "completion_tokens": 32, "ttft_ms": ttft,
                 "decode_tokens_per_s": 20.0, "first_gap_ms": 50.0, "steady_decode_tokens_per_s": 21.0,
                 "runs": [{}]}]

    cost = {"requests": 3, "prompt_tokens": 1_030, "completion_tokens": 8, "cpu_ms_per_request": 3.3,
            "wall_ms_per_request": 500.0, "idle_cpu_ms_per_s": 0.5}
    process = {kind: {"requests": 2, "cpu_ms": 12.0, "wall_ms": 200.0, "body_bytes": 4_000} for kind in ("list",
                                                                                                         "array")}
    in_process = {kind: {"us": 100.0, "cpu_us": 100.0} for kind in ("list", "array", "tolist")}
    return {"method": {"prompts": [512], "runs": 1, "max_tokens": 32}, "machine": {"cpu_model": "test"},
            "mode": "smoke", "duration_s": 60.0, "loadavg_at_end": [1.0, 1.0, 1.0],
            "phases": {vllm_serving_measure.VLLM: {"points": points(900.0)},
                       vllm_serving_measure.AGGREGATED: {"points": points(950.0)},
                       vllm_serving_measure.DISAGGREGATED: {"points": points(1_100.0), "orchestrator_cpu": cost,
                                                    "gen_cpu": [{"prompt_tokens": 512, "process": process,
                                                                 "in_process": in_process}]},
                       vllm_serving_measure.PD: {"points": points(1_050.0), "orchestrator_cpu": cost}}}


def test_list_and_array_gen_bodies_give_vllm_the_same_prompt() -> None:
    tokens = random_tokens(512)
    bodies = {kind: gen_body(tokens, kind, max_tokens=2) for kind in ("list", "array")}
    timing = vllm_serving_measure.gen_prompt_path_in_process(bodies, TINY)
    assert set(timing) == {"list", "array", "tolist"}
    assert all(_positive(t["us"]) for t in timing.values())


def test_prompts_are_distinct_and_of_the_asked_length() -> None:
    first, second = vllm_serving_measure.prompt_words(160, seed=1), vllm_serving_measure.prompt_words(160, seed=2)
    assert first != second and len(first.split()) == len(second.split()) == 160


def test_tables_block_and_plot_from_a_made_up_result(tmp_path: Path) -> None:
    result = _made_up_result()
    table = vllm_serving_report.tables(result)
    assert f"| 512 | {vllm_serving_measure.PD} | 1050 | 1.17x |" in table
    assert "quoted from issue 14" in table
    block = vllm_serving_report.generated_block(result, "plot.png")
    doc = tmp_path / "benchmarks.md"
    doc.write_text("intro\n" + report.BEGIN + "\nother benchmarks\n" + report.END + "\n")
    for _ in range(2):  # replaced, not appended
        report.update_docs(doc, block, vllm_serving_report.BEGIN, vllm_serving_report.END)
    text = doc.read_text()
    assert text.count(vllm_serving_report.BEGIN) == 1 and "other benchmarks" in text
    assert vllm_serving_report.plot(result, tmp_path / "vllm.png").read_bytes()[:4] == b"\x89PNG"


@pytest.mark.skipif(vllm_missing_reason() is not None, reason=vllm_missing_reason() or "")
def test_the_disaggregated_phase_runs_on_real_vllm() -> None:
    # One phase, not four: each vLLM start costs ~50 s of CPU, and all four phases took 5.5 min here, past the
    # suite's budget. This one runs every measurement the benchmark has (latency, the orchestrator's CPU, GEN's CPU
    # on both paths); the other phases differ only in the command lines they start (tests/vllm runs those servers).
    result = vllm_serving.run(dataclasses.replace(TINY, setups=(vllm_serving_measure.DISAGGREGATED,)))
    assert list(result["phases"]) == [vllm_serving_measure.DISAGGREGATED]
    (found,) = result["phases"][vllm_serving_measure.DISAGGREGATED]["points"]
    assert found["prompt_tokens"] >= 128 and found["completion_tokens"] == TINY.max_tokens
    assert _positive(found["ttft_ms"]) and _positive(found["decode_tokens_per_s"])
    cost = result["phases"][vllm_serving_measure.DISAGGREGATED]["orchestrator_cpu"]
    assert cost["requests"] == TINY.cost_requests and cost["cpu_ms_per_request"] >= 0
    (gen,) = result["phases"][vllm_serving_measure.DISAGGREGATED]["gen_cpu"]
    assert all(gen["process"][kind]["requests"] == 1 and gen["process"][kind]["body_bytes"] > 0
               for kind in ("list", "array"))
    assert all(_positive(gen["in_process"][kind]["us"]) for kind in ("list", "array", "tolist"))
    assert f"| {vllm_serving_measure.DISAGGREGATED} |" in vllm_serving_report.tables(result)

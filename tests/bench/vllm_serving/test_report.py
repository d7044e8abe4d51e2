"""bench.vllm_serving's report from a made-up result: its tables, its block of docs/benchmarks.md, its plot."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from bench.driver import report
from bench.vllm_serving import measure as vllm_serving_measure
from bench.vllm_serving import report as vllm_serving_report


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


def test_tables_block_and_plot_from_a_made_up_result(tmp_path: Path) -> None:
    result = _made_up_result()
    table = vllm_serving_report.tables(result)
    assert f"| 512 | {vllm_serving_measure.PD} | 1050 | 1.17x |" in table
    assert "(this run)" in table and "quoted" not in table  # only this run's figures; earlier ones are in git
    block = vllm_serving_report.generated_block(result, "plot.png")
    doc = tmp_path / "benchmarks.md"
    doc.write_text("intro\n" + report.BEGIN + "\nother benchmarks\n" + report.END + "\n")
    for _ in range(2):  # replaced, not appended
        report.update_docs(doc, block, vllm_serving_report.BEGIN, vllm_serving_report.END)
    text = doc.read_text()
    assert text.count(vllm_serving_report.BEGIN) == 1 and "other benchmarks" in text
    assert vllm_serving_report.plot(result, tmp_path / "vllm.png").read_bytes()[:4] == b"\x89PNG"

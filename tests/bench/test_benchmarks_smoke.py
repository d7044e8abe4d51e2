"""Smoke runs of every benchmark at a tiny size, so that they cannot rot.

These are not timed tests: they assert only that each benchmark runs end to end (real subprocess servers on
loopback, the load generator and the prober in their own processes) and returns well-formed results, and that the
report and the plots can be made from them. The figures themselves come from ``python -m bench.run_all``.
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

import pytest

from bench import cancel_storm, gen_http, reference, run_all
from bench.driver import plots, report
from bench.driver.load_point import Phases
from bench.prompt_path import benchmark as prompt_path
from bench.prompt_path import report as prompt_path_report
from bench.system_load import benchmark as system_load
from bench.system_load import report as system_load_report

TINY = Phases(warmup_s=0.1, max_warmup_s=5.0, measure_s=0.3, max_measure_s=3.0, tail_s=5.0,
                          max_total_s=20.0, quiet_wait_s=0.0)


def _positive(value: Any) -> bool:
    return isinstance(value, int | float) and math.isfinite(value) and value > 0


@pytest.fixture(scope="module")
def prompt_path_result() -> dict[str, Any]:
    return prompt_path.run((1_000,), warmups=1, runs=1, ops=1)


@pytest.fixture(scope="module")
def gen_http_result() -> dict[str, Any]:
    return gen_http.run((1_000,), batches=1, min_batch_s=0.05, warmups=1)


@pytest.fixture(scope="module")
def system_load_result() -> dict[str, Any]:
    return system_load.run((256,), (1, 2), TINY, profile=True, api_workers=True, idle_s=0.2)


def test_prompt_path_runs_and_is_well_formed(prompt_path_result: dict[str, Any]) -> None:
    (size,) = prompt_path_result["sizes"]
    assert size["tokens"] == 1_000
    for path in prompt_path.PATHS:
        assert _positive(size["timing"][path]["ms"])
        assert size["allocation"][path]["peak_beyond_body_bytes"] >= 0
    assert size["speedup_list_over_array"] > 0 and size["array_over_floor"] > 0
    assert size["pickle"]["list"]["identical_tokens"] and size["pickle"]["array"]["identical_tokens"]
    assert size["pickle"]["array"]["array_path_built_list_when_pickled"] is False
    assert set(size["stages_ms"]["list"]) == set(size["stages_ms"]["array"])
    assert prompt_path_report.targets(prompt_path_result) == []  # no 131,072-token point at this size
    assert "| 1,000 |" in prompt_path_report.tables(prompt_path_result)


def test_gen_worker_cpu_per_request_runs(gen_http_result: dict[str, Any]) -> None:
    (size,) = gen_http_result["sizes"]
    for kind in ("list", "array", "metadata"):
        assert size[kind]["requests"] >= 3
        assert size[kind]["cpu_ms"] >= 0 and _positive(size[kind]["wall_ms"])
    assert size["metadata"]["body_bytes"] < size["array"]["body_bytes"] < size["list"]["body_bytes"]
    assert "| 1,000 |" in gen_http.tables(gen_http_result)


def test_system_under_load_runs_every_scenario(system_load_result: dict[str, Any]) -> None:
    cells = system_load_result["cells"]
    assert {(c["mode"], c["concurrency"]) for c in cells} == {(m, c) for m in ("orchestrator", "direct")
                                                              for c in (1, 2)}
    for cell in cells:
        assert cell["errors"] == 0, cell["error_samples"]
        assert cell["ok_requests"] >= 1 and _positive(cell["requests_per_s"])
        assert _positive(cell["ttft_ms"]["p50"]) and cell["ttft_ms"]["p99"] >= cell["ttft_ms"]["p50"]
        assert set(cell["event_loop_lag_ms"]) == {"orchestrator", "ctx", "gen"}
        assert set(cell["cpu_ms_per_request"]) >= {"orchestrator", "ctx", "gen", "loadgen"}
    assert set(system_load_result["idle_probe_ms"]) == {"orchestrator", "ctx", "gen"}
    meta = system_load_result["metadata_only"]
    assert meta["runs"] and meta["ctx_reply"]["with_b64"]["bytes"] > meta["ctx_reply"]["without_b64"]["bytes"]
    for key in ("profile", "profile_at_target"):
        profile = system_load_result.get(key, {"available": False})
        assert profile["available"] in (True, False)  # py-spy may be missing or not allowed to attach
        if profile["available"]:
            assert profile["samples"] >= 0 and "by_library_pct" in profile
    api = system_load_result["api_workers"]
    if api["available"]:
        assert {r["api_workers"] for r in api["runs"]} == {1, 2}
    table = system_load_report.tables(system_load_result)
    assert "| 256 | 1 |" in table and "| 256 | 2 |" in table


def test_reference_engine_disaggregated_against_aggregated(tmp_path: Path) -> None:
    # The tiny random model: this proves the benchmark's processes, streams and table work; that the real model
    # answers the same both ways is tests/workers/engines/reference/test_disaggregation_real.py's job.
    from tests.workers.engines.reference.tiny_model import write_tiny_model

    # Seed 3: its greedy tokens on this prompt are printable ASCII (']' each), so every token is its own text
    # frame; most random byte tokens are partial UTF-8 that the detokenizer holds back, leaving no first gap.
    model = write_tiny_model(tmp_path / "tiny.gguf", seed=3)
    result = reference.run((16,), runs=1, max_tokens=3, model_path=str(model))
    (point,) = result["points"]
    for mode in ("aggregated", "disaggregated"):
        assert point[mode]["prompt_tokens"] >= 1 and point[mode]["completion_tokens"] == 3
        assert _positive(point[mode]["ttft_ms"]) and point[mode]["runs"][0]["text_frames"] == 3
        # The tiny model decodes in well under a millisecond, so two frames may share one read: the gap is
        # measured (a number) but may be 0.
        assert point[mode]["first_gap_ms"] >= 0 and math.isfinite(point[mode]["first_gap_ms"])
    assert point["kv_handoff_mb"] > 0
    assert point["identical_output"] is True  # temperature 0, BLAS 1 thread: bitwise the same
    assert f"| {point['aggregated']['prompt_tokens']} |" in reference.tables(result)


def test_report_and_plots_from_the_smoke_results(tmp_path: Path, prompt_path_result: dict[str, Any],
                                                 gen_http_result: dict[str, Any],
                                                 system_load_result: dict[str, Any]) -> None:
    results = {"prompt_path": prompt_path_result, "gen_http": gen_http_result, "system_load": system_load_result}
    written = run_all.make_plots(results, tmp_path, " (smoke)")
    assert {p.name for p in written} == {"prompt_path.png", "cpu_per_request.png", "load_latency.png"}
    for png in written:
        assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and png.stat().st_size > 1000
    block = run_all.generated_block(results, {"cpu_model": "test", "versions": {}}, "smoke", 1.0, ".")
    assert block.startswith(report.BEGIN) and block.endswith(report.END)
    doc = tmp_path / "benchmarks.md"
    doc.write_text("# Benchmarks\n\nintro\n\n" + report.BEGIN + "\nold\n" + report.END + "\n\nanalysis\n")
    report.update_docs(doc, block)
    text = doc.read_text()
    assert "old" not in text and text.startswith("# Benchmarks\n\nintro") and text.endswith("analysis\n")
    assert text.count(report.BEGIN) == 1


def test_reference_plot_from_a_made_up_result(tmp_path: Path) -> None:
    point = {mode: {"prompt_tokens": 8, "ttft_ms": 10.0, "decode_tokens_per_s": 5.0} for mode in
             ("aggregated", "disaggregated")}
    png = plots.reference_plot({"points": [point]}, tmp_path / "reference.png")
    assert png.read_bytes()[:4] == b"\x89PNG"


def test_cancel_storm_runs_on_both_setups(tmp_path: Path) -> None:
    from tests.workers.engines.reference.tiny_model import write_tiny_model

    model = write_tiny_model(tmp_path / "tiny.gguf", seed=0)
    result = cancel_storm.run(rounds=2, requests=2, long_words=64, short_words=8, cancel_after_s=0.05,
                              model_path=str(model))
    assert set(result["setups"]) == {"aggregated", "disaggregated"}
    assert result["method"]["target_p90_ratio"] == cancel_storm.TARGET_RATIO == 1.5
    for setup in result["setups"].values():
        assert len(setup["rounds"]) == 2
        for key in ("idle_ttft_ms", "after_storm_ttft_ms"):
            values = [r[key] for r in setup["rounds"]]
            assert all(_positive(v) for v in values)
            assert setup[key]["p50"] <= setup[key]["p90"] <= setup[key]["max"] == max(values)
        assert _positive(setup["p50_ratio"]) and _positive(setup["p90_ratio"])
        assert setup["p90_ratio"] == setup["after_storm_ttft_ms"]["p90"] / setup["idle_ttft_ms"]["p90"]
        assert setup["within_target"] == (setup["p90_ratio"] <= 1.5)
        assert all(r["drain_after_short_s"] >= 0 for r in setup["rounds"])
    assert "| aggregated |" in cancel_storm.tables(result)


def test_system_under_load_with_the_reference_tokenizer_compares_tokenization_setups() -> None:
    from bench.driver.bodies import corpus_text
    from bench.driver.common import TOKENIZE_SETUPS
    from workers.engines.synthetic import reference_tokens

    result = system_load.run((256,), (1,), TINY, profile=False, api_workers=False, idle_s=0.2,
                             tokenize_compare=True, distinct_prompts=True)
    method = result["method"]
    assert method["tokenizer"] == "reference" and method["text"] == "corpus" and 2 < method["chars_per_token"] < 5
    # the prompt text the load generator sent: about 256 tokens of the reference tokenizer (real text's density
    # varies from one stretch to the next: sizes hold on average, not per prompt)
    sent = corpus_text(round(256 * method["chars_per_token"]))
    assert 150 < reference_tokens().tokenizer.encode(sent).size < 360
    runs = result["tokenize_compare"]["runs"]
    assert [r["tokenize"] for r in runs] == list(TOKENIZE_SETUPS)
    for cell in [*result["cells"], *runs]:
        assert cell["errors"] == 0, cell["error_samples"]
        assert cell["prompt_tokens"] == 256 and _positive(cell["ttft_ms"]["p50"]) and cell["distinct_prompts"]
    table = system_load_report.tables(result)
    assert "| full encode | `--tokenize-cache-mb 0 --tokenizer-backend tokenizers` | 256 | 1 |" in table
    assert "| defaults | `defaults` | 256 | 1 |" in table and "Workers' tokenizer: reference" in table
    assert "Every request sent a prompt of its own" in table and "Python standard library's source" in table

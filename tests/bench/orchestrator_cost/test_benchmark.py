"""Smoke run of ``bench.orchestrator_cost`` at a tiny size: real subprocesses (mock workers, the orchestrator, the
pass-through proxy, the load generator) on loopback, on completions and on chat. It asserts only that the benchmark
runs end to end and returns well-formed results; the figures come from ``python -m bench.orchestrator_cost``. The
Rust gateways are left out here (tests/bench/peers/test_rust_gateways.py measures them where they are installed)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import orjson
import pybase64
import pytest

from bench.driver import report
from bench.driver.load_point import Phases
from bench.orchestrator_cost import benchmark as orchestrator_cost
from bench.orchestrator_cost import report as orchestrator_cost_report
from bench.peers import mock_workers

TINY = Phases(warmup_s=0.1, max_warmup_s=5.0, measure_s=0.3, max_measure_s=3.0, tail_s=5.0, max_total_s=20.0,
              quiet_wait_s=0.0)


@pytest.fixture(scope="module")
def result() -> dict[str, Any]:
    name, options = orchestrator_cost.api_workers_setup(2)
    return orchestrator_cost.run((256,), (1, 2), TINY, idle_s=0.3,
                                 setups={**orchestrator_cost.ORCHESTRATORS, name: options},
                                 endpoints=("completions",), gateways=False)


CHAT_TOKENS = 16  # twice the default (orchestrator_cost.MAX_TOKENS): ``--tokens`` reaches the mocks


@pytest.fixture(scope="module")
def chat_result() -> dict[str, Any]:
    return orchestrator_cost.run((256,), (1,), TINY, idle_s=0.3, metadata_only=False,
                                 setups=dict(orchestrator_cost.ORCHESTRATORS), endpoints=("chat",), gateways=False,
                                 frame_gap_ms=4.0, tokens=CHAT_TOKENS)


def test_every_setup_is_measured_beside_the_baseline(result: dict[str, Any]) -> None:
    setups = {(c["setup"], c["concurrency"]) for c in result["cells"]}
    assert setups == {("orchestrator", 1), ("orchestrator", 2), ("metadata-only", 1), ("metadata-only", 2),
                      ("pass-through", 1), ("pass-through", 2), ("direct", 1),
                      ("orchestrator x2", 2)}  # two front ends: at the highest concurrency only
    for cell in result["cells"]:
        assert cell["errors"] == 0, cell["error_samples"]
        assert cell["ok_requests"] >= 1 and cell["ttft_ms"]["p50"] > 0
        if cell["setup"] != "direct":
            assert cell["cpu_ms_per_request"]["proxy"] >= 0
        assert cell["endpoint"] == "completions" and cell["legs"]["gen_posts"] >= cell["ok_requests"]
    assert set(result["idle_cpu_ms_per_s"]) == {"orchestrator", "metadata-only", "pass-through", "orchestrator x2"}
    assert result["gateways"] == {} and result["method"]["frame_gap_ms"] == orchestrator_cost.FRAME_GAP_MS


def test_tables_targets_block_and_plot(result: dict[str, Any], tmp_path: Path) -> None:
    table = orchestrator_cost_report.tables(result)
    assert "| 256 | completions | 1 | orchestrator |" in table and "| 256 | completions | 2 | pass-through |" in table
    targets = orchestrator_cost_report.targets(result)
    assert len(targets) == 9 and targets[7]["target"].startswith("req/s of `orchestrator x2` >= 1.7x")
    assert targets[7]["met"] is not None
    assert targets[-1]["target"].startswith("CPU/req <= the best Rust gateway's: no Rust gateway measured")
    assert targets[-1]["met"] is None
    block = orchestrator_cost_report.generated_block(result, "plot.png")
    doc = tmp_path / "benchmarks.md"
    doc.write_text("intro\n" + report.BEGIN + "\nother benchmarks\n" + report.END + "\n")
    begin, end = orchestrator_cost_report.BEGIN, orchestrator_cost_report.END
    report.update_docs(doc, block, begin, end)
    report.update_docs(doc, block, begin, end)  # replaced, not appended
    text = doc.read_text()
    assert text.count(orchestrator_cost_report.BEGIN) == 1 and "other benchmarks" in text
    png = orchestrator_cost_report.plot(result, tmp_path / "cost.png")
    assert png.read_bytes()[:4] == b"\x89PNG"


def test_the_mock_ctx_answer_is_one_gen_can_continue_from() -> None:
    answer = orjson.loads(mock_workers.context_answer(1_000, with_b64=True))
    params = answer["choices"][0]["disaggregated_params"]
    assert answer["choices"][0]["finish_reason"] == "length" and params["encoded_opaque_state"]
    assert len(pybase64.b64decode(answer["prompt_token_ids_b64"], validate=True)) == 4 * 1_000
    assert "prompt_token_ids_b64" not in orjson.loads(mock_workers.context_answer(1_000, with_b64=False))
    assert len(mock_workers.generation_frames(8)) == 10  # 8 tokens, [DONE], the last chunk


def test_a_chat_cell_streams_chat_through_every_setup(chat_result: dict[str, Any]) -> None:
    assert {(c["setup"], c["endpoint"]) for c in chat_result["cells"]} == {
        ("orchestrator", "chat"), ("pass-through", "chat"), ("direct", "chat")}
    for cell in chat_result["cells"]:
        assert cell["errors"] == 0, cell["error_samples"]
        assert cell["ok_requests"] >= 1 and cell["legs"]["ctx_posts"] >= 1 and cell["legs"]["gen_posts"] >= 1
    assert chat_result["method"]["endpoints"] == {"chat": "/v1/chat/completions"}
    assert chat_result["method"]["frame_gap_ms"] == 4.0 and chat_result["method"]["max_tokens"] == CHAT_TOKENS
    for cell in chat_result["cells"]:
        # GEN streamed CHAT_TOKENS frames 4 ms apart, not the default 8: each answer took the gaps between them,
        # less the at most 1 ms a timer of the mock's loop may fire early.
        assert cell["max_tokens"] == CHAT_TOKENS and cell["latency_ms"]["p50"] >= (CHAT_TOKENS - 1) * 3
    table = orchestrator_cost_report.tables(chat_result)
    assert "| 256 | chat | 1 | orchestrator |" in table and "| 256 | chat | 1 | pass-through |" in table
    targets = orchestrator_cost_report.targets(chat_result)
    assert targets[0]["target"].endswith(", c=1, chat")  # no completions cells: the older targets read chat's
    assert f"{CHAT_TOKENS} frames 4 ms apart" in orchestrator_cost_report.method_note(chat_result)


def test_the_scaling_command_is_for_a_machine_with_spare_cores() -> None:
    check = orchestrator_cost.scaling_command(2, (1, 16, 64), (1_024, 131_072))
    assert check["command"] == ("python -m bench.orchestrator_cost --prompts 1024 --concurrency 64 --endpoint both "
                                "--no-gateways --api-workers 2")
    assert check["cores_needed"] == 5


def test_tokens_below_two_are_refused_before_anything_starts(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exit_:
        orchestrator_cost.main(["--tokens", "1", "--no-gateways"])
    assert exit_.value.code == 2 and "--tokens must be at least 2" in capsys.readouterr().err

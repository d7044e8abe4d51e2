"""``disagg-serve bench`` against the synthetic system: orchestrator + CTX + GEN on loopback, real HTTP."""

from __future__ import annotations

import json
import logging
from collections.abc import Iterator
from pathlib import Path

import pytest

from entrypoints.cli import main
from tests.cluster import MODEL, Cluster, cluster_running


@pytest.fixture(autouse=True)
def _logging_as_it_was() -> Iterator[None]:
    """``main`` configures the root logger (a handler on this test's captured stderr): put it back after."""
    root = logging.getLogger()
    handlers, level = root.handlers[:], root.level
    yield
    root.handlers[:] = handlers
    root.setLevel(level)


@pytest.fixture(scope="module")
def cluster() -> Iterator[Cluster]:
    with cluster_running() as running:
        yield running


def test_closed_loop_chat_reports_every_figure_and_writes_json_and_a_png(
        cluster: Cluster, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    out, plot = tmp_path / "result.json", tmp_path / "ttft_itl.png"
    code = main(["bench", "--url", cluster.orchestrator.url, "--endpoint", "chat", "--prompt-tokens", "64",
                 "--output-tokens", "8", "--num-requests", "12", "--concurrency", "4", "--out", str(out),
                 "--plot", str(plot)])
    printed = capsys.readouterr()
    assert code == 0, printed.err
    result = json.loads(out.read_text())
    summary = result["summary"]
    assert (summary["requests"], summary["ok"], summary["errors"]) == (12, 12, {})
    assert result["config"]["model"] == MODEL  # read from /v1/models: none was given
    assert summary["output_tokens"] == 12 * 8  # from each stream's usage chunk
    assert summary["ttft_ms"]["n"] == 12 and summary["e2e_ms"]["n"] == 12
    assert summary["itl_ms"]["n"] > 0
    for figure in ("ttft_ms", "itl_ms", "e2e_ms"):
        assert summary[figure]["p50"] <= summary[figure]["p90"] <= summary[figure]["p99"]
    assert summary["requests_per_s"] > 0 and summary["output_tokens_per_s"] > 0
    assert all(r["ok"] and r["output_tokens"] == 8 for r in result["requests"])
    assert cluster.orchestrator.recorder.count() >= 12  # the load really went through the orchestrator
    for label in ("TTFT", "ITL", "end-to-end", "req/s", "output tok/s", "errors"):
        assert label in printed.out
    assert "12/12" in printed.err  # the progress bar's last line
    assert plot.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_poisson_rate_with_prompts_from_a_jsonl_file(cluster: Cluster, tmp_path: Path,
                                                    capsys: pytest.CaptureFixture[str]) -> None:
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text('{"prompt": "Hello there, how are you?"}\n\n'
                       '{"messages": [{"role": "user", "content": "Name a colour."}], "max_tokens": 3}\n')
    out = tmp_path / "result.json"
    code = main(["bench", "--url", cluster.orchestrator.url + "/v1", "--model", MODEL, "--prompts", str(prompts),
                 "--output-tokens", "5", "--num-requests", "6", "--request-rate", "200", "--out", str(out)])
    assert code == 0, capsys.readouterr().err
    result = json.loads(out.read_text())
    assert result["summary"]["ok"] == 6
    assert result["config"]["load"] == "request rate 200.0/s (Poisson)"
    # The prompts alternate; the second asks for 3 tokens itself. The server counts the prompt tokens.
    assert [r["output_tokens"] for r in result["requests"]] == [5, 3, 5, 3, 5, 3]
    assert all(r["prompt_tokens"] and r["prompt_tokens"] > 0 for r in result["requests"])


def test_failures_are_counted_by_kind_and_the_exit_status_says_nothing_succeeded(
        cluster: Cluster, capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    out = tmp_path / "result.json"
    code = main(["bench", "--url", cluster.orchestrator.url, "--model", "no-such-model", "--num-requests", "3",
                 "--concurrency", "1", "--out", str(out)])
    assert code == 1
    assert "http_404: 3" in capsys.readouterr().out
    assert json.loads(out.read_text())["summary"]["errors"] == {"http_404": 3}


def test_a_bad_prompt_file_is_refused_naming_the_line(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text('{"prompt": "fine"}\n{"text": "wrong field"}\n')
    assert main(["bench", "--url", "http://127.0.0.1:9", "--prompts", str(prompts)]) == 2
    assert "prompts.jsonl:2" in capsys.readouterr().err

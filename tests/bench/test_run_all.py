"""``bench.run_all`` knows every benchmark: each command in bench/ is in its registry or named as a helper, so a new
benchmark cannot be left out of ``--all``; one cheap benchmark runs through it, and one that cannot run here is
skipped with its reason, not a crash."""

from __future__ import annotations

import dataclasses
import importlib
import json
from pathlib import Path

import pytest

from bench import loopback_floor, run_all

BENCH_DIR = Path(run_all.__file__).parent


def _commands() -> dict[str, str]:
    """Every module in bench/ with a ``main``, by the name ``python -m bench.<name>`` runs it under, and its source: a
    folder's ``benchmark.py`` runs as the folder (its ``__main__.py``)."""
    found = {}
    for path in sorted(BENCH_DIR.rglob("*.py")):
        if path.stem in {"__init__", "__main__"}:
            continue
        parts = path.relative_to(BENCH_DIR).with_suffix("").parts
        module = importlib.import_module(".".join(("bench", *parts)))
        if callable(getattr(module, "main", None)):
            if parts[-1] == "benchmark":
                assert (path.parent / "__main__.py").exists(), path
                parts = parts[:-1]
            found[".".join(parts)] = path.read_text()
    return found


def test_every_command_is_a_registered_benchmark_or_a_named_helper() -> None:
    commands = _commands()
    assert set(commands) == set(run_all.BENCHMARKS) | set(run_all.HELPERS)
    assert not set(run_all.BENCHMARKS) & set(run_all.HELPERS)
    # Whatever writes a result (--json) or a block of the page (--docs) and is not a helper is in the registry.
    writers = {name for name, source in commands.items() if '"--json"' in source or "add_docs_flag(" in source}
    assert writers - set(run_all.HELPERS) <= set(run_all.BENCHMARKS)
    assert set(run_all.NAMES) <= set(run_all.BENCHMARKS)


def test_the_registry_publishes_what_publishes_its_own_block() -> None:
    own_docs = {name for name, source in _commands().items() if "add_docs_flag(" in source}
    published = {name for name, benchmark in run_all.BENCHMARKS.items() if benchmark.publish}
    assert published == own_docs - {"run_all"}


def test_list_names_every_benchmark_once(capsys: pytest.CaptureFixture[str]) -> None:
    assert run_all.main(["--list"]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert [line.split()[0] for line in lines] == list(run_all.BENCHMARKS)
    assert all(len(line.split()) > 1 for line in lines)


def test_a_benchmark_off_the_page_runs_quick_through_run_all(tmp_path: Path,
                                                             capsys: pytest.CaptureFixture[str]) -> None:
    assert run_all.main(["--quick", "--no-docs", "--out", str(tmp_path), "--only", "loopback_floor"]) == 0
    result = json.loads((tmp_path / "loopback_floor.json").read_text())
    assert result["mode"] == "quick" and result["rounds"] == 30
    assert [s["bytes"] for s in result["sizes"]] == list(loopback_floor.SIZES.values())
    assert all(s["cpu_ms"] >= 0 for s in result["sizes"])
    out = capsys.readouterr().out
    assert "### loopback_floor" in out and "| metadata-only at 131k (524 KB in, 524 KB out) | 524,366 |" in out
    assert "loopback_floor" in json.loads((tmp_path / "summary.json").read_text())["durations_s"]


def test_a_benchmark_that_cannot_run_here_is_skipped_with_its_reason(tmp_path: Path,
                                                                    capsys: pytest.CaptureFixture[str],
                                                                    monkeypatch: pytest.MonkeyPatch) -> None:
    unavailable = dataclasses.replace(run_all.BENCHMARKS["vllm_serving"], missing=lambda: "no vLLM on this machine")
    monkeypatch.setitem(run_all.BENCHMARKS, "vllm_serving", unavailable)
    assert run_all.main(["--quick", "--no-docs", "--out", str(tmp_path), "--only", "vllm_serving"]) == 0
    assert not (tmp_path / "vllm_serving.json").exists()
    assert json.loads((tmp_path / "summary.json").read_text())["skipped"] == {"vllm_serving": "no vLLM on this machine"}
    captured = capsys.readouterr()
    assert "skipped: no vLLM on this machine" in captured.out
    assert "[bench] skipping vllm_serving: no vLLM on this machine" in captured.err

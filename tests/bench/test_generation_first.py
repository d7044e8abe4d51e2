"""A smoke run of ``bench.generation_first`` on the tiny random model: both lifecycle pairs start, both schedules
answer every request through the trtllm protocol, the answers match between schedules, v1 really grants, and the
table has a row per lifecycle, prompt and concurrency. Not timed: the figures come from a real run
(docs/interop.md)."""

from __future__ import annotations

from pathlib import Path

from bench import generation_first


def test_generation_first_bench_runs_and_both_schedules_answer_alike(tmp_path: Path) -> None:
    from tests.workers.engines.reference.tiny_model import write_tiny_model

    model = write_tiny_model(tmp_path / "tiny.gguf", seed=0)
    result = generation_first.run(prompt_words=(8, 32), concurrency=(1, 2), rounds=1, max_tokens=3,
                                  model_path=str(model))
    points = result["points"]
    assert [(p["lifecycle"], p["prompt_words"], p["concurrency"]) for p in points] == [
        (lifecycle, words, level) for lifecycle in ("v0", "v1") for words in (8, 32) for level in (1, 2)]
    assert result["all_identical"] and all(p["text"] for p in points)
    for p in points:
        for mode in generation_first.MODES:
            assert len(p[mode]["ttft_ms"]) == p["concurrency"] and p[mode]["ttft_ms_p50"] > 0
    events = result["lifecycle_events"]
    assert events["v1"]["generation_first"].get("grant_accepted", 0) >= 6 and not events["v0"]["context_first"]
    table = generation_first.tables(result).splitlines()
    assert len(table) == 2 + len(points) and table[0].count("|") == 11
    assert all(line.endswith("| yes |") for line in table[2:])

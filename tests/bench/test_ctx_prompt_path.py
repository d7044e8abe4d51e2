"""bench.ctx_prompt_path at smoke size: it runs, checks the ids against tokenizers itself, and a follow-up turn is a
cache hit whose tokenization costs less than the whole encode it replaces (a count of work, not a time)."""

from __future__ import annotations

from bench import ctx_prompt_path


def test_ctx_prompt_path_runs_and_reports_both_turns() -> None:
    result = ctx_prompt_path.run((2_000,), runs=1)
    rows = result["rows"]
    assert [row["case"] for row in rows] == ["new", "follow-up"]
    assert result["method"]["encoder"] == "fastokens"
    for row in rows:
        assert 1_500 < row["prompt_tokens"] < 2_600
        assert set(row["ms"]) >= {"parse", "render", "tokenize", "b64 encode", "whole", "whole (tokenizers)", "gen"}
    table = ctx_prompt_path.tables(result)
    assert "follow-up" in table and "GEN prompt path" in table


def test_a_follow_up_of_the_benchmark_extends_its_conversation() -> None:
    earlier = ctx_prompt_path.conversation(5_000, 4.0, seed=3)
    later = ctx_prompt_path.follow_up_of(earlier)
    assert later[: len(earlier)] == earlier and later[-1]["role"] == "user"
    assert ctx_prompt_path.conversation(5_000, 4.0, seed=4)[0] != earlier[0]  # each conversation is new

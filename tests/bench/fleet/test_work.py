"""bench.fleet's work: seeded, the same for every router."""

from __future__ import annotations

from bench.fleet import work as fleet_work


def test_every_router_gets_the_same_work() -> None:
    assert fleet_work.sessions(fleet_work.CHAT, 7) == fleet_work.sessions(fleet_work.CHAT, 7)
    chat = fleet_work.sessions(fleet_work.CHAT, 7)
    assert len({s.system for s in chat}) == 2 and all(len(s.turns) == fleet_work.CHAT.turns for s in chat)
    assert all(s.system is None and len(s.turns) == 1 for s in fleet_work.sessions(fleet_work.UNRELATED, 7))


def test_sizes_are_tokens_written_at_the_tokenizers_characters_per_token() -> None:
    assert fleet_work.sessions(fleet_work.AGENT, 7, 1.0) == fleet_work.sessions(fleet_work.AGENT, 7)  # byte: as ever
    (first, *_) = fleet_work.sessions(fleet_work.AGENT, 7, 2.5)
    assert first.system is not None and len(first.system) == round(fleet_work.AGENT.system_tokens * 2.5)
    low, high = fleet_work.AGENT.turn_tokens
    assert all(2.5 * low - 1 <= len(turn) <= 2.5 * high + 1 for turn in first.turns)


def test_agent_growing_grows_each_conversation_past_100k_tokens() -> None:
    work = fleet_work.sessions(fleet_work.AGENT_GROWING, 7)  # one character a token
    assert len(work) >= 2
    for session in work:
        assert session.system is not None and len(session.system) >= 95_000
        assert len(session.system) + sum(len(t) for t in session.turns) > 100_000


def test_real_text_for_a_real_tokenizer() -> None:
    work = fleet_work.sessions(fleet_work.AGENT, 7, 3.5, real_text=True)
    first = work[0]
    assert first.system is not None and first.system.startswith("System prompt 0 (agent).\n")
    assert len(first.system) == round(fleet_work.AGENT.system_tokens * 3.5)
    assert "def " in first.system + "".join(first.turns)  # the Python standard library's source
    turns = [t for s in work for t in s.turns]
    assert len(set(turns)) == len(turns)  # every tool result its own text
    assert fleet_work.sessions(fleet_work.AGENT, 7, 3.5, real_text=True) == work

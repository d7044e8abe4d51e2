"""bench.fleet's work: seeded, the same for every router."""

from __future__ import annotations

from bench import fleet_work


def test_every_router_gets_the_same_work() -> None:
    assert fleet_work.sessions(fleet_work.CHAT, 7) == fleet_work.sessions(fleet_work.CHAT, 7)
    chat = fleet_work.sessions(fleet_work.CHAT, 7)
    assert len({s.system for s in chat}) == 2 and all(len(s.turns) == fleet_work.CHAT.turns for s in chat)
    assert all(s.system is None and len(s.turns) == 1 for s in fleet_work.sessions(fleet_work.UNRELATED, 7))

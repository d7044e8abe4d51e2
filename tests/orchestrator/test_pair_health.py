"""Which CTX/GEN pairs routing avoids: per pair, never per worker (two CTX and two GEN workers, one pair failing)."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from orchestrator.member import PoolMember
from orchestrator.pair_health import FailingPair, PairHealth
from tests.orchestrator.members import idle_members


@pytest.fixture
def fleet() -> Iterator[tuple[list[PoolMember], list[PoolMember]]]:
    with idle_members(2, 41000) as ctxs, idle_members(2, 42000) as gens:
        yield ctxs, gens


def test_nothing_is_avoided_while_every_pair_passes(fleet: tuple[list[PoolMember], list[PoolMember]]) -> None:
    ctxs, gens = fleet
    health = PairHealth()
    assert not health
    assert health.gens_to_avoid(ctxs[0].url, gens) == () and health.ctxs_to_avoid(ctxs, gens) == ()


def test_a_failing_pair_is_avoided_as_a_pair(fleet: tuple[list[PoolMember], list[PoolMember]]) -> None:
    (a, b), (x, y) = fleet
    health = PairHealth()
    health.failed(a.url, x.url, "GEN computed the prompt itself")
    assert health and health.is_failing(a.url, x.url) and not health.is_failing(b.url, x.url)
    assert health.gens_to_avoid(a.url, [x, y]) == (x,)  # after CTX a, GEN x is passed over...
    assert health.gens_to_avoid(b.url, [x, y]) == ()  # ...but not after CTX b: x reads b's KV fine
    assert health.gens_to_avoid(None, [x, y]) == ()  # no CTX ran (a prompt GEN prefills alone): no pair
    assert health.ctxs_to_avoid([a, b], [x, y]) == ()  # a still has y
    assert health.failing() == [FailingPair(a.url, x.url, "GEN computed the prompt itself")]


def test_a_ctx_without_a_passing_gen_is_avoided_until_one_passes(
        fleet: tuple[list[PoolMember], list[PoolMember]]) -> None:
    (a, b), (x, y) = fleet
    health = PairHealth()
    health.failed(a.url, x.url, "refused")
    health.failed(a.url, y.url, "refused")
    assert health.ctxs_to_avoid([a, b], [x, y]) == (a,)
    y.healthy = False  # a GEN that is down is no partner to count
    health.passed(a.url, y.url)
    assert health.ctxs_to_avoid([a, b], [x, y]) == (a,)  # its only routable GEN, x, still fails with it
    y.healthy = True
    assert health.ctxs_to_avoid([a, b], [x, y]) == ()
    assert health.passed(a.url, x.url) and not health.passed(a.url, x.url)  # back once, then nothing to do
    assert not health


def test_no_routable_gen_is_not_a_question_of_pairs(fleet: tuple[list[PoolMember], list[PoolMember]]) -> None:
    (a, b), (x, y) = fleet
    health = PairHealth()
    health.failed(a.url, x.url, "refused")
    x.healthy = y.healthy = False
    assert health.ctxs_to_avoid([a, b], [x, y]) == ()
